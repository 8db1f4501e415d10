"""One contract for the router's calls to a backend (BackendClient): a JSON POST answered whole (`post`), or
streamed (`stream`, as `async with`). Http1Client (http1.py) is the lean one the router runs on; AiohttpClient
is the same contract on aiohttp, for an image without httptools. Tracing is a hook on whichever is in use
(Traced with a CallHook: telemetry/otel.py's Tracer), never a client stack of its own; the health probes,
/metrics reads and held-KV control calls stay on the aiohttp session."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp

from pdserve.router.legs.http1 import AnswerTooLarge


class Answer(Protocol):
    """A streamed answer as the D leg reads it (aiohttp's ClientResponse, http1.StreamAnswer)."""
    status: int
    content_type: str
    content: Any        # `.iter_any()`: the body as it arrives


class BackendClient(Protocol):
    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
                   pool_timeout: float | None = None) -> tuple[int, str, bytes]:
        """(status, content type, body); raises what no answer at all raises (upstream.Upstream.failure)."""

    def stream(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
               pool_timeout: float | None = None) -> contextlib.AbstractAsyncContextManager[Answer]: ...

    async def close(self) -> None: ...


class CallHook(Protocol):
    """Told of each call: its start (may add headers, as a traceparent), its answer's head, its failure."""

    def call_start(self, base_url: str, path: str, headers: dict[str, str]) -> Any: ...

    def call_end(self, handle: Any, status: int) -> None: ...

    def call_failed(self, handle: Any, err: BaseException) -> None: ...


async def read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """An aiohttp answer's whole body, refused (AnswerTooLarge) past `limit` bytes: at once by its
    Content-Length, else as soon as it grows past it (an endless body costs `limit`, not the router)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise AnswerTooLarge(f"an answer of {resp.content_length} bytes, over {limit}")
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"an answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class AiohttpClient:
    """The contract on an aiohttp session (its connector bounds the connections)."""

    def __init__(self, session: aiohttp.ClientSession, max_answer_bytes: int):
        self.session = session
        self.max_answer_bytes = max_answer_bytes
        self.timeouts: dict[tuple[float, float | None, bool], aiohttp.ClientTimeout] = {}

    def _call(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
              pool_timeout: float | None, streamed: bool = False) -> Any:
        limits = self.timeouts.get((timeout, pool_timeout, streamed))
        if limits is None:
            # `connect` bounds the wait for a pooled connection plus the TCP connect; a whole answer must come
            # within `timeout`, a stream's head and then each read (a stream that keeps sending runs on).
            limits = self.timeouts[(timeout, pool_timeout, streamed)] = \
                aiohttp.ClientTimeout(total=None, sock_read=timeout, connect=pool_timeout) if streamed else \
                aiohttp.ClientTimeout(total=timeout, connect=pool_timeout)
        return self.session.post(base_url + path, data=body, timeout=limits,
                                 headers={**headers, "Content-Type": "application/json"})

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
                   pool_timeout: float | None = None) -> tuple[int, str, bytes]:
        async with self._call(base_url, path, body, headers, timeout, pool_timeout) as resp:
            return resp.status, resp.content_type, await read_bounded(resp, self.max_answer_bytes)

    def stream(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
               pool_timeout: float | None = None) -> Any:
        return self._call(base_url, path, body, headers, timeout, pool_timeout, streamed=True)

    async def close(self) -> None:
        """The session is closed by its owner (front/compose.py: the probes use it too)."""


class Traced:
    """A client with a hook on each of its calls (tracing); the contract unchanged."""

    def __init__(self, client: BackendClient, hook: CallHook):
        self.client = client
        self.hook = hook

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
                   pool_timeout: float | None = None) -> tuple[int, str, bytes]:
        handle = self.hook.call_start(base_url, path, headers)
        try:
            answer = await self.client.post(base_url, path, body, headers, timeout, pool_timeout)
        except BaseException as err:
            self.hook.call_failed(handle, err)
            raise
        self.hook.call_end(handle, answer[0])
        return answer

    @contextlib.asynccontextmanager
    async def stream(self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout: float,
                     pool_timeout: float | None = None) -> AsyncIterator[Answer]:
        handle = self.hook.call_start(base_url, path, headers)
        answered = False
        try:
            async with self.client.stream(base_url, path, body, headers, timeout, pool_timeout) as answer:
                answered = True
                self.hook.call_end(handle, answer.status)     # the head came: the span ends at first byte
                yield answer
        except BaseException as err:
            if not answered:
                self.hook.call_failed(handle, err)
            raise

    async def close(self) -> None:
        await self.client.close()
