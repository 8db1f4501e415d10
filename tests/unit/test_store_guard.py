"""GuardedStore: a remote store that fails or hangs answers at once as 'no entry' / 'not kept', is not tried
again for a second while down (a dead Redis costs requests nothing), and comes back on its own."""

from __future__ import annotations

import asyncio

from pdserve.router.kv.store import UNAVAILABLE, GuardedStore


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


class Flaky:
    def __init__(self):
        self.mode = "ok"
        self.reply: BaseException | None = None   # the put's reply, after it was sent
        self.calls = 0

    def __len__(self):
        return 0

    async def _answer(self, value):
        self.calls += 1
        if self.mode == "hang":
            await asyncio.sleep(60)
        if self.mode == "error":
            raise ConnectionError("refused")
        return value

    async def put(self, *args):
        await self._answer(None)       # sent
        reply = asyncio.get_running_loop().create_future()
        if self.reply is None:
            reply.set_result(True)
        else:
            reply.set_exception(self.reply)
        return reply

    async def take_first(self, keys):
        return await self._answer((None, "no_entry"))

    async def refresh(self):
        return await self._answer(None)


async def await_put(store, *args):
    return await (await store.put(*args))


async def test_failures_answer_at_once_and_the_store_comes_back():
    inner, clock, errors, health = Flaky(), Clock(), [], []
    store = GuardedStore(inner, 0.05, lambda op, why: errors.append((op, why)), health.append, retry=1.0, clock=clock)
    assert await await_put(store, ("t", "c"), {}, "d", 0) is True
    inner.mode = "hang"
    started = asyncio.get_running_loop().time()
    assert await store.take_first([("t", "c")]) == (None, UNAVAILABLE)
    assert asyncio.get_running_loop().time() - started < 1
    assert errors == [("take", "timeout")] and health == [True, False]
    inner.mode = "error"
    calls = inner.calls
    assert await await_put(store, ("t", "c"), {}, "d", 0) is False          # down: not even tried
    assert inner.calls == calls and errors[-1] == ("put", "down")
    clock.t += 1.5
    assert await await_put(store, ("t", "c"), {}, "d", 0) is False          # one try a second
    assert inner.calls == calls + 1 and errors[-1] == ("put", "error")
    inner.mode = "ok"
    await store.refresh()                                             # the periodic check always tries
    assert store.up and health == [True, False, True]
    assert await store.take_first([("t", "c")]) == (None, "no_entry")


async def test_a_put_whose_reply_fails_after_it_was_sent_is_not_kept_and_marks_the_store_down():
    """The put's reply comes after the answer: its failure still counts (op put) and takes the store down."""
    inner, clock, errors, health = Flaky(), Clock(), [], []
    store = GuardedStore(inner, 0.05, lambda op, why: errors.append((op, why)), health.append, retry=1.0, clock=clock)
    inner.reply = ConnectionError("lost")
    assert await await_put(store, ("t", "c"), {}, "d", 0) is False
    assert errors == [("put", "error")] and health == [True, False]
    inner.reply = TimeoutError()
    clock.t += 1.5
    assert await await_put(store, ("t", "c"), {}, "d", 0) is False
    assert errors[-1] == ("put", "timeout")
    inner.reply = None
    clock.t += 1.5
    assert await await_put(store, ("t", "c"), {}, "d", 0) is True     # a reply that comes back brings it up
    assert store.up and health == [True, False, True]


async def test_while_down_one_call_a_retry_tries_and_the_calls_that_come_meanwhile_answer_at_once():
    """Before: every call that came once the retry time had passed tried, each waiting out the timeout."""
    inner, clock, errors, health = Flaky(), Clock(), [], []
    store = GuardedStore(inner, 0.05, lambda op, why: errors.append((op, why)), health.append, retry=1.0, clock=clock)
    inner.mode = "hang"
    assert await store.take_first([("t", "c")]) == (None, UNAVAILABLE)
    clock.t += 1.5
    calls = inner.calls
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes = await asyncio.gather(*(store.take_first([("t", "c")]) for _ in range(10)))
    assert outcomes == [(None, UNAVAILABLE)] * 10 and inner.calls == calls + 1
    assert sorted(errors[1:]) == [("take", "down")] * 9 + [("take", "timeout")]
    assert loop.time() - started < 1
