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
adds only the matching of replies to callers, in order, and the bounds (issue 35): every caller waits at most
`timeout` whatever the others do. Callers that find no connection share one connect attempt (not one each,
in turn, behind a lock); a failed connection is aborted, not closed, so a write blocked on a full socket (a
Redis that stopped reading) fails with it instead of waiting for Redis to read again.
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
    """Every call ends within `timeout`: a connect by its own bound, a reply by its channel's watchdog, and a
    call that waited for a connect by its own deadline."""

    def __init__(self, client: aioredis.Redis, timeout: float):
        self.pool = client.connection_pool
        self.timeout = timeout      # the longest wait for the next reply: then every call in flight fails
        self.channel: _Channel | None = None
        self.opening: asyncio.Task | None = None     # the one connect attempt in progress, shared

    async def send(self, *args: str | bytes | int, then: Callable[[Any], Any] | None = None,
                   otherwise: Callable[[ResponseError], Any] | None = None) -> asyncio.Future:
        """Send one command now (connecting first if needed); the future is its reply (`then(reply)`, with
        `then`), or raises the error reply (`otherwise(error)` decides, with `otherwise`), a lost connection or
        a timeout."""
        channel = self.channel
        if channel is None or not channel.usable:
            deadline = asyncio.get_running_loop().time() + self.timeout
            channel = await self._open()
            return await channel.send(hiredis.pack_command(args), then, otherwise, deadline)
        return await channel.send(hiredis.pack_command(args), then, otherwise)

    async def _open(self) -> _Channel:
        """The connect attempt in progress, or a new one: every caller that finds no usable connection waits
        for the same attempt, which ends within `timeout` (before: each took a lock in turn and waited its
        own connect, so the 64th caller on a stalled Redis waited 64 timeouts)."""
        if self.opening is None:
            self.opening = asyncio.create_task(self._connect())
            self.opening.add_done_callback(self._opened)
        # shielded: a caller that gives up (its request cancelled) leaves the attempt to the others
        return await asyncio.shield(self.opening)

    def _opened(self, attempt: asyncio.Task) -> None:
        self.opening = None
        if not attempt.cancelled():
            attempt.exception()      # retrieved: every waiter may have given up

    async def _connect(self) -> _Channel:
        # A new connection each time, never the failed one reconnected: a reply still due on the old socket can
        # then never be matched to a call sent on the new one.
        # No socket timeout: redis-py then writes at once instead of through a task per call; the channel's
        # watchdog bounds the replies, and the connect is bounded here.
        conn = self.pool.connection_class(**{**self.pool.connection_kwargs, "socket_timeout": None})
        try:
            # bounded: a Redis that accepts and then stalls (SIGSTOP: the kernel still accepts) would hold the
            # handshake's reads forever
            async with asyncio.timeout(self.timeout):
                await conn.connect()
        except BaseException:
            _abort(_transport(conn))
            raise
        self.channel = _Channel(conn, self.timeout)
        return self.channel

    async def close(self) -> None:
        if self.opening is not None:
            self.opening.cancel()
        if self.channel is not None:
            await self.channel.close()


def _transport(conn: Any) -> asyncio.BaseTransport | None:
    """The connection's transport (redis-py keeps its stream writer as `_writer`, and drops it on disconnect)."""
    writer = getattr(conn, "_writer", None)
    return writer.transport if writer is not None else None


def _abort(transport: asyncio.BaseTransport | None) -> None:
    """Drop the connection at once, what is still buffered for it included. redis-py's disconnect closes the
    transport, which waits for the buffer to drain first: on a Redis that stopped reading, forever, and a
    write blocked on the full socket with it."""
    if transport is not None:
        transport.abort()


