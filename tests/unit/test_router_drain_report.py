"""The router's stop and what it waits on: bounded, and named when it hangs (front/drain.py, front/compose.py, legs/book.py)."""

from __future__ import annotations

import asyncio
import logging

from pdserve.router.front import drain


async def close_store(closed: asyncio.Event) -> None:
    await closed.wait()


async def cleanup(closed: asyncio.Event) -> None:
    await asyncio.sleep(0)
    await close_store(closed)


def run_stop(hang_s: float, after: float, caplog) -> list[str]:
    async def stop() -> None:
        closed = asyncio.Event()
        turns_done = asyncio.create_task(asyncio.sleep(0.01))
        stopping = asyncio.create_task(cleanup(closed), name="runner.cleanup")
        watch = asyncio.create_task(drain.report_if_stuck(turns_done, stopping, after=after))
        asyncio.get_running_loop().call_later(hang_s, closed.set)
        await stopping
        await asyncio.sleep(0)
        watch.cancel()

    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        asyncio.run(stop())
    return [r.getMessage() for r in caplog.records]


def test_a_stop_that_hangs_names_each_await_it_hangs_in(caplog):
    said = run_stop(hang_s=0.3, after=0.1, caplog=caplog)
    assert said[0].startswith("drain: the stop still waits 0.1s after the last turn ended, on ")
    hung = [s for s in said if s.startswith("drain: waiting on runner.cleanup: ")]
    assert len(hung) == 1
    chain = hung[0].split(": ", 2)[2].split(" -> ")
    assert [c.split(" ")[0] for c in chain] == ["cleanup", "close_store", "wait", "a"], chain
    assert chain[1].startswith("close_store (test_router_drain_report.py:")


def test_a_stop_in_time_says_nothing(caplog):
    assert run_stop(hang_s=0.01, after=0.5, caplog=caplog) == []


def test_a_close_step_that_hangs_is_named_and_the_close_goes_on(caplog, monkeypatch):
    """Router.close bounds each step: a reuse store whose close never returns (and a background task that
    ignores its cancel) cost CLOSE_STEP_S each, are named, and the rest still closes."""
    from pdserve.router.front import compose as compose_mod
    from pdserve.router.telemetry.metrics import RouterMetrics
    from tests.kits.held_fakes import cfg
    monkeypatch.setattr(compose_mod, "CLOSE_STEP_S", 0.2)

    class HangingStore:
        async def close(self) -> None:
            await asyncio.Event().wait()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:          # swallowed once, as a library that loses a cancel would
            await asyncio.sleep(10)             # (asyncio.run's own cancel at the end stops it)

    async def close() -> tuple[float, bool]:
        router = compose_mod.compose(cfg(), RouterMetrics(), None)
        router.store = HangingStore()
        router.tasks = [asyncio.create_task(stubborn(), name="stubborn")]
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        await router.close()
        return asyncio.get_running_loop().time() - started, router.session.closed

    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        took, session_closed = asyncio.run(close())
    said = [r.getMessage() for r in caplog.records]
    assert 0.35 < took < 2.0 and session_closed
    assert any(s.startswith("closing: stubborn went on 0.2s after its cancel, at stubborn (") for s in said), said
    assert "closing: the reuse store not closed after 0.2s; going on" in said


def test_a_scrape_waits_for_store_replies_at_most_its_bound(caplog, monkeypatch):
    """/metrics waits for answered turns' shared-store replies; one that never came held every scrape, and a
    stopping router waits for its scrapes in flight (one suspect of the CI stop above). Now bounded."""
    from pdserve.router.legs import book as book_mod
    from pdserve.router.telemetry.metrics import RouterMetrics
    monkeypatch.setattr(book_mod, "COUNTED_WAIT_S", 0.2)

    async def scrape() -> float:
        book = book_mod.TurnBook(store=None, metrics=RouterMetrics())
        never = asyncio.get_running_loop().create_future()      # a put's reply that never comes
        book.storing.add(never)
        started = asyncio.get_running_loop().time()
        await book.counted()
        return asyncio.get_running_loop().time() - started

    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        took = asyncio.run(scrape())
    assert 0.15 < took < 1.0
    assert any("waited 0.2s for 1 shared-store repl(ies) that never came" in r.getMessage() for r in caplog.records)
