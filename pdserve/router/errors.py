"""OpenAI-shaped error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from aiohttp import web


def error_body(message: str, err_type: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def json_error(status: int, message: str, err_type: str = "invalid_request_error",
               param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, status, param), status=status)


def sse_error(message: str, err_type: str = "server_error", code: int = 502) -> bytes:
    return b"data: " + json.dumps(error_body(message, err_type, code)).encode() + b"\n\n"


class UpstreamError(Exception):
    """A backend answered with an error, or could not be reached. `body` is passed to the client."""

    def __init__(self, status: int, body: dict, backend: str | None = None, never_sent: bool = False):
        super().__init__(f"{backend}: HTTP {status}")
        self.status = status
        self.body = body
        self.backend = backend
        self.never_sent = never_sent   # no connection was made: the request surely had no effect

    @classmethod
    def unreachable(cls, backend: str, why: str, never_sent: bool = False) -> "UpstreamError":
        return cls(502, error_body(f"backend {backend} unreachable: {why}", "server_error", 502), backend,
                   never_sent)
