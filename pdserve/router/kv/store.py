"""The reuse store: where the router keeps D's finished-turn handles between turns.

A store is one file plus one line in STORES (the URL scheme of `router.store` picks it):

    memory              store_memory.MemoryStore: this process's memory (the default)
    redis://HOST:PORT/DB store_redis.RedisStore: shared by every router replica, kept across router restarts

Every store has the same semantics: an entry is taken once (atomically: two concurrent turns never both get
it), per (tenant, conversation) key, and expires `reuse_ttl` after it was put, before D lets the blocks go.
A remote store is wrapped in GuardedStore: a store that is down or slow never fails or holds up a request;
its turns are served by recomputing and counted (miss reason `store_unavailable`, turn outcome `not_stored`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.router.kv.reuse import ReuseEntry

log = logging.getLogger("pdserve.router")

Key = tuple[str, str]
MEMORY = "memory"
# scheme of router.store -> "module:class"; the class is built as cls(url, **STORE_ARGS)
STORES = {
    MEMORY: "pdserve.router.kv.store_memory:MemoryStore",
    "redis": "pdserve.router.kv.store_redis:RedisStore",
    "rediss": "pdserve.router.kv.store_redis:RedisStore",
    "unix": "pdserve.router.kv.store_redis:RedisStore",
}
UNAVAILABLE = "store_unavailable"   # the miss reason of a turn whose entry could not be read


class ReuseStore(Protocol):
    remote: bool    # False: it cannot fail (no guard, no health checks)

    def __len__(self) -> int: ...          # entries held (a remote store: as of its last refresh)

    @property
    def bytes(self) -> int: ...            # their estimated memory (idem)

    async def put(self, key: Key, params: dict[str, Any], decode: str, generation: int,
                  sequence: list[int] | None = None, alias: Key | None = None) -> asyncio.Future[bool]: ...
    # `alias` (the prompt's key, identity.prompt_key) finds the same entry: a take by either takes it, once,
    # and marks it `by_prompt`. Returns once this process's later takes will find the entry (a remote store: its write is on the
    # wire, ahead of them); the future says whether it was kept, off the answer's path (done at once in
    # memory). Another replica's take is behind it by the client's round trip (redis_pipe.py).

    async def take_first(self, keys: list[Key]) -> tuple[ReuseEntry | None, str]: ...

    async def drop_decode(self, decode: str) -> int: ...

    async def refresh(self) -> None: ...   # periodic: purge expired entries, update len/bytes, check health

    async def close(self) -> None: ...


def kept(verdict: bool) -> asyncio.Future[bool]:
    """A put's verdict known at once."""
    done = asyncio.get_running_loop().create_future()
    done.set_result(verdict)
    return done


def scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else url


def store_class(url: str) -> type:
    target = STORES.get(scheme(url))
    if target is None:
        raise ValueError(f"router.store {url!r}: not one of {', '.join(sorted(STORES))} (scheme://...)")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def open_store(url: str, *, ttl: float, max_entries: int, max_bytes: int, cluster: str, decodes: list[str],
               timeout: float, on_evict: Callable[[str, int], None], on_error: Callable[[str, str], None],
               on_health: Callable[[bool], None]) -> ReuseStore:
    cls = store_class(url)
    if scheme(url) == MEMORY:
        return cls(ttl, max_entries, max_bytes, on_evict)
    inner = cls(url, ttl=ttl, max_bytes=max_bytes, cluster=cluster, decodes=decodes, timeout=timeout,
                on_evict=on_evict)
    return GuardedStore(inner, timeout, on_error, on_health)


