"""OpenAI-shaped error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def error_body(message: str, err_type: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def json_error(status: int, message: str, err_type: str = "invalid_request_error",
               param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, status, param), status=status)


def sse_error(message: str, err_type: str = "server_error", code: int = 502) -> bytes:
    return b"data: " + json.dumps(error_body(message, err_type, code)).encode() + b"\n\n"


# vLLM answers invalid input with a 400, but some paths surface it as a 500 whose error type says so.
CLIENT_FAULT_TYPES = ("badrequest", "validation", "invalidrequest")


def backend_at_fault(status: int, data: Any) -> bool:
    """Is this answer the backend's failure (counts toward its breaker), not the request's?"""
    if status < 500:
        return False
    err = data.get("error") if isinstance(data, dict) else None
    kind = str(err.get("type") or "") if isinstance(err, dict) else ""
    kind = kind.lower().replace("_", "").replace(" ", "")
    return not any(t in kind for t in CLIENT_FAULT_TYPES)


class UpstreamError(Exception):
    """A backend answered with an error, or could not be reached. `body` is passed to the client."""

    def __init__(self, status: int, body: dict, backend: str | None = None, never_sent: bool = False,
                 routers_own: bool = False):
        super().__init__(f"{backend}: HTTP {status}")
        self.status = status
        self.body = body
        self.backend = backend
        self.never_sent = never_sent   # no connection was made: the request surely had no effect
        self.routers_own = routers_own  # the router lacked a resource (a pooled connection, descriptors)

    @property
    def serve_elsewhere(self) -> bool:
        """Worth serving whole on the other role (degraded): the backend failed on its own (connection
        lost, 5xx that is not about the input), not a timeout (a second try would double a long wait) and
        not the router's own shortage (the other role would hit it too)."""
        return (self.status >= 500 and self.status != 504 and not self.routers_own
                and backend_at_fault(self.status, self.body))

    @classmethod
    def unreachable(cls, backend: str, why: str, never_sent: bool = False) -> "UpstreamError":
        return cls(502, error_body(f"backend {backend} unreachable: {why}", "server_error", 502), backend,
                   never_sent)
