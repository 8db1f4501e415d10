"""A turn's plan: the policy asked with what it needs (the roles left; the offer of what D holds for the
conversation, checked against the new prompt, with its length and the holder's load)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.kv.reuse import HIT, UNVERIFIED, Decision, ReuseEntry
from pdserve.router.legs.book import TurnBook
from pdserve.router.legs.offer import Offers
from pdserve.router.legs.turn import Turn, template
from pdserve.router.route.backends import Pool
from pdserve.router.route.policy import (
    UNTOKENIZED, DecodeOnly, RoutePolicy, TurnInputs, TurnPlan, new_text, new_tokens_at_least,
    new_tokens_bound,
)
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics


class Planner:
    def __init__(self, cfg: RouterConfig, policy: RoutePolicy, offers: Offers, book: TurnBook,
                 metrics: RouterMetrics, recheck: Callable[[Pool], Awaitable[None]]):
        self.cfg = cfg
        self.policy = policy
        self.offers = offers
        self.book = book
        self.metrics = metrics
        self.recheck = recheck
        self.decode = offers.decode
        self.prefill = offers.pool
        self.missing: list[Pool] | None = None   # the roles pdserve_router_degraded shows as missing

    async def _missing(self) -> list[Pool]:
        # Check D before the P leg: a prefill whose blocks no decode server can read is wasted work.
        missing = [pool for pool in (self.decode, self.prefill) if not pool.any_usable()]
        if missing:
            # The router's view may be a probe interval old (a server restarted since): ask again first.
            await asyncio.gather(*(self.recheck(pool) for pool in missing))
            missing = [pool for pool in missing if not pool.any_usable()]
        if missing != self.missing:    # set the gauges on a change only: per request they cost CPU (docs/router.md)
            self.missing = missing
            for pool in (self.decode, self.prefill):
                self.metrics.degraded_now.labels(pool.role).set(1 if pool in missing else 0)
        return missing

    async def plan(self, turn: Turn) -> TurnPlan:
        """The policy's plan for the turn, from what it needs: the roles left, and the trimmed offer of
        what D holds for the conversation with the new prompt's length and the holder's load."""
        missing = await self._missing()
        if missing:
            return self.policy.plan(TurnInputs(missing=tuple(pool.role for pool in missing)))
        keys = await self.book.keys(turn) if self.cfg.bidirectional_kv_xfer else []
        if not keys:
            return self.policy.plan(TurnInputs(anchor=self._anchor(turn)))
        decide_started = time.perf_counter()
        entry, why, stamp = await self.book.take(turn, keys)
        quick = self._unverified_short_turn(turn, entry, stamp)
        if quick is not None:
            turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
            return quick
        at_least = await self._too_long_for_d_alone(turn, entry, stamp)
        if at_least is not None:
            # P's engine checks the offer against its own tokens: no /tokenize (its cost grows with the prompt)
            decision = self.offers.engine_check(entry, entry.num_tokens + at_least)
            turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
            return self.policy.plan(self._inputs(turn, decision))
        # P's /tokenize of the new prompt: the token-level check a pull needs (reuse.decide)
        decision = await self.offers.decide(entry, why, turn.fmt, turn.body)
        turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
        unseen = any(f in turn.body for f in UNTOKENIZED) and not (
            isinstance(stamp, list) and len(stamp) == 2 and stamp[1] == template(turn))
        return self.policy.plan(self._inputs(turn, decision, unseen))

    def _anchor(self, turn: Turn) -> str | None:
        conv = turn.conversation
        return self.policy.anchor(conv.explicit, conv.tenant, conv.messages, conv.root)

    def _inputs(self, turn: Turn, decision: Decision, unseen_change: bool = False) -> TurnInputs:
        holder = self.decode.by_name(decision.holder) if decision.holder else None
        return TurnInputs(decision=decision, block_size=self.offers.block_size,
                          holder_load=holder.in_flight if holder else 0, unseen_change=unseen_change,
                          anchor=self._anchor(turn))

    async def _too_long_for_d_alone(self, turn: Turn, entry: ReuseEntry | None, stamp: Any) -> int | None:
        """Tokens the new messages take at least, when that many rule D alone out (or no short-turn rule is
        on) and every prefill server's engine checks an offer itself: the router then needs no count of the
        whole prompt and leaves the check to P (reuse.engine_checked). Their words bound it from below; where
        their bytes cannot bound it under the rule's limit either, P counts the new text alone (a /tokenize
        of a few hundred tokens, not of the whole history). None: tokenize and check the whole prompt here."""
        if entry is None or entry.sequence is None or not self.offers.engines_check():
            return None
        messages = turn.conversation.messages
        covered = stamp[0] if isinstance(stamp, list) and len(stamp) == 2 and isinstance(stamp[0], int) \
            and turn.conversation.proves_prefix(entry.by_prompt) else None
        text = new_text(messages, covered)
        at_least = new_tokens_at_least(text)
        if self.policy.short is None:
            return at_least or 0
        limit = self.policy.short.max_tokens
        if text is None or (at_least or 0) > limit:
            return at_least
        bound = new_tokens_bound(messages, covered)
        if bound is not None and bound <= limit:
            return None                         # may be D's alone: count and check the whole prompt
        counted = await self.offers.count_tokens(text)
        return counted if counted is not None and counted > limit else None

    def _unverified_short_turn(self, turn: Turn, entry: ReuseEntry | None, stamp: Any) -> DecodeOnly | None:
        """D alone without P's /tokenize (on one H200 a third of a D-alone turn at 25k tokens) when the new
        messages are few enough bytes to bound their tokens (policy.new_tokens_bound). Only for a match that
        proves D's prefix (Conversation.proves_prefix); otherwise the turn is tokenized and checked as for a
        pull. The entry's stamp (policy.turn_stamp) says how many messages the match covers (all after them
        are counted, an assistant message the client added too) and that the template's other inputs (tools,
        documents, chat_template_kwargs...) are the ones D computed; without it, or with other ones, the turn
        is checked. A bound over the rule's limit, or a rule that prefers P, falls through to the checked path
        (which may still choose D alone on the exact count)."""
        if (entry is None or not turn.conversation.proves_prefix(entry.by_prompt) or self.policy.short is None
                or not turn.fmt.native_token_ids or not isinstance(stamp, list) or len(stamp) != 2
                or self.offers.below_threshold(entry) or not self.offers.holds(entry)):
            return None
        covered, stamped = stamp
        if not isinstance(covered, int) or stamped != template(turn):
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
