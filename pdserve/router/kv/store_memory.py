"""The embedded reuse store: entries in this router process's memory (the default, `router.store: memory`).

Entries are single-use (P's read releases D's blocks) and expire on the router's own monotonic clock,
safely before D's decoder_kv_blocks_ttl: D's `remote_blocks_expiry_time` is a perf_counter value of D's
process and is never compared with anything here. A drained router writes them to a file the next one reads
back (store_file.py); a killed one loses them (a shared store does not).

"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.router.kv.reuse import NO_ENTRY, ReuseEntry
from pdserve.router.kv.store import kept
from pdserve.router.wire import id_array

ENTRY_OVERHEAD_BYTES = 1024   # the entry, its keys and D's params dict, roughly


class TableWatcher(Protocol):
    """Told of every entry that enters the table and every one that leaves it without being taken for a turn
    (held.py: D's blocks behind it are then released). Reasons: replaced, capacity, expired, restart."""

    def put(self, key: tuple[str, str], entry: ReuseEntry) -> None: ...

    def dropped(self, key: tuple[str, str], entry: ReuseEntry, reason: str) -> None: ...


class MemoryTable:
    """Entries in insertion order, which is also expiry order (one TTL, a monotonic clock, and `put`
    re-inserts; a renewed entry is re-inserted with the new expiry, held.py's lease) and
    least-recently-used order (an entry is used once, by `take`, which removes it).
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
        self._aliases: dict[tuple[str, str], tuple[str, str]] = {}     # prompt key -> its entry's key
        self.watcher: TableWatcher | None = None                        # held.py's ledger, when it is on

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[tuple[tuple[str, str], ReuseEntry]]:
        """Every entry, in the table's order (store_file.py writes them on a drained stop)."""
        return list(self._entries.items())

    def put(self, key: tuple[str, str], params: dict[str, Any], decode: str, generation: int,
            sequence: list[int] | None = None, alias: tuple[str, str] | None = None,
            expires: float | None = None, continued: bool = False) -> ReuseEntry:
        """Store D's handles under `key`, and `alias` (the prompt's key) pointing at it: one entry, taken once
        by either. A new engine id from the same decode server means it restarted (perhaps between two health
        probes): handles from its previous engine are dropped. `expires`: an entry read back from a drained
        router's file keeps its own (store_file.py); else now + ttl."""

        self.purge_expired()
        engine = params.get("remote_engine_id")
        if decode in self._engine and self._engine[decode] != engine:
            self.drop_decode(decode)
        self._engine[decode] = engine
        self._dropped(key, self._remove(key), "replaced")
        entry = ReuseEntry(params, decode, generation, self.clock() + self.ttl if expires is None else expires,
                           _compact(sequence), alias=alias, continued=continued)

        entry.size = _entry_bytes(entry)
        self._entries[key] = entry
        if alias is not None:
            self._aliases[alias] = key    # a newer answer to the same prompt: the prompt finds the newer
        self._by_decode.setdefault(decode, {})[key] = None
        self.bytes += entry.size
        if self.watcher is not None:
            self.watcher.put(key, entry)
        evicted = 0
        while self._entries and (len(self._entries) > self.max_entries or self.bytes > self.max_bytes):
            first = next(iter(self._entries))
            self._dropped(first, self._remove(first), "capacity")
            evicted += 1
        if evicted:
            self.on_evict("capacity", evicted)
        return entry

    def _remove(self, key: tuple[str, str]) -> ReuseEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
            if entry.alias is not None and self._aliases.get(entry.alias) == key:
                del self._aliases[entry.alias]
            keys = self._by_decode.get(entry.decode)
            if keys is not None:
                keys.pop(key, None)
        return entry

    def _dropped(self, key: tuple[str, str], entry: ReuseEntry | None, reason: str) -> None:
        if entry is not None and self.watcher is not None:
            self.watcher.dropped(key, entry, reason)

    def take(self, key: tuple[str, str]) -> tuple[ReuseEntry | None, str]:
        """Remove and return the entry (single use: two concurrent turns can't both get it)."""
        entry = self._remove(key)
        if entry is None:
            return None, NO_ENTRY
        if self.clock() >= entry.expires:
            self._dropped(key, entry, "expired")
            return None, "expired"
        return entry, "ok"

    def withdraw(self, key: tuple[str, str], request_id: str) -> ReuseEntry | None:
        """Take out the entry under `key` if it is still D's request `request_id` (held.py's release: the
        entry must leave the table before its blocks are freed, so no turn can hand it to P after)."""
        entry = self._entries.get(key)
        if entry is None or entry.params.get("remote_request_id") != request_id:
            return None
        return self._remove(key)

    def renewed(self, key: tuple[str, str], request_id: str, deadline: float, expires: float) -> bool:
        """D renewed the entry's blocks (held.py's lease): hand P the new deadline from now on, and keep the
        entry until `expires`. False when the entry under `key` is no longer that request's."""
        entry = self._entries.get(key)
        if entry is None or entry.params.get("remote_request_id") != request_id:
            return False
        # A new dict: a turn that took the entry before holds its own copy of the params.
        entry.params = {**entry.params, "remote_blocks_expiry_time": deadline}
        entry.expires = expires
        self._entries.move_to_end(key)      # insertion order stays (about) expiry order
        return True

    def continued(self, key: tuple[str, str] | None, request_id: str) -> None:
        """The entry's conversation came back (held.py's lease keeps only those; store_file.py writes it)."""
        entry = self._entries.get(key) if key is not None else None
        if entry is not None and entry.params.get("remote_request_id") == request_id:
            entry.continued = True

    def take_first(self, keys: list[tuple[str, str]]) -> tuple[ReuseEntry | None, str]:
        """`take` the first of `keys` that has an entry, directly or as its alias (candidate histories,
        longest first)."""
        for key in keys:
            if key in self._entries:
                return self.take(key)
            if key in self._aliases:
                entry, why = self.take(self._aliases[key])
                if entry is not None:
                    entry.by_prompt = True
                return entry, why
        return None, NO_ENTRY

    def drop_decode(self, decode: str) -> int:
        keys = list(self._by_decode.pop(decode, {}))
        for k in keys:
            self._dropped(k, self._remove(k), "restart")
        return len(keys)

    def purge_expired(self) -> int:
        now, old = self.clock(), 0
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now < entry.expires:
                break
            self._dropped(key, self._remove(key), "expired")
            old += 1
        if old:
            self.on_evict("expired", old)
        return old


def _compact(sequence: list[int] | None) -> array | None:
    """Token ids as 4-byte unsigned ints (wire.id_array): a list of Python ints costs ~36 bytes a token, and
    an offer packs them as these (wire.pack_ids) at a copy's cost instead of id by id."""
    if sequence is None:
        return None
    try:
        return id_array(sequence)
    except (TypeError, OverflowError):
        return None   # not token ids: nothing can be verified against it


def _entry_bytes(entry: ReuseEntry) -> int:
    """An estimate of the memory an entry holds: the token ids, the block ids, and fixed overhead."""
    blocks = entry.params.get("remote_block_ids") or []
    n_blocks = sum(len(g) if isinstance(g, list) else 1 for g in blocks) if isinstance(blocks, list) else 0
    ids = entry.sequence.itemsize * len(entry.sequence) if entry.sequence is not None else 0
    return ENTRY_OVERHEAD_BYTES + 40 * n_blocks + ids




class MemoryStore:
    """MemoryTable behind the store contract (store.py). Never unavailable: nothing to guard."""

    remote = False

    def __init__(self, ttl: float, max_entries: int, max_bytes: int, on_evict: Callable[[str, int], None],
                 clock: Callable[[], float] = time.monotonic):
        self.table = MemoryTable(ttl, clock, max_entries, max_bytes, on_evict)

    def __len__(self) -> int:
        return len(self.table)

    @property
    def bytes(self) -> int:
        return self.table.bytes

    async def put(self, key: tuple[str, str], params: dict[str, Any], decode: str, generation: int,
                  sequence: list[int] | None = None, alias: tuple[str, str] | None = None) -> asyncio.Future[bool]:
        self.table.put(key, params, decode, generation, sequence, alias)
        return kept(True)

    async def take_first(self, keys: list[tuple[str, str]]) -> tuple[ReuseEntry | None, str]:
        return self.table.take_first(keys)

    async def drop_decode(self, decode: str) -> int:
        return self.table.drop_decode(decode)

    async def refresh(self) -> None:
        """The periodic chore: expired entries leave an idle router on time."""
        self.table.purge_expired()

    async def close(self) -> None:
        pass
