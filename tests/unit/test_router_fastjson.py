"""router/fastjson.py: the values json gives, parsing and encoding, on the inputs where orjson would differ."""

import json
import math
from dataclasses import dataclass

import pytest

from pdserve.router import fastjson

ODD_INPUTS = [
    b'{"temperature": NaN, "top_p": Infinity, "x": -Infinity}',     # json takes them, orjson does not
    b'{"seed": 123456789012345678901234567890}',                      # past 64 bits: orjson reads a float
    b'{"n": 18446744073709551615, "m": -9223372036854775809}',
    b'{"big": 1e400, "small": -1e400}',                                # out of a double's range: inf
    b'{"text": "\\ud800 lone"}',                                      # a lone surrogate escape
    b'\xef\xbb\xbf{"bom": 1}',
    '{"utf16": "\u00e9"}'.encode("utf-16"),
    b'{"a": 1, "a": 2, "t\\u00e9": [true, false, null, 0.1, -0.0, 1E2]}',
]


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b if not isinstance(a, float) else a == b


@pytest.mark.parametrize("raw", ODD_INPUTS)
def test_parses_what_json_parses_and_encodes_it_back_as_json_does(raw):
    want, got = json.loads(raw), fastjson.loads(raw)
    assert same(want, got)
    # encoded back: the same values (NaN as NaN, never null; big integers exact), json's text of them alike
    assert json.dumps(json.loads(fastjson.dumps(got))) == json.dumps(want)


def test_bad_bodies_raise_what_json_raised():
    for raw in (b"", b"{", b'{"a": }', b"\xff\xfe\x00", b"[" * 100_000):
        with pytest.raises((ValueError, RecursionError)) as want:
            json.loads(raw)
        with pytest.raises(want.type):
            fastjson.loads(raw)


@dataclass
class Point:
    x: int


def test_encodes_the_values_json_encodes_and_refuses_what_json_refuses():
    for value in ({"a": [1, 2.5, None, True, "t\u00e9\U0001f600", -0.0, 1e-7, 1e16], "b": {"c": ""}},
                  {1: "int key"}, {"big": 2 ** 70}, {"lone": "\ud800"}, [(1, 2)],
                  fastjson.loads(b'{"nan": NaN, "inf": -Infinity, "big": 1e999}')):
        assert json.dumps(json.loads(fastjson.dumps(value))) == json.dumps(value)
    # NaN reaches the router only in a body it parsed: written back as json wrote it, never as orjson's null
    assert fastjson.dumps(fastjson.loads(b'{"nan": NaN}')) == b'{"nan": NaN}'
    for refused in ({"s": {1, 2}}, {"p": Point(1)}):                    # json refused them: so does this
        with pytest.raises(TypeError):
            fastjson.dumps(refused)


def test_a_run_of_19_digits_is_found_wherever_it_is_and_nothing_shorter():
    import random
    import re
    rng = random.Random(7)
    regex = re.compile(rb"\d{19}")                    # what the check meant, at any byte string
    cases = [b"1" * 18, b"1" * 19, b"0" * 19, b"x" + b"9" * 19 + b"x", b"123456789012345678,9",
             b"[" + b",".join(b"%d" % i for i in range(10 ** 17, 10 ** 17 + 50)) + b"]", b"\xd9\xa0" * 20]
    cases += [bytes(rng.choice(b"0123456789,0x ") for _ in range(rng.randrange(1, 80))) for _ in range(3000)]
    for raw in cases:
        assert fastjson.long_digit_run(raw) == bool(regex.search(raw)), raw


def test_a_long_integer_in_ids_still_parses_as_json_does():
    raw = b'{"prompt_token_ids": [' + b",".join(b"%d" % i for i in range(5000)) + b', 123456789012345678901]}'
    assert fastjson.loads(raw) == json.loads(raw)
    assert fastjson.loads(raw)["prompt_token_ids"][-1] == 123456789012345678901
