"""One pipelined Redis connection for the reuse store's per-turn calls (put, take).

Commands go out on one connection in call order, and Redis answers them in that order (RESP), so:
- a put is on the wire when `send` returns. The store's put returns then, before the client is answered.
  This replica's later takes are behind it on the same connection (Redis serves one connection in
  order). Another replica's take, on another connection, comes a client round trip later (the client
  sends its next turn only once it had the answer), while the kernel hands the put to Redis in
  microseconds; no order is promised across connections, so a take sent at the same instant can
  overtake it (a miss: recomputed, counted). The reply, which only says whether the entry was kept, is
  awaited off the answer's path (one Redis round trip less per turn).
- concurrent turns share the socket: no pool checkout per call, and Redis reads several commands a read.

The connection (its handshake: AUTH, SELECT, TLS, unix sockets) and the RESP parser are redis-py's; this
adds only the matching of replies to callers, in order.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError


class RedisPipe:
    """Every call ends within `timeout`: a connect by its own bound, a reply by its channel's watchdog."""

    def __init__(self, client: aioredis.Redis, timeout: float):
        self.pool = client.connection_pool
        self.timeout = timeout      # the longest wait for the next reply: then every call in flight fails
        self.channel: _Channel | None = None
        self.connecting = asyncio.Lock()

    async def send(self, *args: str | bytes | int, then: Callable[[Any], Any] | None = None) -> asyncio.Future:
        """Send one command now (connecting first if needed); the future is its reply (`then(reply)`, with
        `then`), or raises the error reply, a lost connection or a timeout."""
        channel = self.channel
        if channel is None or not channel.usable:
            channel = await self._open()
        return await channel.send(hiredis.pack_command(args), then)

    async def _open(self) -> _Channel:
        async with self.connecting:
            if self.channel is None or not self.channel.usable:
                # A new connection each time, never the failed one reconnected: a reply still due on the
                # old socket can then never be matched to a call sent on the new one.
                # No socket timeout: redis-py then writes at once instead of through a task per call; the
                # channel's watchdog bounds the replies, and the connect is bounded here.
                conn = self.pool.connection_class(**{**self.pool.connection_kwargs, "socket_timeout": None})
                # bounded: a Redis that accepts and then stalls (SIGSTOP: the kernel still accepts) would
                # hold the handshake's reads forever
                async with asyncio.timeout(self.timeout):
                    await conn.connect()
                self.channel = _Channel(conn, self.timeout)
            return self.channel

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class _Channel:
    """One connection, the calls in flight on it (oldest first), the task that reads their replies in
    order, and its watchdog. Once it fails, every call in flight fails and it is never used again."""

    def __init__(self, conn: Any, timeout: float):
        self.conn = conn
        self.timeout = timeout
        self.waiting: deque[tuple[asyncio.Future, Callable[[Any], Any] | None]] = deque()
        self.failed = False
        self.wake: asyncio.Future | None = None     # the reader, idle, waits on it for the next command
        loop = asyncio.get_running_loop()
        self.last_reply = loop.time()
        self.stalled = False
        self.reader = asyncio.create_task(self._read())
        loop.call_later(timeout, self._watch)

    @property
    def usable(self) -> bool:
        # not connected: redis-py closed it on an error the reader has not seen yet
        return not self.failed and self.conn.is_connected

    async def send(self, packed: Any, then: Callable[[Any], Any] | None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self.waiting:
            self.last_reply = loop.time()    # the wait for this reply starts now, not at the last one
        self.waiting.append((reply, then))   # before the write: a write that waits for the socket keeps its turn
        try:
            await self.conn.send_packed_command(packed, check_health=False)
        except BaseException as err:
            self._fail(err)                  # redis-py closed the connection: what was in flight on it is lost
            raise
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)
        return reply

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.waiting:
                    self.wake = loop.create_future()
                    await self.wake
                    self.wake = None
                try:
                    outcome = await self.conn.read_response()   # untimed: the connection has no socket timeout
                except ResponseError as err:
                    outcome = err                # this command's error; the connection is fine
                self.last_reply = loop.time()
                reply, then = self.waiting.popleft()
                if reply.done():
                    continue
                if isinstance(outcome, Exception):
                    reply.set_exception(outcome)
                    reply.exception()            # retrieved: a caller that gave up waiting leaves no warning
                else:
                    reply.set_result(then(outcome) if then is not None else outcome)
        except asyncio.CancelledError:
            if not self.stalled:
                self._fail(ConnectionError("the Redis connection was closed"))
                raise
            self._fail(TimeoutError(f"no reply from Redis in {self.timeout:g}s"))
        except Exception as err:  # noqa: BLE001 - a lost connection, or a reply redis-py could not read
            self._fail(err)
        await self.conn.disconnect(nowait=True)   # mostly closed by redis-py already; this channel is done

    def _watch(self) -> None:
        """Every `timeout` while the channel lives: replies due and none for `timeout`: Redis is stalled."""
        if self.failed:
            return
        loop = asyncio.get_running_loop()
        waited = loop.time() - self.last_reply
        if self.waiting and waited >= self.timeout:
            self.stalled = True
            self.reader.cancel()
            return
        loop.call_later(self.timeout - waited if self.waiting else self.timeout, self._watch)

    def _fail(self, err: BaseException) -> None:
        self.failed = True
        if self.reader is not asyncio.current_task():
            self.reader.cancel()             # idle or mid-read on a connection that is gone
        while self.waiting:
            reply, _ = self.waiting.popleft()
            if not reply.done():
                reply.set_exception(err if isinstance(err, Exception) else ConnectionError(str(err)))
                reply.exception()

    async def close(self) -> None:
        self.reader.cancel()
        await self.conn.disconnect()
