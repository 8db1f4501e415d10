"""One client request through P then D: its plan (plan.py), the P leg (prefill.py) and the D leg (decode.py),
with what the turn takes and leaves in the reuse store and how it ends recorded in its book (book.py)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any

from aiohttp import web

from pdserve.router import identity
from pdserve.router.api import WireFormat
from pdserve.router.api.base import Collector, strip_router_only
from pdserve.router.config import RouterConfig
from pdserve.router.conversation import Conversation
from pdserve.router.errors import UpstreamError, error_body
from pdserve.router.kv.reuse import DECODE_FAILED, HIT, MISS, Decision
from pdserve.router.legs.book import TurnBook
from pdserve.router.legs.decode import DecodeLeg
from pdserve.router.legs.plan import Planner
from pdserve.router.legs.prefill import PrefillLeg, count_reuse
from pdserve.router.legs.turn import CLIENT_GONE, FAILED, TURN, UNTRACKED, Turn, json_answer
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend, Pool
from pdserve.router.route.policy import LOCAL_PARAMS, TOO_LONG, DecodeOnly, Degraded, PrefillThenDecode
from pdserve.router.wire import DECODE_ONLY, REUSE_HEADER
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.roles import PREFILL

log = logging.getLogger("pdserve.router")

# A client X-Request-Id is echoed back only if it is this tame; backends always get the router's own id
# (vLLM and NIXL key transfers by request id, so a client must not be able to choose or collide it).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Flow:
    def __init__(self, cfg: RouterConfig, upstream: Upstream, planner: Planner, prefill: PrefillLeg,
                 d_leg: DecodeLeg, book: TurnBook, metrics: RouterMetrics):
        self.cfg = cfg
        self.upstream = upstream
        self.planner = planner
        self.prefill = prefill
        self.decode: Pool = planner.decode
        self.d_leg = d_leg
        self.book = book
        self.store = book.store
        self.held = book.held
        self.metrics = metrics

    def _turn(self, request: web.Request, fmt: WireFormat, body: dict[str, Any]) -> Turn:
        explicit = identity.explicit_key(request, body, fmt.fingerprint(body))
        root = identity.root_session(request, body)
        strip_router_only(body)
        request_id = f"pdserve-{uuid.uuid4().hex}"
        client_id = request.headers.get("X-Request-Id", "")
        reply_id = client_id if CLIENT_REQUEST_ID.fullmatch(client_id) else request_id
        return Turn(request.path, fmt, body, request_id, reply_id,
                    Conversation(identity.reuse_scope(request), explicit, fmt.history(body), root))

    # -- entry -------------------------------------------------------------------------------------
    async def handle(self, request: web.Request, fmt: WireFormat, body: dict[str, Any]) -> web.StreamResponse:
        turn = self._turn(request, fmt, body)
        request[TURN] = turn
        try:
            refused = fmt.refuse(body)
            if refused is not None:
                message, param = refused
                resp: web.StreamResponse = json_answer(turn, fmt.error(400, message, param=param), 400)
            else:
                resp = await self._route(request, turn)
        except asyncio.CancelledError:
            self.book.end(turn, CLIENT_GONE)      # no-op when the turn was already answered
            raise
        except Exception:
            self.book.end(turn, FAILED)
            raise
        self.book.end(turn, FAILED if resp.status != 200 else UNTRACKED)   # error answers end here
        return resp

    async def forward(self, fmt: WireFormat, path: str, body: dict[str, Any]) -> web.Response:
        """A request that is no turn (Anthropic's count_tokens): whole on a prefill server, else a decode one."""
        headers = {"X-Request-Id": f"pdserve-{uuid.uuid4().hex}"}
        strip_router_only(body)
        for pool in (self.prefill.pool, self.decode):
            backend = pool.least_loaded()
            if backend is None:
                continue
            try:
                status, data = await self.upstream.post_json(pool, backend, path, body, headers, blame=False)
            except UpstreamError as err:
                status, data = err.status, err.body
                if err.serve_elsewhere:
                    continue
            return web.json_response(fmt.client_error(data, status) if status >= 400 else data, status=status)
        return web.json_response(fmt.error(503, "no prefill or decode server available", "server_error"), status=503)

    async def _route(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        plan = await self.planner.plan(turn)
        turn.plan = plan.name
        self.metrics.plans.labels(plan.name).inc()
        tracing.note(plan=plan.name)
        if isinstance(plan, PrefillThenDecode) and plan.local_refused:
            tracing.note(decode_only_refused=plan.local_refused)
            if plan.local_refused != TOO_LONG:
                self.metrics.local_refused.labels(plan.local_refused).inc()
        if isinstance(plan, Degraded):
            if plan.role is None:
                return json_answer(turn, error_body("no prefill or decode server available", "server_error", 503),
                                   503)
            return await self._degraded(request, turn, self.prefill.pool if plan.role == PREFILL else self.decode,
                                        plan.why)
        track = self.cfg.bidirectional_kv_xfer and turn.conversation.tracked
        collector = turn.fmt.collector(keep_for_client=bool(turn.body.get("return_token_ids")))
        if isinstance(plan, DecodeOnly):
            # D computes the new tokens on top of its prefix cache; the params make it publish the turn's
            # blocks for the next turn's pull (policy.LOCAL_PARAMS). No P leg, nothing pulled.
            turn.local_tokens, turn.prompt_tokens = plan.new_tokens, plan.prompt_tokens
            d_params = dict(LOCAL_PARAMS)
            prefer = plan.holder
        else:
            p_started = time.perf_counter()
            try:
                p_params, turn.pulled = await self.prefill.run(turn, plan.decision, plan.anchor)
            except UpstreamError as err:
                if err.serve_elsewhere and self.decode.any_usable():
                    # P failed (killed mid-request, or none usable now); the client has nothing yet: D serves it
                    return await self._degraded(request, turn, self.decode, _failed(err))
                return json_answer(turn, err.body, err.status)
            turn.prefill_ms = 1000 * (time.perf_counter() - p_started)
            d_params = p_params
            prefer = plan.decision.holder if plan.decision else None
        # With `track`, D also returns its sequence, for the next turn's continuation check.
        d_body = turn.fmt.decode_body(turn.body, d_params, track, turn.request_id)
        resp = await self._serve(request, turn, self.decode, prefer, d_body, collector, track,
                                 fallback=self.prefill.pool)
        if isinstance(plan, DecodeOnly):   # reused when D answered it alone (else served elsewhere or failed)
            alone = resp.status == 200 and not turn.degraded
            count_reuse(self.metrics, turn, Decision(HIT, DECODE_ONLY) if alone else Decision(MISS, DECODE_FAILED))
            if not resp.prepared:       # a whole answer not sent yet (a stream's headers left before D was done)
                resp.headers[REUSE_HEADER] = "/".join(turn.reuse)
        return resp

    async def _degraded(self, request: web.Request, turn: Turn, pool: Pool, why: str) -> web.StreamResponse:
        """No server of the other role is usable, or the one tried failed (`why`): serve the request whole
        on `pool` as a plain vLLM request, no KV transfer (the body carries no kv_transfer_params), and
        remember nothing."""
        log.warning("%s: degraded: served whole by a %s server (%s)", turn.request_id, pool.role, why)
        self.metrics.degraded.labels(pool.role).inc()
        tracing.note(degraded_to=pool.role, degraded_reason=why)
        turn.degraded = True
        collector = turn.fmt.collector(keep_for_client=bool(turn.body.get("return_token_ids")))
        return await self._serve(request, turn, pool, None, turn.fmt.whole_body(turn.body, turn.request_id),
                                 collector, False)

    async def _serve(self, request: web.Request, turn: Turn, pool: Pool, prefer: str | None, body: dict[str, Any],
                     collector: Collector, track: bool, fallback: Pool | None = None) -> web.StreamResponse:
        """Run the request on `pool`; when no server of it can serve it and nothing has reached the client
        yet, serve it whole on `fallback` (degraded) instead of failing."""
        if body.get("stream"):
            attempt = lambda b: self._stream(request, turn, pool, b, body, collector, track)  # noqa: E731
        else:
            attempt = lambda b: self._whole(turn, pool, b, body, collector, track)  # noqa: E731
        try:
            return await self.d_leg.on_a_server(turn, pool, prefer, attempt)
        except UpstreamError as err:
            if fallback is not None and err.serve_elsewhere and fallback.any_usable():
                return await self._degraded(request, turn, fallback, _failed(err))
            return json_answer(turn, err.body, err.status)

    async def _whole(self, turn: Turn, pool: Pool, backend: Backend, body: dict[str, Any], collector: Collector,
                     track: bool) -> web.StreamResponse:
        resp, finished = await self.d_leg.whole(turn, pool, backend, body, collector, track)
        if finished is not None:
            await self.book.put(turn, finished)
        return resp

    async def _stream(self, request: web.Request, turn: Turn, pool: Pool, backend: Backend, body: dict[str, Any],
                      collector: Collector, track: bool) -> web.StreamResponse:
        """D's stream relayed; each outcome the D leg yields is recorded before the stream goes on."""
        steps = self.d_leg.stream(request, turn, pool, backend, body, collector, track)
        resp: web.StreamResponse | None = None
        try:
            async for step in steps:
                if isinstance(step, web.StreamResponse):
                    resp = step
                else:
                    await self.book.record(turn, step)
        except BaseException:
            await steps.aclose()    # the leg's connection and its server's load released now, not at collection
            raise
        assert resp is not None
        return resp

    async def counted(self) -> None:
        await self.book.counted()


def _failed(err: UpstreamError) -> str:
    return f"{err.backend} failed: HTTP {err.status}"
