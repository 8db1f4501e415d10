"""JSON on the router's hot path: orjson where it gives what the standard library gives, `json` elsewhere.

A whole answer is parsed and encoded three times a turn (the client's body, P's and D's answers; P's and D's
bodies, the client's answer): with `json` that was ~10% of the router's CPU per request. orjson parses and
encodes the same values several times faster; where it would differ it is not used:
- parsing: orjson refuses what `json` takes (NaN, Infinity, numbers out of a double's range, lone surrogate
  escapes, a BOM, UTF-16/32), so those go to `json` as before; and it reads integers past 64 bits as floats,
  so a body with a run of 19 digits goes to `json` (a digit run in a string costs only the slower parse).
- encoding: orjson writes NaN and infinities as null, so the values `json` made of them (the only place they
  come from) are marked (`_Nonfinite`) and orjson refuses them; it refuses integers past 64 bits, lone
  surrogates and keys that are not strings, and with the passthrough options every type `json` would not
  encode as orjson does (subclasses, dataclasses, datetimes): all of those are encoded by `json`, as before.
The bytes differ only in form: compact separators and UTF-8 where `json.dumps` wrote ", ", ": " and \\u escapes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

# An integer orjson might read as a float (past 64 bits) has a run of 19 digits: found by mapping every digit
# to 0 and looking for 19 zeros, both C loops (re's \d{19} retried at every digit: 9 ms on a 250 KB answer of
# 37k token ids, a third of the router's CPU on a 36k-token turn, against 0.5 ms).
DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
NINETEEN_DIGITS = b"0" * 19
DecodeError = (ValueError, RecursionError)  # what either parser raises on a bad body (JSONDecodeError is one)
_PASS = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


class _Nonfinite(float):
    """NaN or an infinity as `json` parsed it: orjson would write null, `json` writes it back as it came."""


def _float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _Nonfinite(value)


def loads(raw: bytes | str) -> Any:
    """json.loads(raw), faster where orjson reads the same values."""
    if not long_digit_run(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass                                          # json decides: it takes more, or raises as before
    return json.loads(raw, parse_float=_float, parse_constant=_Nonfinite)


def long_digit_run(raw: bytes) -> bool:
    """raw holds 19 or more digits in a row."""
    return NINETEEN_DIGITS in raw.translate(DIGITS_AS_ZERO)


def dumps(value: Any) -> bytes:
    """The JSON of value (as json.dumps(value).encode() reads), faster where orjson writes the same."""
    try:
        return orjson.dumps(value, option=_PASS)
    except TypeError:                                     # orjson.JSONEncodeError is one
        return json.dumps(value).encode()
