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

TIMEOUT = getattr(asyncio, "timeout", None)


class RedisPipe:
    """Every call ends within `timeout`: a connect by its own bound, a reply by the watchdog."""

    def __init__(self, client: aioredis.Redis, timeout: float):
        self.pool = client.connection_pool
        self.timeout = timeout      # the longest wait for the next reply: then every call in flight fails
        self.conn: Any = None
        # one per command sent, oldest first: its reply future and what turns the reply into its result
        self.waiting: deque[tuple[asyncio.Future, Callable[[Any], Any] | None]] = deque()
        self.reader: asyncio.Task | None = None
        self.wake: asyncio.Future | None = None     # the reader, idle, waits on it for the next command
        self.last_reply = 0.0
        self.stalled = False
        self.connecting = asyncio.Lock()

    async def send(self, *args: str | bytes | int, then: Callable[[Any], Any] | None = None) -> asyncio.Future:
        """Send one command now (connecting first if needed); the future is its reply (`then(reply)`, with
        `then`), or raises the error reply, a lost connection or a timeout."""
        conn = self.conn
        if conn is None or not conn.is_connected:
            conn = await self._connect()
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if not self.waiting:
            self.last_reply = loop.time()    # the wait for this reply starts now, not at the last one
        self.waiting.append((reply, then))   # before the write: a write that waits for the socket keeps its turn
        try:
            # socket_timeout None (_connect): redis-py writes at once instead of through a task per call
            await conn.send_packed_command(hiredis.pack_command(args), check_health=False)
        except BaseException as err:
            self._fail_all(err)              # redis-py closed the connection: what was in flight on it is lost
            raise
        if self.reader is None:
            self.reader = asyncio.create_task(self._read(conn))
            loop.call_later(self.timeout, self._watch, self.reader)
        elif self.wake is not None and not self.wake.done():
            self.wake.set_result(None)
        return reply

    async def _connect(self) -> Any:
        async with self.connecting:
            if self.conn is None:
                # No read timeout of redis-py's own: the watchdog bounds the wait for replies, and the
                # store's guard the connect and handshake.
                self.conn = self.pool.connection_class(**{**self.pool.connection_kwargs, "socket_timeout": None})
            if not self.conn.is_connected:
                # bounded here: with no socket timeout, a Redis that accepts and then stalls (SIGSTOP: the
                # kernel still accepts) would hold the handshake's reads forever
                if TIMEOUT is None:      # Python 3.10
                    await asyncio.wait_for(self.conn.connect(), self.timeout)
                else:
                    async with TIMEOUT(self.timeout):
                        await self.conn.connect()
            return self.conn

    async def _read(self, conn: Any) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.waiting:
                    self.wake = loop.create_future()
                    await self.wake
                    self.wake = None
                try:
                    outcome = await conn.read_response()   # untimed: the connection has no socket timeout
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
        # redis-py has closed the connection on any of these; the next send opens a new one
        except asyncio.CancelledError:
            if not self.stalled:
                self._fail_all(ConnectionError("the Redis connection was closed"))
                raise
            self._fail_all(TimeoutError(f"no reply from Redis in {self.timeout:g}s"))
        except Exception as err:  # noqa: BLE001 - a lost connection, or a reply redis-py could not read
            self._fail_all(err)
        finally:
            self.reader = None
            self.stalled = False

    def _watch(self, reader: asyncio.Task) -> None:
        """Every `timeout` while the reader lives: replies due and none for `timeout`: Redis is stalled."""
        if self.reader is not reader:
            return
        waited = asyncio.get_running_loop().time() - self.last_reply
        if self.waiting and waited >= self.timeout:
            self.stalled = True
            reader.cancel()
            return
        asyncio.get_running_loop().call_later(self.timeout - waited if self.waiting else self.timeout, self._watch,
                                             reader)

    def _fail_all(self, err: BaseException) -> None:
        while self.waiting:
            reply, _ = self.waiting.popleft()
            if not reply.done():
                reply.set_exception(err if isinstance(err, Exception) else ConnectionError(str(err)))
                reply.exception()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.conn is not None:
            await self.conn.disconnect()
