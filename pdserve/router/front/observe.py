"""The `observe` middleware: one trace span and one JSON log line per completion request, from its turn
record and the notes the flow and the legs wrote (router/telemetry/tracing.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from pdserve.router import api
from pdserve.router.legs.turn import CLIENT_GONE, FAILED, TURN
from pdserve.router.telemetry.tracing import NOTES, Spans, key_hash

ROUTES = api.ROUTES
request_log = logging.getLogger("pdserve.router.requests")


def summary(request: web.Request, notes: dict[str, Any], status: int) -> dict[str, Any]:
    """The request's facts: the turn record (ids, outcome, pulled tokens, degraded) and the notes."""
    turn = request.get(TURN)
    out: dict[str, Any] = {"route": request.path, "status": status}
    if turn is not None:
        out.update(request_id=turn.request_id, outcome=turn.outcome, stream=bool(turn.body.get("stream")),
                   tokens_pulled=turn.pulled, degraded=turn.degraded)
        out.setdefault("conversation", key_hash(turn.conversation.explicit))
    out.update({k: v for k, v in notes.items() if v is not None})
    return {k: v for k, v in out.items() if v is not None}


def middleware(spans: Spans | None, json_logs: bool):
    """One span per completion request (with `spans`) and one JSON log line (with `json_logs`)."""

    @web.middleware
    async def observe(request: web.Request, handler):
        if request.path not in ROUTES:
            return await handler(request)
        notes: dict[str, Any] = {}
        token = NOTES.set(notes)
        handle = spans.start(request) if spans is not None else None
        started = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            status = 499                      # the client went away (nginx's code for it)
            raise
        finally:
            NOTES.reset(token)
            facts = summary(request, notes, status)
            if facts.get("outcome") is None:
                facts["outcome"] = CLIENT_GONE if status == 499 else FAILED
            trace_id = spans.finish(handle, facts, status) if spans is not None else None
            if json_logs:
                line = {"ts": round(time.time(), 3), "trace_id": trace_id,
                        "duration_ms": round(1000 * (time.perf_counter() - started), 1), **facts}
                request_log.info("%s", json.dumps({k: v for k, v in line.items() if v is not None},
                                                   separators=(",", ":")))

    return observe
