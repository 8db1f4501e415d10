"""A lean HTTP/1.1 client for the router's whole-JSON calls to backends (the P leg, a JSON D leg, /tokenize).

aiohttp's client was ~55% of the router's Python time at 64 clients (docs/results.md, "Side by side with
vllm-router"): a request object, a response object, timers, traces and payload classes per call. A JSON POST
to a vLLM server needs far less: keep-alive connections per backend, one write, httptools' C parser (the
one uvicorn uses) for the answer. The D leg's streams go here too (`stream`: the body handed on as it
arrives, all that came since the last read as one piece; aiohttp's client cost a streamed request more than
the rest of the router's work, docs/results.md, issue 31); the health and metrics probes stay on aiohttp.

Idle connections are closed after `keepalive` seconds, below vLLM's own keep-alive timeout (uvicorn's 5 s),
so a request is rarely written to a connection the server is closing. When it is (a backend or proxy that
closes right after answering), the answer to it is an EOF before any byte: the backend never read the
request, and it is sent once more on a new connection, as browsers do (Chromium resends any request, POST
included, when a reused keep-alive connection closes before the first byte of the answer). Nothing else is
ever retried here.

What comes back is read as RFC 9110/9112 say: interim 1xx answers (100 Continue, 103 Early Hints) are skipped
and the final answer read on; a body without Content-Length or chunked framing ends when the server closes
the connection. A connection that saw anything unexpected (bytes while no request was outstanding, a second
answer, 101 Switching Protocols, a parse error, an answer over `max_answer_bytes`) is closed, never pooled, so
one request's answer is not handed to another. An answer that names another request (its `X-Request-Id`, which
vLLM echoes with --enable-request-id-headers, is not the one sent) is skipped as an interim one is, and its
connection closed after the answer: a stray answer that comes after the next request was written, which
nothing else in HTTP/1.1 tells apart, is caught that way; an answer that does not echo the id is not kept
(its backend gets a connection per request, so a stray has no next request to reach). An answer larger than `max_answer_bytes` is refused
(AnswerTooLarge) as soon as it is, not read to its end.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

try:
    import httptools
except ImportError:      # an environment without it: the router stays on aiohttp's client
    httptools = None
AVAILABLE = httptools is not None


# The router's own shortages: never the backend's fault (upstream.py)
ROUTER_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class ConnectFailed(OSError):
    """No connection to the backend (refused, unreachable): nothing was sent."""


class PoolTimeout(asyncio.TimeoutError):
    """No pooled connection became free in time (the router's own shortage): nothing was sent."""


class Disconnected(ConnectionError):
    """The backend closed the connection (or sent what is not HTTP) before a whole answer. `stale`: it was a
    kept-alive connection and not a byte of the answer came back (the backend had closed it: see above)."""

    def __init__(self, message: str, stale: bool = False):
        super().__init__(message)
        self.stale = stale


class AnswerTooLarge(Disconnected):
    """The answer grew past max_answer_bytes: refused at that point, the connection closed."""


DEFAULT_MAX_ANSWER_BYTES = 32 * 1024 * 1024   # router.max_answer_mb's default
# A streamed answer's body not yet read past this: the connection stops reading until it is (backpressure:
# a slow client slows D's socket, not the router's memory), as aiohttp's reader does at 128 KiB.
STREAM_HIGH_WATER = 128 * 1024


class _Connection(asyncio.Protocol):
    def __init__(self, max_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future | None = None
        self.max_bytes = max_bytes
        self.closed = False
        self.idle_since = 0.0
        self.heard_at = 0.0          # time.monotonic() of the last bytes from the backend
        self.answers = 0             # final answers read: more than 0 is a kept-alive connection reused
        self.request_id = b""        # the X-Request-Id sent, lowercase (b"": none)
        self.tainted = False         # an answer to another request came here: closed after this request
        self.streaming = False       # the answer is handed on as it arrives (`StreamAnswer`)
        self._reset()

    def _reset(self) -> None:
        self.content_type = ""
        self.body: list[bytes] = []
        self.size = 0
        self.heard = False           # a byte of this request's answer arrived
        self.headers_done = False
        self.framed = False          # Content-Length or chunked; else the body ends at the close
        self.interim = False         # the message parsed is a 1xx
        self.foreign = False         # the message parsed names another request (X-Request-Id)
        self.echoed = False          # ... or names this one
        self.length: int | None = None   # Content-Length
        # a streamed answer, once its head came: being read, its end, its failure, the reader waiting, paused
        self.flowing = False
        self.finished = False
        self.keep = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.answer is None or self.answer.done() and not self.flowing:
            self.close()             # bytes nobody asked for: never pooled (the next request would get them)
            return
        self.heard = True
        self.heard_at = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(Disconnected(f"not an HTTP answer: {err}"))
            self.close()
        if self.flowing and self.body:   # a streamed answer: the reader woken once a read, not once a chunk
            if self.size > STREAM_HIGH_WATER and not self.paused and not self.closed:
                self.paused = True
                self.transport.pause_reading()     # type: ignore[union-attr]
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.streaming and self.answer is not None and self.answer.done():
            if self.flowing:         # what came is still read; then the end, or the error
                if self.headers_done and not self.framed:
                    self.finished = True     # RFC 9112 6.3: a body with no length framing ends at the close
                else:
                    self.error = Disconnected("the backend closed the connection mid-answer")
                self.flowing = False
                self._wake()
            return
        if self.headers_done and not self.framed and not self.interim and not self.foreign:
            self._complete(False)    # RFC 9112 6.3: a body with no length framing ends at the close
            return
        self._fail(Disconnected("the backend closed the connection before a whole answer",
                                stale=self.answers > 0 and not self.heard))

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.answer is None or self.answer.done():
            self.close()             # a second answer after the one asked for: never pooled
            if self.streaming:
                return               # the body read so far is still the reader's
        self.content_type, self.body, self.size, self.headers_done, self.framed = "", [], 0, False, False
        self.foreign, self.length, self.echoed = False, None, False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
        elif name == b"content-length" or name == b"transfer-encoding":
            self.framed = True       # llhttp reads both (and refuses what is not chunked-last)
            if name == b"content-length" and value.strip().isdigit():
                self.length = int(value)
        elif name == b"x-request-id" and self.request_id:
            if value.strip().lower() == self.request_id:
                self.echoed = True
            else:
                self.foreign = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.interim = 100 <= status < 200
        if status == 101:            # never asked for: whatever follows is not HTTP/1.1
            self._fail(Disconnected("the backend switched protocols (101) unasked"))
            self.close()
        self.headers_done = True
        self.framed = self.framed or status in (204, 304) or self.interim
        if self.streaming and not self.interim and not self.foreign and self.answer is not None \
                and not self.answer.done():
            self.flowing = True
            self.answer.set_result((status, self.content_type or "application/octet-stream", self.length))

    def on_body(self, body: bytes) -> None:
        if self.streaming:           # handed on after the read (data_received); another request's, never
            if self.flowing and not self.foreign:
                self.body.append(body)
                self.size += len(body)
            return
        self.size += len(body)
        if self.size > self.max_bytes:
            if not self.closed:
                self._fail(AnswerTooLarge(f"an answer over {self.max_bytes} bytes"))
                self.close()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.interim:             # RFC 9110 15.2: an interim answer; the final one follows
            self.interim = self.headers_done = False
            return
        if self.foreign:             # another request's answer: ours follows; this connection is not kept
            self.tainted = True
            self.foreign = self.headers_done = False
            return
        if self.streaming:
            if self.flowing:
                self.flowing, self.finished = False, True
                self.keep = self.parser.should_keep_alive() and self.told_apart()
                self._wake()
            return
        self._complete(self.parser.should_keep_alive())

    def told_apart(self) -> bool:
        """Could a stray answer on this connection be told from the next request's? Only by the request id
        the answer echoes: a backend that echoes none gets a new connection per request (a copy of an answer
        arriving after the next request was written would otherwise be taken for its answer)."""
        return self.echoed or not self.request_id

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def time_out(self) -> None:
        """The whole answer did not come within the request's timeout."""
        self._fail(asyncio.TimeoutError("no whole answer in time"))
        self.close()

    def _complete(self, keep: bool) -> None:
        if self.answer is not None and not self.answer.done():
            self.answers += 1
            self.answer.set_result((self.parser.get_status_code(), self.content_type, b"".join(self.body),
                                    keep and not self.closed and not self.tainted and self.told_apart()))
            self.body = []

    def _fail(self, err: Exception) -> None:
        if self.streaming and self.answer is not None and self.answer.done():
            if self.flowing:         # the head was handed on: the reader gets what came, then the error
                self.flowing, self.error = False, err
                self._wake()
            return
        self.body = []               # nothing of a failed answer is kept (the error lives on; its body need not)
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(err)

    def send(self, data: bytes, request_id: str = "", streaming: bool = False) -> asyncio.Future:
        self.answer = asyncio.get_running_loop().create_future()
        self.streaming = streaming
        self._reset()
        self.request_id = request_id.lower().encode("latin-1")
        self.parser = httptools.HttpResponseParser(self)
        try:
            if not self.gone():
                self.transport.write(data)      # type: ignore[union-attr]
                return self.answer
        except RuntimeError:                    # uvloop: its handle closed, connection_lost not run yet
            pass
        # Nothing was sent: stale when kept alive, so the caller sends it once more on a new connection.
        self.close()
        self._fail(Disconnected("the backend closed the connection before the request was sent",
                                stale=self.answers > 0))
        return self.answer

    def gone(self) -> bool:
        """Closed, or closing before its connection_lost ran (uvloop then raises on a write: a decode server's
        SIGKILL made the router answer a 500 so)."""
        return self.closed or self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class StreamAnswer:
    """A streamed answer (Http1Client.stream): what decode.py reads of aiohttp's ClientResponse, no more.
    Each read hands on all the body that came since the last one, as one piece."""

    def __init__(self, conn: _Connection, status: int, content_type: str, content_length: int | None):
        self.status, self.content_type, self.content_length = status, content_type, content_length
        self.content = self          # `answer.content.iter_any()`, as aiohttp's
        self._conn = conn

    def iter_any(self) -> StreamAnswer:
        return self

    def __aiter__(self) -> StreamAnswer:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while not conn.body:
            if conn.error is not None:
                raise conn.error
            if not conn.flowing:
                if conn.finished:
                    raise StopAsyncIteration
                raise Disconnected("the connection closed mid-answer")
            conn.waiter = asyncio.get_running_loop().create_future()
            try:
                await conn.waiter
            finally:
                conn.waiter = None
        body = conn.body
        conn.body, conn.size = [], 0
        if conn.paused and not conn.closed:
            conn.paused = False
            conn.transport.resume_reading()     # type: ignore[union-attr]
        return body[0] if len(body) == 1 else b"".join(body)


def _request(pool: _HostPool, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if head.count("\n") != len(headers) or head.count("\r") != len(headers):
        raise ValueError("a header name or value with a line break")   # the router's own: never a client's
    return (f"POST {path} HTTP/1.1\r\nHost: {pool.host}:{pool.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{head}\r\n").encode("latin-1") + body


class _HostPool:
    def __init__(self, host: str, port: int, limit: int):
        self.host, self.port, self.limit = host, port, limit
        self.idle: collections.deque[_Connection] = collections.deque()
        self.open = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()


class Http1Client:
    def __init__(self, limit_per_host: int, keepalive: float = 3.0, clock=time.monotonic,
                 max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES):
        self.limit = max(1, limit_per_host)
        self.keepalive = keepalive
        self.clock = clock
        self.max_answer_bytes = max_answer_bytes
        self.pools: dict[str, _HostPool] = {}
        # Streams on connections of their own (one is held for a whole answer), under their own bounds.
        self.stream_pools: dict[str, _HostPool] = {}
        self.stream_limit = self.limit
        self.stream_slots: asyncio.Semaphore | None = None
        self.closed = False

    def budget_streams(self, limit: int | None, limit_per_host: int | None) -> None:
        """Streams' bounds: at most `limit_per_host` connections to one backend and `limit` in use in all
        (0 or None: no bound), apart from whole-JSON calls'. decode.py gives them the bounds aiohttp's pool had
        when the streams were relayed through it, so that moving them here took no capacity away."""
        self.stream_limit = max(1, limit_per_host) if limit_per_host else 1 << 30
        self.stream_slots = asyncio.Semaphore(limit) if limit else None
        for pool in self.stream_pools.values():
            pool.limit = self.stream_limit

    def _pool(self, base_url: str, streams: bool = False) -> _HostPool:
        pools = self.stream_pools if streams else self.pools
        pool = pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"{base_url}: only http:// URLs")
            pool = pools[base_url] = _HostPool(parts.hostname, parts.port or 80,
                                               self.stream_limit if streams else self.limit)
        return pool

    async def _acquire(self, pool: _HostPool, deadline: float, fresh: bool = False) -> _Connection:
        """A connection: the warmest idle one, else a new one (`fresh`: a new one, an idle one closed to make
        room at the limit), else the next one released, until the deadline."""
        while True:
            now = self.clock()
            while pool.idle and not fresh:
                conn = pool.idle.pop()                     # the most recently used: the warmest
                if not conn.gone() and now - conn.idle_since < self.keepalive:
                    return conn
                conn.close()
                pool.open -= 1
            if fresh and pool.idle and pool.open >= pool.limit:
                pool.idle.popleft().close()                # the coldest
                pool.open -= 1
            if pool.open < pool.limit:
                pool.open += 1
                try:
                    _, conn = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
                        lambda: _Connection(self.max_answer_bytes), pool.host, pool.port),
                        max(0.001, deadline - self.clock()))
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
        """POST `body` (JSON); (status, content type, body). Raises ConnectFailed, PoolTimeout, Disconnected
        (AnswerTooLarge among them), asyncio.TimeoutError (no whole answer within `timeout`), or the router's
        own OSError (EMFILE...)."""
        pool = self._pool(base_url)
        start = self.clock()
        deadline = start + (timeout if pool_timeout is None else min(timeout, pool_timeout))
        request = _request(pool, path, body, headers)
        for retry in (False, True):
            conn = await self._acquire(pool, deadline, fresh=retry)
            reuse = False
            try:
                async with asyncio.timeout(max(0.0, start + timeout - self.clock())):
                    status, content_type, data, reuse = await conn.send(request, headers.get("X-Request-Id", ""))
                return status, content_type, data
            except Disconnected as err:
                if retry or not err.stale:
                    raise
                # The backend had closed this kept-alive connection: it never read the request. Once more,
                # on a new connection (module docstring).
            finally:
                # A cancelled or timed-out request leaves an answer on its way: that connection is not reused.
                self._release(pool, conn, reuse)
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def stream(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
                     pool_timeout: float | None = None) -> AsyncIterator[StreamAnswer]:
        """POST `body` (JSON) and hand on the answer as it arrives, as `async with`: its status and content
        type, then its body (`answer.content.iter_any()`, as aiohttp's). Raises what `post` raises;
        asyncio.TimeoutError when the head did not come within `timeout`, or then the backend sent nothing for
        `timeout` (a stream that keeps sending runs to its end: its length is bounded by its output cap, not
        by a clock; the wait while the router's reader lags is not the backend's silence). The connection is
        kept only when the body was read to its end."""
        pool = self._pool(base_url, streams=True)
        start = self.clock()
        deadline = start + (timeout if pool_timeout is None else min(timeout, pool_timeout))
        request = _request(pool, path, body, headers)
        slots = self.stream_slots
        if slots is not None:
            try:
                await (asyncio.wait_for(slots.acquire(), max(0.0, deadline - self.clock())) if slots.locked()
                       else slots.acquire())
            except asyncio.TimeoutError:
                raise PoolTimeout(f"no connection free in time for a stream to {pool.host}:{pool.port}") from None
        try:
            for retry in (False, True):
                conn = await self._acquire(pool, deadline, fresh=retry)
                loop = asyncio.get_running_loop()

                def due(conn: _Connection = conn) -> None:
                    nonlocal timer
                    now = time.monotonic()
                    quiet = (now if conn.paused else conn.heard_at) + timeout - now if conn.flowing else 0.0
                    if quiet > 0:
                        timer = loop.call_later(quiet, due)
                    else:
                        conn.time_out()

                timer = loop.call_later(max(0.0, start + timeout - self.clock()), due)
                answer: StreamAnswer | None = None
                try:
                    try:
                        status, content_type, length = await conn.send(request, headers.get("X-Request-Id", ""),
                                                                       streaming=True)
                    except Disconnected as err:
                        if retry or not err.stale:
                            raise
                        continue     # the backend had closed this kept-alive connection: once more, anew
                    answer = StreamAnswer(conn, status, content_type, length)
                    yield answer
                    return
                finally:
                    timer.cancel()
                    self._release(pool, conn, answer is not None and conn.finished and conn.keep
                                  and not conn.tainted)
        finally:
            if slots is not None:
                slots.release()

    async def close(self) -> None:
        self.closed = True
        for pool in (*self.pools.values(), *self.stream_pools.values()):
            while pool.idle:
                pool.idle.pop().close()
