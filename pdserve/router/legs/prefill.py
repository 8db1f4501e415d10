"""The P leg: prefill (max_tokens 1) with the offer of D's blocks the turn's plan carries (offer.py decides it),
with failover across prefill servers and a recompute retry when reading D's blocks fails."""

from __future__ import annotations

import logging
import time
from typing import Any

from pdserve.router.errors import UpstreamError, backend_at_fault, error_body
from pdserve.router.kv.reuse import CPU_TIER, ENGINE_CHECKED, FIRST, HIT, MISS, NO_ENTRY, Decision, engine_outcome
from pdserve.router.legs.offer import Offers
from pdserve.router.legs.turn import Turn
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend
from pdserve.router.route.cost import CostModel
from pdserve.router.route.policy import RoutePolicy
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.router.wire import CHECKED_KEY, LOCAL_KEY, PULLED_KEY, TIER_KEY

log = logging.getLogger("pdserve.router")


class PrefillLeg:
    def __init__(self, upstream: Upstream, offers: Offers, costs: CostModel, metrics: RouterMetrics,
                 policy: RoutePolicy):
        self.policy = policy
        self.upstream = upstream
        self.offers = offers                 # P's block size and which engines check an offer (offer.py)
        self.pool = offers.pool
        self.costs = costs
        self.metrics = metrics
        self.warned: set[str] = set()        # prefill servers said to run without NixlConnector

    # -- prefill -----------------------------------------------------------------------------------
    async def run(self, turn: Turn, decision: Decision | None,
                  anchor: str | None = None) -> tuple[dict[str, Any], int | None]:
        """P's kv_transfer_params for D, and the tokens P pulled from D (None when P does not say). Records the reuse outcome: a hit only when P really read D's
        blocks; otherwise the reason (the decision's, pull_slower, or read_failed). The policy picks the
        server (`anchor` pins the conversation under the affinity pick) and guards the offer by cost."""
        offer = decision if decision is not None and decision.result == HIT else None
        outcome = decision
        tried: list[str] = []
        served = False
        try:
            while True:
                backend = self.policy.pick_prefill(self.pool, anchor, set(tried))
                if backend is None:
                    raise UpstreamError(503, error_body("no prefill server available", "server_error", 503))
                tried.append(backend.name)
                use, guarded = self.policy.offer(backend.name, offer)
                if guarded is not None:
                    outcome = guarded
                if use is not None and use.reason == ENGINE_CHECKED and backend.name not in self.offers.engine_checks:
                    use, outcome = None, Decision(MISS, "unverifiable", holder=use.holder)   # its engine may not cut
                try:
                    params, pulled, checked, local = await self._once(backend, turn, use)
                    served = True
                    if use is not None and use.reason == ENGINE_CHECKED:
                        outcome = engine_outcome(use, pulled, checked, await self.offers.read_block_size(), local,
                                                 turn.tier)
                    elif use is not None and pulled == 0 and turn.tier:
                        outcome = Decision(MISS, CPU_TIER, holder=use.holder)   # offered, P's CPU tier loaded
                    return params, pulled
                except UpstreamError as err:
                    if use is not None and err.status >= 500:
                        # Reading D's blocks failed (stale handle, D restarted, transfer error): recompute
                        # on the same server, so the client still gets one correct answer.
                        log.warning("prefill with D's blocks failed on %s (%s); retrying without them",
                                    backend.name, err)
                        self.metrics.read_retries.inc()
                        tracing.note(prefill_read_retry=True)
                        offer, outcome = None, Decision(MISS, "read_failed", holder=use.holder)
                        try:
                            params, pulled, _, _ = await self._once(backend, turn, None)
                            served = True
                            return params, pulled
                        except UpstreamError as again:
                            err = again
                    # Nothing has reached the client yet: another prefill server may answer.
                    if (not backend_at_fault(err.status, err.body) or err.status == 504
                            or len(tried) >= len(self.pool.backends)):
                        raise err from None
        finally:
            tracing.note(prefill_servers=",".join(tried))
            if outcome is not None and outcome.result == HIT and not served:
                # P refused or failed the request: nothing was read, so it is no hit.
                outcome = Decision(MISS, "prefill_failed", holder=outcome.holder)
            if outcome is None and self.offers.cfg.bidirectional_kv_xfer and turn.conversation.messages \
                    and turn.fmt.first_turn(turn.body):
                outcome = Decision(MISS, NO_ENTRY)   # a first turn found by its history alone: no key to look up
            if outcome is not None:
                count_reuse(self.metrics, turn, outcome)
                if outcome.result == HIT:
                    self.metrics.reuse_tokens_offered.inc(outcome.tokens)
                # Per turn: at debug level (a line a turn cost ~9% of the router's CPU at 1,800 turns/s);
                # the same facts are in the metrics, on the trace span and in json_logs' line.
                log.debug("%s: prefill on %s, reuse %s (%s, %d tokens offered)", turn.request_id,
                         ",".join(tried), outcome.result, outcome.reason, outcome.tokens)

    async def _once(self, backend: Backend, turn: Turn,
                    use: Decision | None) -> tuple[dict[str, Any], int | None, int | None, int | None]:
        """P's params for D, the tokens it pulled from D, the common prefix its engine found (an
        engine-checked offer only) and its own prefix-cache hits; the last three None when P does not say.
        The turn gets P's counts by source (cached, tier, computed)."""
        p_body = turn.fmt.prefill_body(turn.body, use.params if use else None, turn.request_id)
        started = time.perf_counter()
        # With D's blocks offered, a failure may be D's (blocks gone) as much as P's: not P's breaker.
        status, data = await self.upstream.post_json(self.pool, backend, turn.route, p_body, turn.headers,
                                                     blame=use is None, suspects=turn.suspects, valid=has_kv_params)
        if status != 200:
            raise UpstreamError(status, data, backend.name)
        params = data.get("kv_transfer_params")
        counts = pop_counts(params) if isinstance(params, dict) else None   # never forwarded to D
        checked = params.pop(CHECKED_KEY, None) if isinstance(params, dict) else None
        if counts is not None:
            self.offers.engine_checks.add(backend.name)
        if not isinstance(params, dict):
            self._misconfigured(backend)
            raise UpstreamError(502, error_body(
                f"prefill server {backend.name} returned no kv_transfer_params; is it running with "
                "NixlConnector?", "server_error", 502), backend.name)
        turn.prompt_tokens = turn.fmt.prompt_tokens(data)     # what D's output cap is fitted to (context.py)
        self._learn(backend, use, time.perf_counter() - started, turn.prompt_tokens, counts)
        prompt = turn.fmt.prompt_tokens(data)
        turn.computed = prompt - sum(counts) if prompt is not None and counts is not None else None
        turn.cached, turn.tier = (counts[1], counts[2]) if counts is not None else (None, None)
        return (params, counts[0] if counts is not None else None, checked if isinstance(checked, int) else None,
                counts[1] if counts is not None else None)

    def _misconfigured(self, backend: Backend) -> None:
        """P answered a prefill without handles: it runs without NixlConnector, so every request it gets is
        computed again whole on D. A failure of P's (its breaker counts it, see has_kv_params), counted,
        and said once per server, loudly: nothing else would show that every request runs twice."""
        self.metrics.prefill_without_kv.labels(backend.name).inc()
        if backend.name not in self.warned:
            self.warned.add(backend.name)
            log.error("prefill server %s answers prefills without kv_transfer_params: it is not running "
                      "NixlConnector (vllm --kv-transfer-config), so its requests are served again whole on a "
                      "decode server; counted in pdserve_router_prefill_without_kv_params_total", backend.name)

    def _learn(self, backend: Backend, use: Decision | None, seconds: float, prompt: int | None,
               counts: tuple[int, int, int] | None) -> None:
        # (pulled from D, P's own prefix-cache hits, P's CPU tier), from the entry's connector patch; None
        # without it: then nothing is learned about pulls (remote_prefill_cached_tokens mixes them, 0.26 lacks it).
        pulled, local, tier = counts if counts is not None else (0, 0, 0)
        self.metrics.reuse_tokens_pulled.inc(pulled)
        self.metrics.prefill_tokens_local.inc(local)
        self.metrics.prefill_tokens_tier.inc(tier)
        if prompt is None:
            return
        holder = use.holder if use else None
        if (use is not None and counts is None) or tier:
            return   # a pull of unknown size, or a leg that copied the CPU tier's KV in: no clean sample
        self.costs.observe(backend.name, holder, seconds, prompt, pulled + local, use is not None and pulled > 0,
                           pulled_tokens=pulled)
        if backend.name in self.costs.recompute:
            self.metrics.cost.labels("recompute", backend.name, "").set(self.costs.recompute[backend.name])
        if holder and (backend.name, holder) in self.costs.pull:
            self.metrics.cost.labels("pull", backend.name, holder).set(self.costs.pull[(backend.name, holder)])


