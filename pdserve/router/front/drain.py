"""The router's drain on SIGTERM: the turns in flight, and the ones the drain limit cuts.

`__main__.serve` stops listening (aiohttp's runner cleanup: sites stopped, idle keep-alive connections
closed) and lets the turns in flight finish for up to `drain_timeout` (router.drain_timeout, long enough for
an agent's long turn). When the limit passes, each turn still in flight is cut here: one log line (request
id, API, conversation when known), counted as the turn outcome `cut`, and its handler cancelled, which closes
its upstream requests. The supervisor waits longer than the limit before SIGKILL (plan/routers.py), so a cut
is always this, never a kill without a word.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from aiohttp import web

from pdserve.router import api
from pdserve.router.legs.flow import Flow
from pdserve.router.legs.turn import CUT, TURN, Turn
from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")

IN_FLIGHT = web.AppKey("in_flight", dict)      # id(request) -> (completion request, when it came: monotonic)
CUT_GRACE_S = 2.0     # aiohttp's own shutdown timeout comes this long after the limit: the cut turns unwind in it
# Once no turn is left, the rest of a stop (connections closed, backends' clients and the store closed) takes
# well under a second; past this, what it still waits on is written to the log, once.
STUCK_AFTER_S = 10.0



@web.middleware
async def track(request: web.Request, handler):
    """Completion requests (turns) in flight, for the drain to wait on and, past its limit, to cut."""
    if request.path not in api.BY_ROUTE:
        return await handler(request)
    in_flight = request.app[IN_FLIGHT]
    in_flight[id(request)] = (request, time.monotonic())      # a request is a mapping: not hashable
    try:
        return await handler(request)
    finally:
        in_flight.pop(id(request), None)


def conversation_of(turn: Turn | None) -> str:
    """The conversation as the router knows it: its explicit id, else its history's digest, else '-'."""
    if turn is None:
        return "-"
    conv = turn.conversation
    if conv.explicit is not None:
        return str(conv.explicit)
    return conv.digest.hex() if isinstance(conv.digest, bytes) else str(conv.digest or "-")


async def finish_or_cut(app: web.Application, flow: Flow | None, metrics: RouterMetrics, limit: float) -> int:
    """Wait until no turn is in flight or `limit` seconds pass; then cut what is left. Returns how many
    were cut."""
    in_flight: dict = app[IN_FLIGHT]
    deadline = time.monotonic() + limit
    while in_flight and time.monotonic() < deadline:
        await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    cut = list(in_flight.values())
    now = time.monotonic()
    for request, since in cut:
        turn = request.get(TURN)
        fmt = api.BY_ROUTE[request.path]
        if turn is not None and flow is not None:
            flow.book.end(turn, CUT)         # a no-op when it had its answer (it is then finishing writing it)
        elif turn is None:                   # still reading its body: no turn yet, counted as one cut
            metrics.turns.labels(CUT, fmt.api).inc()
        log.warning("drain: cut turn %s (api %s, conversation %s) after %.1fs in flight: router.drain_timeout "
                    "%gs passed", turn.request_id if turn else "-", fmt.api, conversation_of(turn), now - since,
                    limit)
        task = request.task
        if task is not None and not task.done():
            task.cancel()
    return len(cut)


async def report_if_stuck(turns_done: asyncio.Task, stopping: asyncio.Task, after: float = STUCK_AFTER_S) -> None:
    """When the stop (`stopping`) is not over `after` seconds after the turns were (`turns_done`: the cutter),
    log every task it still waits on with where each waits: a stop that hangs says why before the supervisor's
    SIGKILL (once, a CI run's router waited 125 s with no turn in flight and said nothing)."""
    await asyncio.wait([turns_done])
    done, _ = await asyncio.wait([stopping], timeout=after)
    if done:
        return
    me = asyncio.current_task()
    waiting = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    log.warning("drain: the stop still waits %gs after the last turn ended, on %d task(s):", after, len(waiting))
    for task in waiting:
        log.warning("drain: waiting on %s: %s", task.get_name(), " -> ".join(awaiting(task.get_coro())))


def awaiting(coro) -> list[str]:
    """Where a suspended coroutine waits: each coroutine of its await chain (function, file:line), then what
    the innermost awaits (a future, a task) when that is not a coroutine."""
    chain = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            if hasattr(coro, "cr_code") or hasattr(coro, "gi_code"):   # a coroutine that has finished
                break
            chain.append(f"task {coro.get_name()}" if isinstance(coro, asyncio.Task) else "a future")
            break
        chain.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return chain
