"""One pipelined Redis connection for the reuse store's per-turn calls (put, take).

Commands go out on one connection in call order, and Redis answers them in that order (RESP), so:
- a put is on the wire when `send` returns. The store's put returns then, before the client is answered,
  and every later take is behind it: this replica's on the same connection, another replica's because
  the client only sends its next turn once it has the answer. The reply, which only says whether the
  entry was kept, is awaited off the answer's path (one Redis round trip less per turn).
- concurrent turns share the socket: no pool checkout per call, and Redis reads several commands a read.

The connection (its handshake: AUTH, SELECT, TLS, unix sockets) and the RESP parser are redis-py's; this
adds only the matching of replies to callers, in order.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

TIMEOUT = getattr(asyncio, "timeout", None)


class RedisPipe:
    def __init__(self, client: aioredis.Redis, timeout: float):
        self.pool = client.connection_pool
        self.timeout = timeout      # the longest wait for the next reply: then every call in flight fails
        self.conn: Any = None
        self.waiting: deque[asyncio.Future] = deque()   # one per command sent, oldest first
        self.reader: asyncio.Task | None = None
        self.connecting = asyncio.Lock()

    async def send(self, *args: Any) -> asyncio.Future:
        """Send one command now (connecting first if needed); the future is its reply, or raises the
        error reply, a lost connection or a timeout."""
        if self.conn is None:
            self.conn = self.pool.make_connection()
        conn = self.conn
        if not conn.is_connected:
            async with self.connecting:
                if not conn.is_connected:
                    await conn.connect()
        reply = asyncio.get_running_loop().create_future()
        self.waiting.append(reply)      # before the write: a write that waits for the socket keeps its turn
        try:
            await conn.send_packed_command(conn.pack_command(*args), check_health=False)
        except BaseException as err:
            self._fail_all(err)         # redis-py closed the connection: what was in flight on it is lost
            raise
        if self.reader is None:
            self.reader = asyncio.create_task(self._read(conn))
        return reply

    async def _read(self, conn: Any) -> None:
        try:
            while self.waiting:
                try:
                    reply = await self._next_reply(conn)
                except ResponseError as err:    # this command's error; the connection is fine
                    self._pop(err)
                    continue
                self._pop(reply)
        # redis-py has closed the connection on any of these; the next send opens a new one
        except (asyncio.TimeoutError, TimeoutError):
            self._fail_all(TimeoutError(f"no reply from Redis in {self.timeout:g}s"))
        except asyncio.CancelledError:
            self._fail_all(ConnectionError("the Redis connection was closed"))
            raise
        except Exception as err:  # noqa: BLE001 - a lost connection, or a reply redis-py could not read
            self._fail_all(err)
        finally:
            self.reader = None

    async def _next_reply(self, conn: Any) -> Any:
        # math.inf: no read timeout of redis-py's own (its timed read answers None, as a nil reply would)
        if TIMEOUT is None:      # Python 3.10
            return await asyncio.wait_for(conn.read_response(timeout=math.inf), self.timeout)
        async with TIMEOUT(self.timeout):
            return await conn.read_response(timeout=math.inf)

    def _pop(self, outcome: Any) -> None:
        reply = self.waiting.popleft()
        if reply.done():
            return
        if isinstance(outcome, BaseException):
            reply.set_exception(outcome)
            reply.exception()    # retrieved: a caller that gave up waiting leaves no warning
        else:
            reply.set_result(outcome)

    def _fail_all(self, err: BaseException) -> None:
        while self.waiting:
            reply = self.waiting.popleft()
            if not reply.done():
                reply.set_exception(err if isinstance(err, Exception) else ConnectionError(str(err)))
                reply.exception()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        if self.conn is not None:
            await self.conn.disconnect()
