"""Parsing a large JSON answer without stalling the event loop for every other client.

`json.loads` is C code that holds the GIL from start to end, so no thread takes it off the loop: a 13 MB
answer of 2M token ids (vLLM's `prompt_token_ids`, which the router asks for) stalled every other client of
the router ~0.6 s on the 2-core VM, four of them at once ~3 s (issue 35). Token-id arrays are the only part
of a backend's answer that grows that large, so here they are cut out of the raw bytes first and parsed a
slice at a time, the loop running between slices; the rest of the answer (small) is parsed as usual and the
arrays put back where they were. The result equals `json.loads(raw)`.

A key can only be matched where it is one: inside a JSON string every `"` is escaped, so `"token_ids":[`
never matches text in a string.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from typing import Any

from pdserve.router import fastjson

LARGE = 1 << 20                 # answers at least this large go through here
SLICE = 256 * 1024              # bytes of ids parsed between two turns of the loop
KEYS = (b'"prompt_token_ids"', b'"token_ids"')
AFTER_KEY = re.compile(rb"\s*:\s*\[")
NOT_IDS = b"0123456789, \t\r\n"  # what is left of an ids array without these is not one
MARK = "\x00pdserve-ids-"       # + a nonce per answer: a string the backend cannot have guessed
_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}


async def loads(raw: bytes) -> Any:
    """json.loads(raw), yielding to the loop while it parses long token-id arrays."""
    if len(raw) < LARGE:
        return fastjson.loads(raw)
    spans = _long_arrays(raw)
    if not spans:
        return fastjson.loads(raw)
    loop = asyncio.get_running_loop()
    lock = _locks.get(loop) or _locks.setdefault(loop, asyncio.Lock())
    async with lock:                         # one at a time: a slice parsed is memory held (2M ids: ~72 MB)
        mark = MARK + secrets.token_hex(8) + ":"
        escaped = mark.replace("\x00", "\\u0000").encode()
        parts: list[bytes] = []
        at = 0
        for n, (start, end) in enumerate(spans):
            parts += [raw[at:start], b'"%s%d"' % (escaped, n)]
            at = end + 1
        parts.append(raw[at:])
        data = json.loads(b"".join(parts))
        parsed = [await _ids(raw, start + 1, end) for start, end in spans]
    return _put_back(data, mark, parsed)


def _long_arrays(raw: bytes) -> list[tuple[int, int]]:
    """(offset of "[", offset of "]") of each ids array at least SLICE long, in order."""
    spans = []
    for key in KEYS:
        at = raw.find(key)
        while at >= 0:
            m = AFTER_KEY.match(raw, at + len(key))
            if m is not None:
                start = m.end() - 1
                end = raw.find(b"]", start)
                if end - start > SLICE and not raw[start + 1:end].translate(None, NOT_IDS):
                    spans.append((start, end))
            at = raw.find(key, at + len(key))
    spans.sort()
    return spans


async def _ids(raw: bytes, start: int, stop: int) -> list[int]:
    """The ids in raw[start:stop], a slice at a time."""
    out: list[int] = []
    while start < stop:
        end = stop if stop - start <= SLICE else raw.rfind(b",", start, start + SLICE)
        if end <= start:                     # a slice without a comma: not ids as vLLM writes them
            end = stop
        piece = raw[start:end].strip(b", \t\r\n")
        if piece:
            out += json.loads(b"[" + piece + b"]")
        start = end + 1
        await asyncio.sleep(0)
    return out


def _put_back(value: Any, mark: str, arrays: list[list[int]]) -> Any:
    if isinstance(value, str):
        return arrays[int(value[len(mark):])] if value.startswith(mark) else value
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list, str)):
                value[k] = _put_back(v, mark, arrays)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (dict, list, str)):
                value[i] = _put_back(v, mark, arrays)
    return value
