"""The `observe` middleware: one access-log line per request (text by default, JSON with `json_logs`) and one
trace span per completion request, from its turn record and the notes the flow and the legs wrote
(router/telemetry/tracing.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from pdserve.router import api
from pdserve.router.legs.turn import CLIENT_GONE, FAILED, TURN, Turn
from pdserve.router.telemetry.tracing import NOTES, Spans, key_hash

ROUTES = api.ROUTES
request_log = logging.getLogger("pdserve.router.requests")   # the JSON lines (bare: logs.json_request_lines)
access_log = logging.getLogger("pdserve.router.access")      # the text lines, in the router's log format
QUIET_PATHS = ("/health", "/metrics")   # probes and scrapes, every few seconds: not logged


def summary(request: web.Request, notes: dict[str, Any], status: int) -> dict[str, Any]:
    """The request's facts: the turn record (ids, outcome, plan, tokens, degraded) and the notes."""
    turn = request.get(TURN)
    out: dict[str, Any] = {"method": request.method, "route": request.path, "status": status}
    if turn is not None:
        out.update(request_id=turn.request_id, api=turn.fmt.api, outcome=turn.outcome,
                   stream=bool(turn.body.get("stream")), plan=turn.plan or None, tokens_computed=turn.computed,
                   tokens_cached=turn.cached, tokens_tier=turn.tier, tokens_pulled=turn.pulled,
                   tokens_on_d_alone=turn.local_tokens, degraded=turn.degraded)
        out.setdefault("conversation", key_hash(turn.conversation.explicit))
    out.update({k: v for k, v in notes.items() if v is not None})
    return {k: v for k, v in out.items() if v is not None}


def conversation(turn: Turn) -> str:
    """The conversation as the router knows it, never as the client named it: its key's hash (the same as in
    traces and JSON lines: session ids are the client's text, and may be long), `history` when automatic
    detection looked it up, `-` when the request names none."""
    conv = turn.conversation
    return key_hash(conv.explicit) or ("history" if conv.messages else "-")


def access_line(request: web.Request, status: int, ms: float) -> str:
    """One text line: method, path, status, API, conversation, route plan, the reuse outcome, prompt tokens by
    source (P computed, P's prefix cache, P's CPU tier, pulled from D, computed by D alone), the time, the outcome
    and the router's request id."""
    turn = request.get(TURN)
    if turn is None:
        return f"{request.method} {request.path} {status} {ms:.1f}ms"
    reuse = "/".join(turn.reuse) if turn.reuse else "-"
    plan = "degraded" if turn.degraded else turn.plan or "-"
    return (f"{request.method} {request.path} {status} {ms:.1f}ms api={turn.fmt.api} conv={conversation(turn)} "
            f"plan={plan} reuse={reuse} p_computed={_n(turn.computed)} p_cached={_n(turn.cached)} "
            f"p_tier={_n(turn.tier)} pulled={_n(turn.pulled)} "
            f"d_alone={_n(turn.local_tokens)} outcome={turn.outcome or (CLIENT_GONE if status == 499 else FAILED)} "
            f"id={turn.request_id}")


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def middleware(spans: Spans | None, json_logs: bool, access: bool = True):
    """One span per completion request (with `spans`), and one log line per request but probes and scrapes
    (with `access`: a text line; with `json_logs`: a JSON line instead, every field named)."""
    lines = access or json_logs

    @web.middleware
    async def observe(request: web.Request, handler):
        turn_route = request.path in ROUTES
        if not turn_route and (not lines or request.path in QUIET_PATHS):
            return await handler(request)
        # The flow's notes feed spans and JSON lines only: the text line reads the turn record.
        notes: dict[str, Any] | None = {} if turn_route and (json_logs or spans is not None) else None
        token = NOTES.set(notes) if notes is not None else None
        handle = spans.start(request) if spans is not None and turn_route else None
        started = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499                      # the client went away (nginx's code for it)
            raise
        finally:
            ms = 1000 * (time.perf_counter() - started)
            if token is not None:
                NOTES.reset(token)
            if json_logs or handle is not None:
                facts = summary(request, notes or {}, status)
                if turn_route and facts.get("outcome") is None:
                    facts["outcome"] = CLIENT_GONE if status == 499 else FAILED
                trace_id = spans.finish(handle, facts, status) if handle is not None else None
                if json_logs:
                    line = {"ts": round(time.time(), 3), "trace_id": trace_id, "duration_ms": round(ms, 1), **facts}
                    request_log.info("%s", json.dumps({k: v for k, v in line.items() if v is not None},
                                                       separators=(",", ":")))
            if access and not json_logs:
                access_log.info(access_line(request, status, ms))

    return observe
