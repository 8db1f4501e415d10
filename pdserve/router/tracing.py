"""What a request did, for its trace span and its JSON log line: a side door, not a layer.

The flow and the legs call `note(...)` where they decide something (identity, the reuse decision, the
servers, retries, degraded mode); `note` writes into the current request's notes, a context variable that
only the `observe` middleware sets, and only when tracing (`otlp_endpoint`) or JSON logs are on. Off, a note
is one context-variable read, and OpenTelemetry is never imported (router/otel.py holds all of it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from contextvars import ContextVar
from typing import Any, Protocol

from aiohttp import web

from pdserve.router import api
from pdserve.router.identity import Key
from pdserve.router.turn import CLIENT_GONE, FAILED, TURN

NOTES: ContextVar[dict[str, Any] | None] = ContextVar("pdserve_router_notes", default=None)
ROUTES = api.ROUTES
ATTRIBUTE_PREFIX = "pdserve."
request_log = logging.getLogger("pdserve.router.requests")


def note(**facts: Any) -> None:
    """Facts about the current request (no-op unless the request is observed)."""
    notes = NOTES.get()
    if notes is not None:
        notes.update(facts)


def key_hash(key: Key | None) -> str | None:
    """A conversation's key, hashed: logs and traces can follow a conversation without naming it."""
    return hashlib.sha256("\0".join(key).encode("utf-8", "surrogateescape")).hexdigest()[:16] if key else None


class Spans(Protocol):
    """The tracer's side (router/otel.py), as the middleware uses it."""

    def start(self, request: web.Request) -> Any: ...

    def finish(self, handle: Any, attributes: dict[str, Any], status: int) -> str | None: ...


def summary(request: web.Request, notes: dict[str, Any], status: int) -> dict[str, Any]:
    """The request's facts: the turn record (ids, outcome, pulled tokens, degraded) and the notes."""
    turn = request.get(TURN)
    out: dict[str, Any] = {"route": request.path, "status": status}
    if turn is not None:
        out.update(request_id=turn.request_id, outcome=turn.outcome, stream=bool(turn.body.get("stream")),
                   tokens_pulled=turn.pulled, degraded=turn.degraded)
        out.setdefault("conversation", key_hash(turn.explicit))
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
