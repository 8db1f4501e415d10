"""Per-conversation memory of D's finished-turn KV blocks, and the decision to offer them to P.

Entries are single-use (P's read releases D's blocks) and expire on the router's own monotonic clock,
safely before D's decoder_kv_blocks_ttl: D's `remote_blocks_expiry_time` is a perf_counter value of D's
process and is never compared with anything here.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

HIT = "hit"
MISS = "miss"
ENTRY_OVERHEAD_BYTES = 1024   # the entry, its key and D's params dict, roughly


@dataclass
class ReuseEntry:
    params: dict[str, Any]               # D's kv_transfer_params from the previous turn
    decode: str                          # the decode backend holding the blocks
    generation: int                      # that backend's generation when the entry was made
    expires: float                       # router clock (monotonic seconds)
    sequence: Sequence[int] | None = None   # D's prompt + generated token ids, when the backend returned them
    size: int = 0                        # estimated bytes held (for the store's byte bound)

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
    prompt_tokens: int | None = None     # the new prompt's length, when it was tokenized for the decision


class ReuseStore:
    """Entries in insertion order, which is also expiry order (one TTL, a monotonic clock, and `put`
    re-inserts) and least-recently-used order (an entry is used once, by `take`, which removes it).
    So expiry and the size bounds both evict from the front, and every operation is O(1) amortized;
    a per-decode-server index makes a restarted server's handles cheap to drop."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic, max_entries: int = 100_000,
                 max_bytes: int = 256 * 1024 * 1024,
                 on_evict: Callable[[str, int], None] | None = None):
        self.ttl = ttl
        self.clock = clock
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.on_evict = on_evict or (lambda reason, n: None)
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], ReuseEntry] = OrderedDict()
        self._by_decode: dict[str, dict[tuple[str, str], None]] = {}   # decode -> its keys (an ordered set)
        self._engine: dict[str, Any] = {}                               # decode -> engine id of its entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: tuple[str, str], params: dict[str, Any], decode: str, generation: int,
            sequence: list[int] | None = None) -> ReuseEntry:
        """Store D's handles. A new engine id from the same decode server means it restarted (perhaps
        between two health probes): handles from its previous engine are dropped."""
        self.purge_expired()
        engine = params.get("remote_engine_id")
        if decode in self._engine and self._engine[decode] != engine:
            self.drop_decode(decode)
        self._engine[decode] = engine
        self._remove(key)
        entry = ReuseEntry(params, decode, generation, self.clock() + self.ttl, _compact(sequence))
        entry.size = _entry_bytes(entry)
        self._entries[key] = entry
        self._by_decode.setdefault(decode, {})[key] = None
        self.bytes += entry.size
        evicted = 0
        while self._entries and (len(self._entries) > self.max_entries or self.bytes > self.max_bytes):
            self._remove(next(iter(self._entries)))
            evicted += 1
        if evicted:
            self.on_evict("capacity", evicted)
        return entry

    def _remove(self, key: tuple[str, str]) -> ReuseEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
            keys = self._by_decode.get(entry.decode)
            if keys is not None:
                keys.pop(key, None)
        return entry

    def take(self, key: tuple[str, str]) -> tuple[ReuseEntry | None, str]:
        """Remove and return the entry (single use: two concurrent turns can't both get it)."""
        entry = self._remove(key)
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
        keys = list(self._by_decode.pop(decode, {}))
        for k in keys:
            self._remove(k)
        return len(keys)

    def purge_expired(self) -> int:
        now, old = self.clock(), 0
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now < entry.expires:
                break
            self._remove(key)
            old += 1
        if old:
            self.on_evict("expired", old)
        return old


def _compact(sequence: list[int] | None) -> array | None:
    """Token ids as 8-byte machine ints: a list of Python ints costs ~36 bytes a token."""
    if sequence is None:
        return None
    try:
        return array("q", sequence)
    except (TypeError, OverflowError):
        return None   # not token ids: nothing can be verified against it


def _entry_bytes(entry: ReuseEntry) -> int:
    """An estimate of the memory an entry holds: the token ids, the block ids, and fixed overhead."""
    blocks = entry.params.get("remote_block_ids") or []
    n_blocks = sum(len(g) if isinstance(g, list) else 1 for g in blocks) if isinstance(blocks, list) else 0
    return ENTRY_OVERHEAD_BYTES + 40 * n_blocks + (8 * len(entry.sequence) if entry.sequence is not None else 0)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def decide(entry: ReuseEntry, *, holder_healthy: bool, holder_generation: int, threshold: int,
           new_prompt: list[int] | None, block_size: int | None) -> Decision:
    """Whether (and how much of) D's blocks P may read for the new prompt.

    P reads D's blocks by position and never checks the tokens, so only the common token prefix of D's
    sequence (its prompt + generated tokens) and the new prompt is valid KV. A partial match is cut at the
    first differing token: P reads the blocks that hold the common prefix (vLLM's pull reads
    cdiv(remote_num_tokens, block_size) blocks) and computes from there, overwriting the rest of the last
    block, as it does with D's own unaligned counts. Anything that cannot be verified is not offered.
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
        if not block_size or common < block_size:   # at most a template header in common: an edited history
            return Decision(MISS, "not_a_continuation")
        params["remote_block_ids"] = _trim_blocks(params.get("remote_block_ids") or [], -(-common // block_size))
        params["remote_num_tokens"] = offered = common
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
