"""A lean HTTP/1.1 client for the router's whole-JSON calls to backends (the P leg, a JSON D leg, /tokenize).

aiohttp's client was ~55% of the router's Python time at 64 clients (docs/router.md, "Side by side with
vllm-router"): a request object, a response object, timers, traces and payload classes per call. A JSON POST
to a vLLM server needs far less: keep-alive connections per backend, one write, httptools' C parser (the
one uvicorn uses) for the answer. Streams and the health and metrics probes stay on aiohttp.

Idle connections are closed after `keepalive` seconds, below vLLM's own keep-alive timeout (uvicorn's 5 s),
so a request is never written to a connection the server is closing; a request is never retried here.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import time
from urllib.parse import urlsplit

try:
    import httptools
except ImportError:      # an image without it (the GPU nodes' wheel list): the router stays on aiohttp
    httptools = None
AVAILABLE = httptools is not None


# The router's own shortages: never the backend's fault (upstream.py)
ROUTER_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class ConnectFailed(OSError):
    """No connection to the backend (refused, unreachable): nothing was sent."""


class PoolTimeout(asyncio.TimeoutError):
    """No pooled connection became free in time (the router's own shortage): nothing was sent."""


class Disconnected(ConnectionError):
    """The backend closed the connection (or sent what is not HTTP) before a whole answer."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future | None = None
        self.content_type = ""
        self.body: list[bytes] = []
        self.closed = False
        self.idle_since = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(Disconnected(f"not an HTTP answer: {err}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Disconnected("the backend closed the connection before a whole answer"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.decode("latin-1").split(";", 1)[0].strip().lower()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep = self.parser.should_keep_alive()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result((self.parser.get_status_code(), self.content_type, b"".join(self.body), keep))

    def _fail(self, err: Exception) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(err)

    def send(self, data: bytes) -> asyncio.Future:
        self.answer = asyncio.get_running_loop().create_future()
        self.content_type, self.body = "", []
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(data)
        return self.answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _HostPool:
    def __init__(self, host: str, port: int, limit: int):
        self.host, self.port, self.limit = host, port, limit
        self.idle: collections.deque[_Connection] = collections.deque()
        self.open = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()


class Http1Client:
    def __init__(self, limit_per_host: int, keepalive: float = 3.0, clock=time.monotonic):
        self.limit = max(1, limit_per_host)
        self.keepalive = keepalive
        self.clock = clock
        self.pools: dict[str, _HostPool] = {}
        self.closed = False

    def _pool(self, base_url: str) -> _HostPool:
        pool = self.pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"{base_url}: only http:// URLs")
            pool = self.pools[base_url] = _HostPool(parts.hostname, parts.port or 80, self.limit)
        return pool

    async def _acquire(self, pool: _HostPool, deadline: float) -> _Connection:
        while True:
            now = self.clock()
            while pool.idle:
                conn = pool.idle.pop()                     # the most recently used: the warmest
                if not conn.closed and now - conn.idle_since < self.keepalive:
                    return conn
                conn.close()
                pool.open -= 1
            if pool.open < pool.limit:
                pool.open += 1
                try:
                    _, conn = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                        _Connection, pool.host, pool.port), max(0.001, deadline - self.clock()))
                except OSError as err:
                    pool.open -= 1
                    if err.errno in ROUTER_ERRNOS:
                        raise                              # EMFILE and the like: the router's own shortage
                    raise ConnectFailed(err.errno, f"connect to {pool.host}:{pool.port}: {err}") from err
                except BaseException:                      # a connect timeout (TimeoutError) or a cancel
                    pool.open -= 1
                    raise
                return conn
            waiter = asyncio.get_running_loop().create_future()
            pool.waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - self.clock()))
            except asyncio.TimeoutError:
                raise PoolTimeout(f"no connection to {pool.host}:{pool.port} free in time") from None
            finally:
                if waiter in pool.waiters:
                    pool.waiters.remove(waiter)

    def _release(self, pool: _HostPool, conn: _Connection, reuse: bool) -> None:
        if reuse and not conn.closed and not self.closed:
            conn.idle_since = self.clock()
            pool.idle.append(conn)
        else:
            conn.close()
            pool.open -= 1
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
                   pool_timeout: float | None = None) -> tuple[int, str, bytes]:
        """POST `body` (JSON); (status, content type, body). Raises ConnectFailed, PoolTimeout, Disconnected,
        asyncio.TimeoutError (no whole answer within `timeout`), or the router's own OSError (EMFILE...)."""
        pool = self._pool(base_url)
        start = self.clock()
        deadline = start + (timeout if pool_timeout is None else min(timeout, pool_timeout))
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if head.count("\n") != len(headers) or head.count("\r") != len(headers):
            raise ValueError("a header name or value with a line break")   # the router's own: never a client's
        request = (f"POST {path} HTTP/1.1\r\nHost: {pool.host}:{pool.port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n{head}\r\n").encode("latin-1") + body
        conn = await self._acquire(pool, deadline)
        reuse = False
        try:
            async with asyncio.timeout(max(0.0, start + timeout - self.clock())):
                status, content_type, data, reuse = await conn.send(request)
            return status, content_type, data
        finally:
            # A cancelled or timed-out request leaves an answer on its way: that connection is not reused.
            self._release(pool, conn, reuse)

    async def close(self) -> None:
        self.closed = True
        for pool in self.pools.values():
            while pool.idle:
                pool.idle.pop().close()
