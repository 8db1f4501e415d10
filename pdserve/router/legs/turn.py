"""One client request as the router follows it (a turn), how it ends, and what the client is told about it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.router import fastjson
from pdserve.router.api import WireFormat
from pdserve.router.conversation import Conversation
from pdserve.router.route.backends import Suspects
from pdserve.router.route.policy import template_digest
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.router.wire import PLAN_HEADER, PULLED_HEADER, REUSE_HEADER, TIER_HEADER

log = logging.getLogger("pdserve.router")
WRITE_STALLED = "write_stalled"    # pdserve_router_connections_dropped_total's reason for a client that stops reading


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
    cached: int | None = None          # prompt tokens P took from its own prefix cache (GPU)
    tier: int | None = None            # prompt tokens P loaded from its CPU KV tier (TIER_HEADER)
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


async def write_within(write: Awaitable[Any], request: web.Request, seconds: float, metrics: RouterMetrics) -> Any:
    """A write to the client that may wait for it to read (its buffers full): given up after `seconds`
    (RouterConfig.client_stall_timeout), the connection closed and the client taken as gone, so a client that
    stops reading holds no admission slot, no backend request and no buffers (issue 45: 8 such sockets held
    every slot for 50 s)."""
    try:
        async with asyncio.timeout(seconds):
            return await write
    except TimeoutError:
        drop_stalled(request, metrics, seconds)
        raise ClientGone() from None
    except ConnectionError as err:   # aiohttp's ClientConnectionResetError included
        raise ClientGone() from err


def drop_stalled(request: web.Request, metrics: RouterMetrics, seconds: float) -> None:
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if transport is not None:
        transport.abort()            # what it did not read is dropped with it
    metrics.connections_dropped.labels(WRITE_STALLED).inc()
    log.warning("closed a connection from %s (%s): the client read nothing of its answer for %gs",
                peer and peer[0], WRITE_STALLED, seconds)


def template(turn: Turn) -> str:
    """policy.template_digest of the turn's body, computed once."""
    if turn.template is None:
        turn.template = template_digest(turn.body)
    return turn.template


def headers(turn: Turn, decode_ms: float | None = None) -> dict[str, str]:
    """X-Request-Id, Server-Timing with the decision's and the P leg's (and D leg's) durations, the tokens P
    pulled from D and loaded from its CPU tier, the plan and the reuse outcome: for benchmarks, tracing and
    scripts/reuse_check.py."""
    out = {"X-Request-Id": turn.reply_id}
    timing = [f"{leg};dur={ms:.1f}" for leg, ms in (("decide", turn.decide_ms), ("prefill", turn.prefill_ms),
                                                     ("decode", decode_ms)) if ms is not None]
    if timing:
        out["Server-Timing"] = ", ".join(timing)
    if turn.pulled is not None:
        out[PULLED_HEADER] = str(turn.pulled)
        out[TIER_HEADER] = str(turn.tier or 0)
    if turn.plan:
        out[PLAN_HEADER] = "degraded" if turn.degraded else turn.plan
    if turn.reuse:
        out[REUSE_HEADER] = "/".join(turn.reuse)
    return out


def json_answer(turn: Turn, data: dict[str, Any], status: int, decode_ms: float | None = None) -> web.Response:
    """A whole answer; an error in the shape the client's wire format uses."""
    if status >= 400:
        data = turn.fmt.client_error(data, status)
    return web.Response(body=fastjson.dumps(data), status=status, headers=headers(turn, decode_ms),
                        content_type="application/json", charset="utf-8")
