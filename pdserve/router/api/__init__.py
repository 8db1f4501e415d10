"""The wire formats the router serves, one module each, behind one interface (base.WireFormat).

A new endpoint is one module and one line here."""

from __future__ import annotations

from pdserve.router.api.base import WireFormat
from pdserve.router.api.chat import ChatFormat
from pdserve.router.api.completions import CompletionsFormat
from pdserve.router.api.messages import MessagesFormat
from pdserve.router.api.responses import ResponsesFormat

FORMATS: tuple[WireFormat, ...] = (ChatFormat(), CompletionsFormat(), MessagesFormat(), ResponsesFormat())
BY_ROUTE: dict[str, WireFormat] = {route: fmt for fmt in FORMATS for route in fmt.routes}
ROUTES: tuple[str, ...] = tuple(BY_ROUTE)
APIS: tuple[str, ...] = tuple(fmt.api for fmt in FORMATS)
OPENAI = FORMATS[0]     # the shape of errors on paths that are no format's (404s, /v1/models)


def for_path(path: str) -> WireFormat:
    """The format of a request path (the router's own paths answer as OpenAI does)."""
    fmt = BY_ROUTE.get(path)
    if fmt is None and path.startswith("/v1/messages"):    # count_tokens, and 404s under it
        return FORMATS[2]
    return fmt or OPENAI


__all__ = ["APIS", "BY_ROUTE", "FORMATS", "ROUTES", "WireFormat", "for_path"]
