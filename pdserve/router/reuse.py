"""Per-conversation memory of D's finished-turn KV blocks, and the decision to offer them to P.

Entries are single-use (P's read releases D's blocks) and expire on the router's own monotonic clock,
safely before D's decoder_kv_blocks_ttl: D's `remote_blocks_expiry_time` is a perf_counter value of D's
process and is never compared with anything here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HIT = "hit"
MISS = "miss"


@dataclass
class ReuseEntry:
    params: dict[str, Any]               # D's kv_transfer_params from the previous turn
    decode: str                          # the decode backend holding the blocks
    generation: int                      # that backend's generation when the entry was made
    expires: float                       # router clock (monotonic seconds)
    sequence: list[int] | None = None    # D's prompt + generated token ids, when the backend returned them

    @property
    def num_tokens(self) -> int:
        return int(self.params.get("remote_num_tokens") or 0)


@dataclass(frozen=True)
class Decision:
    result: str                          # hit | miss
    reason: str                          # why (for hits: "continuation" or "trimmed")
    params: dict[str, Any] | None = None
    tokens: int = 0
    holder: str | None = None            # decode server that held the blocks (its prefix cache is warm)


class ReuseStore:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._entries: dict[tuple[str, str], ReuseEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: tuple[str, str], params: dict[str, Any], decode: str, generation: int,
            sequence: list[int] | None = None) -> ReuseEntry:
        """Store D's handles. A new engine id from the same decode server means it restarted (perhaps
        between two health probes): handles from its previous engine are dropped."""
        engine = params.get("remote_engine_id")
        stale = [k for k, e in self._entries.items()
                 if e.decode == decode and e.params.get("remote_engine_id") != engine]
        for k in stale:
            del self._entries[k]
        entry = ReuseEntry(params, decode, generation, self.clock() + self.ttl, sequence)
        self._entries[key] = entry
        return entry

    def take(self, key: tuple[str, str]) -> tuple[ReuseEntry | None, str]:
        """Remove and return the entry (single use: two concurrent turns can't both get it)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None, "no_entry"
        if self.clock() >= entry.expires:
            return None, "expired"
        return entry, "ok"

    def take_first(self, keys: list[tuple[str, str]]) -> tuple[ReuseEntry | None, str]:
        """`take` the first of `keys` that has an entry (candidate histories, longest first)."""
        for key in keys:
            if key in self._entries:
                return self.take(key)
        return None, "no_entry"

    def drop_decode(self, decode: str) -> int:
        stale = [k for k, e in self._entries.items() if e.decode == decode]
        for k in stale:
            del self._entries[k]
        return len(stale)

    def purge_expired(self) -> int:
        now = self.clock()
        old = [k for k, e in self._entries.items() if now >= e.expires]
        for k in old:
            del self._entries[k]
        return len(old)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def decide(entry: ReuseEntry, *, holder_healthy: bool, holder_generation: int, threshold: int,
           new_prompt: list[int] | None, block_size: int | None) -> Decision:
    """Whether (and how much of) D's blocks P may read for the new prompt.

    P reads D's blocks by position and never checks the tokens, so only the common token prefix of D's
    sequence (its prompt + generated tokens) and the new prompt is valid KV. A partial match is trimmed
    to whole blocks; anything that cannot be verified is not offered.
    """
    if not holder_healthy or holder_generation != entry.generation:
        return Decision(MISS, "holder_unhealthy")
    if entry.sequence is None or new_prompt is None:
        return Decision(MISS, "unverifiable")
    params = dict(entry.params)
    offered = entry.num_tokens
    # P must compute at least the last prompt token itself to produce logits.
    common = min(common_prefix_len(entry.sequence[:offered], new_prompt), len(new_prompt) - 1)
    reason = "continuation"
    if common < offered:
        usable = (common // block_size) * block_size if block_size else 0
        if usable == 0:
            return Decision(MISS, "not_a_continuation")
        params["remote_block_ids"] = _trim_blocks(params.get("remote_block_ids") or [], usable // block_size)
        params["remote_num_tokens"] = offered = usable
        reason = "trimmed"
    if offered < max(1, threshold):
        return Decision(MISS, "below_threshold")
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    return Decision(HIT, reason, params, offered)


def _trim_blocks(blocks: Any, keep: int) -> Any:
    # One list per KV-cache group (a flat list in older vLLM); P maps D's blocks from the front, so
    # cutting remote_num_tokens without cutting every group would make P read the wrong blocks.
    if blocks and isinstance(blocks[0], list):
        return [group[:keep] for group in blocks]
    return list(blocks)[:keep]
