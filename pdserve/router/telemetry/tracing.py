"""What a request did, for its trace span and its JSON log line: a side door, not a layer.

The flow and the legs call `note(...)` where they decide something (identity, the reuse decision, the
servers, retries, degraded mode); `note` writes into the current request's notes, a context variable that
only the `observe` middleware sets (router/front/observe.py), and only when tracing (`otlp_endpoint`) or JSON
logs are on. Off, a note is one context-variable read, and OpenTelemetry is never imported
(router/telemetry/otel.py holds all of it).
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from typing import Any, Protocol

from aiohttp import web

from pdserve.router.identity import Key

NOTES: ContextVar[dict[str, Any] | None] = ContextVar("pdserve_router_notes", default=None)
ATTRIBUTE_PREFIX = "pdserve."


def note(**facts: Any) -> None:
    """Facts about the current request (no-op unless the request is observed)."""
    notes = NOTES.get()
    if notes is not None:
        notes.update(facts)


def key_hash(key: Key | None) -> str | None:
    """A conversation's key, hashed: logs and traces can follow a conversation without naming it."""
    return hashlib.sha256("\0".join(key).encode("utf-8", "surrogateescape")).hexdigest()[:16] if key else None


class Spans(Protocol):
    """The tracer's side (router/telemetry/otel.py), as the middleware uses it."""

    def start(self, request: web.Request) -> Any: ...

    def finish(self, handle: Any, attributes: dict[str, Any], status: int) -> str | None: ...
