"""One client request as the router follows it (a turn), how it ends, and what the client is told about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.router.api import WireFormat
from pdserve.router.conversation import Conversation
from pdserve.router.route.backends import Suspects
from pdserve.router.route.policy import template_digest
from pdserve.router.wire import PLAN_HEADER, PULLED_HEADER


@dataclass
class Turn:
    route: str
    fmt: WireFormat                    # the request's wire format (chat, completions, messages, responses)
    body: dict[str, Any]
    request_id: str
    reply_id: str                      # X-Request-Id returned to the client
    conversation: Conversation         # who it continues: lookup and store keys (conversation.py)
    started: float = field(default_factory=time.perf_counter)
    decide_ms: float | None = None     # the reuse decision (Server-Timing, like the legs)
    prefill_ms: float | None = None    # reported to the client in Server-Timing
    pulled: int | None = None          # tokens P loaded from D's KV (PULLED_HEADER)
    degraded: bool = False             # served whole by one role
    plan: str = ""                     # the route plan's name (wire.PLANS), as PLAN_HEADER
    local_tokens: int | None = None    # tokens D computes when the turn is served on D alone
    computed: int | None = None        # prompt tokens P computed itself (not pulled, not in its own cache)
    reuse: tuple[str, str] | None = None   # (result, reason) counted in pdserve_router_reuse_decisions_total
    prompt_tokens: int | None = None   # the prompt's tokens (P's usage; on D alone a bound from above)
    outcome: str | None = None         # set once, by Flow.end ('stored' while a shared store's reply is due)
    suspects: Suspects = field(default_factory=Suspects)   # 5xx answers not yet counted against a server
    template: str | None = None        # policy.template_digest of the body, once computed
    # The decode server sent a request that makes it hold the turn's KV at its end (kv_transfer_params): if
    # the turn ends before the router has D's handles, D may hold blocks the router never heard of.
    held_on: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}

    @property
    def answered(self) -> bool:
        """The client has (or is being sent) a whole answer: what it does next is no cancellation."""
        return self.outcome in ANSWERED


# Every turn ends in exactly one of these (pdserve_router_turns_total{outcome}).
STORED = "stored"              # answered; D's handles kept for the conversation's next turn
UNAVAILABLE = "unavailable"    # answered; D reported no handles (bidirectional transfer off on D, or a version
                               #   that streams none without pdserve.engine.entry)
UNTRACKED = "untracked"        # answered; nothing to remember (no conversation identity, or reuse off)
DEGRADED = "degraded"          # answered whole by one role, no KV transfer
NOT_STORED = "not_stored"      # answered; D's handles could not be kept (the shared store was unavailable)
CLIENT_GONE = "client_gone"    # the client left before the answer was complete; D's request was dropped
FAILED = "failed"              # an error answer, or a stream a backend broke
CUT = "cut"                    # still in flight when a stopping router's drain limit passed (front/drain.py)
ANSWERED = (STORED, UNAVAILABLE, UNTRACKED, DEGRADED, NOT_STORED)
TURN_OUTCOMES = (*ANSWERED, CLIENT_GONE, FAILED, CUT)
TURN = web.RequestKey("turn", Turn)


class ClientGone(Exception):
    """A write to the client failed: it went away. Never counted against a backend."""


def template(turn: Turn) -> str:
    """policy.template_digest of the turn's body, computed once."""
    if turn.template is None:
        turn.template = template_digest(turn.body)
    return turn.template


def headers(turn: Turn, decode_ms: float | None = None) -> dict[str, str]:
    """X-Request-Id, Server-Timing with the P leg (and D leg) durations, and the tokens P pulled from D:
    for benchmarks, tracing and scripts/reuse_check.py."""
    out = {"X-Request-Id": turn.reply_id}
    timing = [f"{leg};dur={ms:.1f}" for leg, ms in (("decide", turn.decide_ms), ("prefill", turn.prefill_ms),
                                                     ("decode", decode_ms)) if ms is not None]
    if timing:
        out["Server-Timing"] = ", ".join(timing)
    if turn.pulled is not None:
        out[PULLED_HEADER] = str(turn.pulled)
    if turn.plan:
        out[PLAN_HEADER] = "degraded" if turn.degraded else turn.plan
    return out


def json_answer(turn: Turn, data: dict[str, Any], status: int, decode_ms: float | None = None) -> web.Response:
    """A whole answer; an error in the shape the client's wire format uses."""
    if status >= 400:
        data = turn.fmt.client_error(data, status)
    return web.json_response(data, status=status, headers=headers(turn, decode_ms))