def count_reuse(metrics: RouterMetrics, turn: Turn, outcome: Decision) -> None:
    """The turn's reuse outcome, once (pdserve_router_reuse_decisions_total): a hit whenever D's KV was reused;
    otherwise a conversation's first turn (no earlier model output in its history) is FIRST, not a miss: there
    was nothing of it to reuse."""
    result = FIRST if outcome.result != HIT and turn.fmt.first_turn(turn.body) else outcome.result
    metrics.reuse.labels(result, outcome.reason, turn.fmt.api).inc()
    turn.reuse = result, outcome.reason
    tracing.note(reuse=result, reuse_reason=outcome.reason, tokens_offered=outcome.tokens)


def has_kv_params(data: dict[str, Any]) -> bool:
    return isinstance(data.get("kv_transfer_params"), dict)


def pop_counts(params: dict[str, Any]) -> tuple[int, int, int] | None:
    """(tokens P pulled from D, from P's own prefix cache, from P's CPU tier) taken out of P's
    kv_transfer_params; the tier's 0 from an entry without one (TIER_KEY absent)."""
    pulled, local, tier = params.pop(PULLED_KEY, None), params.pop(LOCAL_KEY, None), params.pop(TIER_KEY, 0)
    if isinstance(pulled, int) and isinstance(local, int):
        return max(0, pulled), max(0, local), max(0, tier) if isinstance(tier, int) else 0
    return None
