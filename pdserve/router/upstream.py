"""Requests to backends: JSON in, JSON out, with load accounting, circuit-breaker outcomes and metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from pdserve.router.backends import Backend, Pool
from pdserve.router.errors import UpstreamError, error_body
from pdserve.router.metrics import RouterMetrics


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, metrics: RouterMetrics, request_timeout: float,
                 api_key: str | None = None):
        self.session = session
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.timeout = aiohttp.ClientTimeout(total=request_timeout)
        # Backends started with the cluster's API key (VLLM_API_KEY) get it from the router, never the client's.
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def count(self, backend: Backend, route: str, ok: bool) -> None:
        self.metrics.backend_requests.labels(backend.name, route, "ok" if ok else "error").inc()

    async def post_json(self, pool: Pool, backend: Backend, route: str, body: dict[str, Any],
                        headers: dict[str, str], blame: bool = True) -> tuple[int, dict[str, Any]]:
        """POST and parse; a 5xx, a timeout or no connection count against the backend's breaker unless
        `blame` is False. Raises UpstreamError when there is no HTTP answer at all."""
        ok: bool | None = None    # stays None when the client went away (cancelled): no verdict on the backend
        trial = pool.acquire(backend)
        try:
            async with self.session.post(backend.url + route, json=body, headers={**headers, **self.auth},
                                         timeout=self.timeout) as resp:
                status = resp.status
                try:
                    data = await resp.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError):
                    status, data = 502, error_body(f"backend {backend.name} sent a non-JSON body "
                                                   f"(HTTP {resp.status})", "server_error", 502)
                if not isinstance(data, dict):
                    status, data = 502, error_body(f"backend {backend.name} sent an unexpected body",
                                                   "server_error", 502)
                ok = status < 500
                self.count(backend, route, status == 200)
                return status, data
        except asyncio.TimeoutError:
            ok = False
            self.count(backend, route, False)
            raise UpstreamError(504, error_body(f"backend {backend.name} did not answer within "
                                                f"{self.request_timeout:g}s", "timeout", 504), backend.name)
        except aiohttp.ClientError as err:
            ok = False
            self.count(backend, route, False)
            raise UpstreamError.unreachable(backend.name, type(err).__name__,
                                            isinstance(err, aiohttp.ClientConnectorError)) from None
        finally:
            pool.release(backend, ok if blame else None, trial)

    async def get_text(self, backend: Backend, path: str) -> str | None:
        try:
            async with self.session.get(backend.url + path, headers=self.auth, timeout=self.timeout) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