class _Channel:
    """One connection, the calls in flight on it (oldest first), the task that reads their replies in
    order, and its watchdog. Once it fails, every call in flight fails and it is never used again."""

    def __init__(self, conn: Any, timeout: float):
        self.conn = conn
        self.transport = _transport(conn)    # kept: redis-py forgets it when it disconnects on an error
        self.timeout = timeout
        self.waiting: deque[tuple[asyncio.Future, Callable[[Any], Any] | None,
                                  Callable[[ResponseError], Any] | None]] = deque()
        self.failed = False
        self.wake: asyncio.Future | None = None     # the reader, idle, waits on it for the next command
        loop = asyncio.get_running_loop()
        self.last_reply = loop.time()
        self.stalled = False
        self.reader = asyncio.create_task(self._read())
        loop.call_later(timeout, self._watch)

    @property
    def usable(self) -> bool:
        """Not failed, and Redis has not closed the connection. An idle channel reads nothing, so a Redis that
        restarted (or dropped the client) between turns is seen here, from the end of stream its socket
        already got, and the channel is failed then: before, the next call went out on the dead socket,
        failed, and took the store down for its retry window."""
        if self.failed:
            return False
        reader = getattr(self.conn, "_reader", None)     # None: redis-py closed it on an error not read yet
        # A reset (a Redis killed with a command unread: its kernel sends RST, not FIN) leaves the reader
        # holding the error, not at its end, and the transport closed.
        if reader is None or reader.at_eof() or reader.exception() is not None \
                or self.transport is None or self.transport.is_closing():
            self._fail(ConnectionError("Redis closed the connection"))
            return False
        return True

    async def send(self, packed: Any, then: Callable[[Any], Any] | None,
                   otherwise: Callable[[ResponseError], Any] | None, deadline: float | None = None) -> asyncio.Future:
        """The command's reply future. `deadline`: a caller that already waited (for a connect) gets a timer of
        its own, so its whole wait stays within `timeout`; the reply, should it come later, is dropped."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self.waiting:
            self.last_reply = loop.time()    # the wait for this reply starts now, not at the last one
        self.waiting.append((reply, then, otherwise))   # before the write: a write that waits keeps its turn
        if deadline is not None:
            loop.call_at(deadline, _expire, reply, self.timeout)
        try:
            # Not bounded here: a write that waits for the socket waits for Redis to read, and the watchdog
            # fails the channel (aborting the connection, which ends the write) once no reply came for `timeout`.
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
                reply, then, otherwise = self.waiting.popleft()
                if reply.done():
                    continue
                try:
                    if isinstance(outcome, ResponseError):
                        if otherwise is None:
                            raise outcome
                        reply.set_result(otherwise(outcome))    # the caller's judgement of its error reply
                    else:
                        reply.set_result(then(outcome) if then is not None else outcome)
                except Exception as err:  # noqa: BLE001 - the error reply, or the caller's: this command's alone
                    reply.set_exception(err)
                    reply.exception()            # retrieved: a caller that gave up waiting leaves no warning
        except asyncio.CancelledError:
            if not self.stalled:
                self._fail(ConnectionError("the Redis connection was closed"))
                raise
            self._fail(TimeoutError(f"no reply from Redis in {self.timeout:g}s"))
        except Exception as err:  # noqa: BLE001 - a lost connection, or a reply redis-py could not read
            self._fail(err)
        _abort(self.transport)
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
        _abort(self.transport)               # wakes a write blocked on the socket: it is never finished now
        if self.reader is not asyncio.current_task():
            self.reader.cancel()             # idle or mid-read on a connection that is gone
        while self.waiting:
            reply, _, _ = self.waiting.popleft()
            if not reply.done():
                reply.set_exception(err if isinstance(err, Exception) else ConnectionError(str(err)))
                reply.exception()

    async def close(self) -> None:
        self.failed = True
        _abort(self.transport)
        self.reader.cancel()
        await self.conn.disconnect(nowait=True)


def _expire(reply: asyncio.Future, timeout: float) -> None:
    if not reply.done():
        reply.set_exception(TimeoutError(f"no reply from Redis in {timeout:g}s"))
        reply.exception()