class GuardedStore:
    """A remote store whose every call ends within `timeout`: an error or a timeout answers as if there were
    no entry (take) or it could not be kept (put), and marks the store down. While down, calls answer at once
    without trying, except one every `retry` seconds (and the periodic refresh), which brings it back up:
    a dead Redis costs each request nothing, and the client reconnects by itself when Redis is back."""

    remote = True

    def __init__(self, inner: Any, timeout: float, on_error: Callable[[str, str], None],
                 on_health: Callable[[bool], None], retry: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.timeout = timeout
        self.on_error = on_error
        self.on_health = on_health
        self.retry = retry
        self.clock = clock
        self.up = True
        self.next_try = 0.0
        # A store whose put and take end within `timeout` by themselves (RedisStore: its pipe's watchdog)
        # spares them a timeout context each: two per turn, ~2% of the router's CPU at one client.
        self.turn_calls_bounded = bool(getattr(inner, "turn_calls_bounded", False))
        on_health(True)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def bytes(self) -> int:
        return self.inner.bytes

    async def _call(self, op: str, call: Callable[[], Any], fallback: Any, probe: bool = False,
                    settles: bool = True, self_bounded: bool = False) -> Any:
        if not self.up and not probe:
            now = self.clock()
            if now < self.next_try:
                self.on_error(op, "down")
                return fallback
            # This call tries; the calls that come while it does answer at once, as before it: one try a
            # `retry`, not every call that arrives while a try waits out `store_timeout` (issue 35).
            self.next_try = now + self.retry
        try:
            result = await (call() if self_bounded else self._bounded(call))
        except (asyncio.TimeoutError, TimeoutError):
            self._failed(op, "timeout", "no answer in %gs" % self.timeout)
            return fallback
        except Exception as err:  # noqa: BLE001 - any store failure means: serve without it
            self._failed(op, "error", f"{type(err).__name__}: {err}")
            return fallback
        if settles:     # a put's send does not: its reply says whether the store is back
            self._back()
        return result

    def _back(self) -> None:
        if not self.up:
            self.up = True
            self.on_health(True)
            log.info("reuse store is back: entries are shared again")

    async def _bounded(self, call: Callable[[], Any]) -> Any:
        async with asyncio.timeout(self.timeout):   # no task per call, unlike wait_for
            return await call()

    def _failed(self, op: str, reason: str, detail: str) -> None:
        self.on_error(op, reason)
        self.next_try = self.clock() + self.retry
        if self.up:
            self.up = False
            self.on_health(False)
            log.warning("reuse store unavailable (%s on %s): turns are served by recomputing until it is back",
                        detail, op)

    async def put(self, key: Key, params: dict[str, Any], decode: str, generation: int,
                  sequence: list[int] | None = None, alias: Key | None = None) -> asyncio.Future[bool]:
        sent = await self._call("put", lambda: self.inner.put(key, params, decode, generation, sequence, alias), None,
                                settles=False, self_bounded=self.turn_calls_bounded)
        if sent is None:
            return kept(False)
        verdict = asyncio.get_running_loop().create_future()
        sent.add_done_callback(lambda reply: verdict.set_result(self._verdict(reply)))
        return verdict

    def _verdict(self, reply: asyncio.Future[bool]) -> bool:
        """The put's reply, as _call would have judged it had it waited."""
        err = reply.exception() if not reply.cancelled() else asyncio.CancelledError()
        if err is None:
            self._back()
            return reply.result()
        if isinstance(err, (asyncio.TimeoutError, TimeoutError)):
            self._failed("put", "timeout", "no answer in %gs" % self.timeout)
        else:
            self._failed("put", "error", f"{type(err).__name__}: {err}")
        return False

    async def take_first(self, keys: list[Key]) -> tuple[ReuseEntry | None, str]:
        return await self._call("take", lambda: self.inner.take_first(keys), (None, UNAVAILABLE),
                                self_bounded=self.turn_calls_bounded)

    async def drop_decode(self, decode: str) -> int:
        return await self._call("drop", lambda: self.inner.drop_decode(decode), 0)

    async def refresh(self) -> None:
        await self._call("refresh", self.inner.refresh, None, probe=True)

    async def close(self) -> None:
        await self.inner.close()
