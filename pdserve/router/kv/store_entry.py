"""A reuse entry as a shared store keeps it (store_redis.py), and the schema it must meet to be read back.

The value: the holder's name, a newline, a JSON header (D's kv_transfer_params, and whether token ids follow),
a newline, and D's token ids as 4-byte little-endian ints (~4 bytes a token, against ~6 as JSON numbers).

What a shared store holds is not trusted (issue 35, item 9): anything that can write to the Redis can put any
bytes under any key. An entry is read back only if every field the router reads or hands on has its type
(`readable`); one that does not is refused on its own, a miss with reason `invalid_entry`: never an error of
the store (which would serve every client without it), never a request failed on a wrong type. What the
schema cannot judge is the values' truth: a writer of the Redis can still offer P handles to blocks of its
choosing (that is what the store is for), so the Redis must be one only the cluster's routers write
(the managed one has a password: plan/routers.py).
"""

from __future__ import annotations

import json
import logging
import sys
from array import array
from typing import Any

from pdserve.router.kv.reuse import ReuseEntry

log = logging.getLogger("pdserve.router")

INVALID = "invalid_entry"     # the miss reason of a take that found an entry it refused
ROUTER_KEYS = "pdserve_"      # the router's own kv_transfer_params keys (wire.py): never taken from a store
# The fields of D's kv_transfer_params that the router reads or hands to P, with their types. `remote_block_ids`
# is required (an entry is stored only with it) and checked apart: ints, or one list of ints per KV-cache group.
COUNTS = ("remote_num_tokens", "remote_port", "tp_size")         # ints >= 0 (a bool is no count)
TEXTS = ("remote_request_id", "remote_host")
FLAGS = ("do_remote_decode", "do_remote_prefill")


def encode(params: dict[str, Any], decode: str, sequence: list[int] | None) -> bytes:
    tokens = b""
    if sequence is not None:
        try:
            packed = array("i", sequence)
            if sys.byteorder == "big":
                packed.byteswap()
            tokens = packed.tobytes()
        except (TypeError, OverflowError):
            sequence = None    # not token ids: stored without, nothing will be verified against it
    header = json.dumps({"p": params, "s": sequence is not None}, separators=(",", ":"))
    return decode.encode() + b"\n" + header.encode() + b"\n" + tokens


def decode_entry(value: bytes) -> ReuseEntry | None:
    """The entry, or None (logged) for a value that is not one: not this format, or a field of another type."""
    decode, _, rest = value.partition(b"\n")      # the holder; decode names have no newline (the schema's)
    header, _, tokens = rest.partition(b"\n")     # JSON escapes newlines: the first one ends the header
    try:
        holder = decode.decode()
        meta = json.loads(header, parse_constant=_no_constant)
        if not (holder.isprintable() and holder and isinstance(meta, dict) and isinstance(meta.get("s"), bool)
                and readable(meta.get("p"))):
            raise ValueError("a field of another type")
        params = meta["p"]
        if any(name.startswith(ROUTER_KEYS) for name in params):     # only the router sets them, per turn
            params = {name: v for name, v in params.items() if not name.startswith(ROUTER_KEYS)}
        sequence = None
        if meta["s"]:
            sequence = array("i")
            sequence.frombytes(tokens)                # ValueError unless whole 4-byte ids
            if sys.byteorder == "big":
                sequence.byteswap()
        # generation None: replicas count a backend's restarts each their own way; the engine id check and
        # drop_decode (both shared) stand for it.
        return ReuseEntry(params, holder, None, float("inf"), sequence, len(value))
    except (ValueError, TypeError) as err:            # UnicodeDecodeError and JSON's errors are ValueErrors
        log.warning("a reuse entry in Redis is not one (%s): refused", err)
        return None


def readable(params: Any) -> bool:
    """D's kv_transfer_params as the router reads them: a dict, every field it reads of its type."""
    if not isinstance(params, dict) or not _blocks(params.get("remote_block_ids")):
        return False
    for name, v in params.items():
        if name in COUNTS and not _count(v):
            return False
        if name in TEXTS and not isinstance(v, str):
            return False
        if name in FLAGS and not isinstance(v, bool):
            return False
    engine = params.get("remote_engine_id")
    if engine is not None and not (isinstance(engine, str) or _count(engine)):
        return False
    expiry = params.get("remote_blocks_expiry_time")
    return expiry is None or (isinstance(expiry, (int, float)) and not isinstance(expiry, bool))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")    # NaN, Infinity: Python's json reads them, P's would not


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _blocks(blocks: Any) -> bool:
    """A non-empty list of block ids, flat (older vLLM) or one list per KV-cache group."""
    if not isinstance(blocks, list) or not blocks:
        return False
    if isinstance(blocks[0], list):
        return all(isinstance(g, list) and all(_count(b) for b in g) for g in blocks)
    return all(_count(b) for b in blocks)
