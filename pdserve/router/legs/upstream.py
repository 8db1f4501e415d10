"""Requests to backends: JSON in, JSON out, with load accounting, circuit-breaker outcomes and metrics.

What counts against a backend's breaker: no connection, a timeout, or a 5xx that is not vLLM's answer to
invalid input, the last only once another server has served the same request (see Suspects). The
router's own shortages (out of file descriptors or memory, no pooled connection free within
upstream_pool_timeout) and the client's bad input never do.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from pdserve.router import fastjson
from pdserve.router.errors import UpstreamError, backend_at_fault, error_body
from pdserve.router.legs import bigjson
from pdserve.router.legs.client import AiohttpClient, BackendClient, read_bounded
from pdserve.router.legs.http1 import ROUTER_ERRNOS, AnswerTooLarge, ConnectFailed, PoolTimeout
from pdserve.router.route.backends import Backend, Pool, Suspects
from pdserve.router.telemetry.metrics import RouterMetrics

def router_resource_error(err: BaseException) -> bool:
    os_error = getattr(err, "os_error", err)
    return isinstance(os_error, OSError) and os_error.errno in ROUTER_ERRNOS


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics, request_timeout: float,
                 api_key: str | None = None, pool_timeout: float | None = None, pools: tuple[Pool, ...] = (),
                 client: BackendClient | None = None, max_answer_bytes: int = 32 * 1024 * 1024):
        self.session = session             # the aiohttp session: /metrics reads here (and probes, held control)
        self.max_answer_bytes = max_answer_bytes   # a whole answer, or a stream's line (relay.py)
        # Every P and D leg and /tokenize (client.py: the lean http1.py, or aiohttp without httptools)
        self.client: BackendClient = client if client is not None else AiohttpClient(session, max_answer_bytes)
        self.pool_timeout = pool_timeout
        self.pools = pools
        self.metrics = metrics
        self.request_timeout = request_timeout
        # `connect` bounds the wait for a pooled connection plus the TCP connect.
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, connect=pool_timeout)
        # Backends started with the cluster's API key (VLLM_API_KEY) get it from the router, never the client's.
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def count(self, backend: Backend, route: str, ok: bool) -> None:
        self.metrics.backend_requests.labels(backend.name, route, "ok" if ok else "error").inc()

    def waited_for_the_pool(self, backend: Backend, err: BaseException) -> bool:
        """Did the request time out waiting for a pooled connection (the router's shortage)? aiohttp's
        connect timeout covers that wait and the TCP connect alike; more requests outstanding than pooled
        connections allowed means ours was waiting. (A trace callback told exactly, but aiohttp then fires
        every trace signal of every request: 14k for 1000 requests.)"""
        if isinstance(err, PoolTimeout):
            return True
        if not isinstance(err, aiohttp.ConnectionTimeoutError):
            return False
        connector = self.session.connector
        per_host = getattr(connector, "limit_per_host", 0)
        total = getattr(connector, "limit", 0)
        return bool((per_host and backend.in_flight > per_host) or
                    (total and sum(b.in_flight for pool in self.pools for b in pool.backends) > total))

    def failure(self, backend: Backend, route: str, err: BaseException) -> tuple[bool | None, UpstreamError]:
        """A request that got no HTTP answer: (breaker verdict, the error for the client)."""
        if self.waited_for_the_pool(backend, err):
            self.metrics.router_busy.labels("pool_wait").inc()
            return None, UpstreamError(503, error_body(f"router busy: no connection to {backend.name} free in "
                                                       "time; retry", "server_error", 503), backend.name, True,
                                       routers_own=True)
        if router_resource_error(err):
            self.metrics.router_busy.labels("resources").inc()
            return None, UpstreamError(503, error_body(f"router out of resources ({type(err).__name__}: "
                                                       f"{getattr(err, 'os_error', err)}); retry", "server_error",
                                                       503), backend.name, True, routers_own=True)
        self.count(backend, route, False)
        if isinstance(err, AnswerTooLarge):
            return False, UpstreamError(502, error_body(
                f"{backend.role} server {backend.name} sent an answer over {self.max_answer_bytes // 2**20} MiB "
                "(router.max_answer_mb): refused", "server_error", 502), backend.name)
        if isinstance(err, asyncio.TimeoutError):
            return False, UpstreamError(504, error_body(f"backend {backend.name} did not answer within "
                                                        f"{self.request_timeout:g}s", "timeout", 504), backend.name)
        return False, UpstreamError.unreachable(backend.name, type(err).__name__,
                                                isinstance(err, (aiohttp.ClientConnectorError, ConnectFailed)))

    async def post_json(self, pool: Pool, backend: Backend, route: str, body: dict[str, Any],
                        headers: dict[str, str], blame: bool = True, suspects: Suspects | None = None,
                        valid: Callable[[dict[str, Any]], bool] | None = None) -> tuple[int, dict[str, Any]]:
        """POST and parse; the backend's own failures count against its breaker unless `blame` is False.
        With `suspects` (the request's), a 5xx answer is held there until another server serves the
        request or it fails everywhere (see Suspects), and a success settles the held ones. A 200 that
        `valid` refuses is the backend's failure (it answered, but not as configured). Raises
        UpstreamError when there is no HTTP answer at all."""
        ok: bool | None = None    # stays None when the client went away (cancelled): no verdict on the backend
        trial = pool.acquire(backend)
        try:
            status, data = await self._post(backend, route, body, headers)
            if not isinstance(data, dict):
                status, data = 502, error_body(f"backend {backend.name} sent an unexpected body",
                                               "server_error", 502)
            at_fault = backend_at_fault(status, data) or (status == 200 and valid is not None
                                                          and not valid(data))
            self.count(backend, route, status == 200 and not at_fault)
            if at_fault and status >= 500 and suspects is not None and blame:
                suspects.hold(pool, backend)          # ok stays None: no verdict yet
            else:
                ok = not at_fault
            if status == 200 and ok and suspects is not None:
                suspects.served()
            return status, data
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as err:
            ok, error = self.failure(backend, route, err)
            raise error from None
        finally:
            pool.release(backend, ok if blame else None, trial)

    async def _post(self, backend: Backend, route: str, body: dict[str, Any],
                    headers: dict[str, str]) -> tuple[int, Any]:
        status, _, raw = await self.client.post(backend.url, route, fastjson.dumps(body),
                                                {**headers, **self.auth}, self.request_timeout, self.pool_timeout)
        try:
            return status, await bigjson.loads(raw)   # a large answer's token ids parsed with the loop running
        except (json.JSONDecodeError, UnicodeDecodeError):
            return 502, error_body(f"backend {backend.name} sent a non-JSON body (HTTP {status})", "server_error", 502)

    def stream(self, backend: Backend, route: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """A streamed POST (the D leg's), as `async with`: the caller reads the events and accounts for the
        backend (acquire, count, failure), since a stream's outcome is known only at its end (decode.py)."""
        return self.client.stream(backend.url, route, fastjson.dumps(body), {**headers, **self.auth},
                                  self.request_timeout, self.pool_timeout)

    async def get_text(self, backend: Backend, path: str) -> str | None:
        try:
            async with self.session.get(backend.url + path, headers=self.auth, timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                return (await read_bounded(resp, self.max_answer_bytes)).decode(resp.charset or "utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, AnswerTooLarge):
            return None
