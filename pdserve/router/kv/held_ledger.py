"""The held-KV bookkeeping, without I/O (held.py wires it to the router): D's KV capacity read from its
/metrics, the blocks each decode server holds for this router's entries (per tenant), the budget's victims
(fair shares between tenants) and the lease's due entries (conversations that came back, within the lease)."""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.identity import Key

CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def capacity_of(metrics_text: str) -> tuple[int | None, int | None]:
    """(KV capacity in tokens, block size) from a vLLM server's /metrics: `kv_cache_size_tokens` (vLLM's
    group-aware count) or num_gpu_blocks x block_size of its `vllm:cache_config_info`, added over engines."""
    capacity = 0
    block_size: int | None = None
    seen: set[str] = set()
    for labels in CACHE_INFO.findall(metrics_text or ""):
        info = dict(LABEL.findall(labels))
        engine = info.get("engine", "")
        if engine in seen:
            continue
        seen.add(engine)
        size = _int(info.get("block_size"))
        block_size = block_size or size
        tokens = _int(info.get("kv_cache_size_tokens"))
        blocks = _int(info.get("num_gpu_blocks"))
        if tokens:
            capacity += tokens
        elif blocks and size:
            capacity += blocks * size
    return (capacity or None), block_size


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None


def held_tokens(params: dict[str, Any], block_size: int | None) -> int:
    """The KV a turn's handles hold on D, in tokens: whole blocks when D's block size is known."""
    return _tokens(int(params.get("remote_num_tokens") or 0), _blocks(params), block_size)


def _blocks(params: dict[str, Any]) -> int | None:
    blocks = params.get("remote_block_ids") or []
    first = blocks[0] if blocks and isinstance(blocks[0], list) else blocks
    return len(first) if isinstance(first, list) and first else None


def _tokens(num_tokens: int, blocks: int | None, block_size: int | None) -> int:
    return blocks * block_size if blocks and block_size else num_tokens


@dataclass(eq=False)
class Held:
    """One finished turn's blocks on a decode server, as the router knows them."""
    request_id: str                     # D's remote_request_id (the control routes' id)
    decode: str
    tokens: int
    used: float                         # router clock: when the turn was stored (its last use)
    expires: float = math.inf           # router clock: the table's expiry (renewed by the lease)
    key: Key | None = None              # its key while in the table; None once a turn took it
    deadline: float | None = None       # D's clock: remote_blocks_expiry_time (as renewed)
    num_tokens: int = 0                 # remote_num_tokens
    blocks: int | None = None           # blocks of its first KV-cache group
    tenant: str = ""                    # its key's reuse scope (identity.reuse_scope): whose share it counts in
    continued: bool = False             # its conversation came back (a turn after its first): the lease keeps it

    @property
    def in_table(self) -> bool:
        return self.key is not None


@dataclass
class DecodeHeld:
    """What one decode server holds for this router, least recently used first."""
    name: str
    capacity: int | None = None         # KV capacity in tokens (learned from its /metrics)
    block_size: int | None = None
    control: bool | None = None         # it answers the control routes (None: not asked yet)
    engine: Any = None                  # engine id its entries came from
    tokens: int = 0
    entries: OrderedDict[str, Held] = field(default_factory=OrderedDict)
    tenants: dict[str, OrderedDict[str, Held]] = field(default_factory=dict)   # the same, per tenant (LRU first)
    tenant_tokens: dict[str, int] = field(default_factory=dict)

    def enter(self, held: Held) -> None:
        self.entries[held.request_id] = held
        self.tenants.setdefault(held.tenant, OrderedDict())[held.request_id] = held
        self.count(held, held.tokens)

    def leave(self, held: Held) -> bool:
        if self.entries.pop(held.request_id, None) is None:
            return False
        mine = self.tenants.get(held.tenant)
        if mine is not None:
            mine.pop(held.request_id, None)
        self.count(held, -held.tokens)
        if not self.tenant_tokens.get(held.tenant) and not mine:
            self.tenants.pop(held.tenant, None)
            self.tenant_tokens.pop(held.tenant, None)
        return True

    def count(self, held: Held, tokens: int) -> None:
        self.tokens += tokens
        self.tenant_tokens[held.tenant] = self.tenant_tokens.get(held.tenant, 0) + tokens


class Ledger:
    """The policy, without I/O: held tokens per decode server, the budget's victims, the lease's due entries."""

    def __init__(self, share: float, lease: float, clock: Callable[[], float] = time.monotonic):
        self.share = share
        self.lease = lease
        self.clock = clock
        self.decodes: dict[str, DecodeHeld] = {}
        self.by_id: dict[str, Held] = {}

    def decode(self, name: str) -> DecodeHeld:
        d = self.decodes.get(name)
        if d is None:
            d = self.decodes[name] = DecodeHeld(name)
        return d

    def budget(self, name: str) -> int | None:
        """Tokens the router's entries may hold on this D; None when not enforced (capacity not known yet,
        no share, or D cannot release)."""
        d = self.decode(name)
        if not d.capacity or self.share <= 0 or d.control is False:
            return None
        return int(d.capacity * self.share)

    def add(self, key: Key | None, params: dict[str, Any], decode: str, expires: float = math.inf,
            continued: bool = False) -> Held | None:
        rid = params.get("remote_request_id")
        if not isinstance(rid, str) or not rid:
            return None
        self.remove(rid)
        d = self.decode(decode)
        deadline = params.get("remote_blocks_expiry_time")
        held = Held(rid, decode, held_tokens(params, d.block_size), self.clock(), expires, key,
                    float(deadline) if isinstance(deadline, int | float) else None,
                    int(params.get("remote_num_tokens") or 0), _blocks(params),
                    key[0] if key is not None else "", continued)
        d.enter(held)
        self.by_id[rid] = held
        return held

    def learned(self, name: str, capacity: int, block_size: int | None) -> None:
        """D's capacity and block size: what its entries hold is counted again in whole blocks."""
        d = self.decode(name)
        d.capacity, d.block_size = capacity, block_size
        for held in d.entries.values():
            d.count(held, -held.tokens)
            held.tokens = _tokens(held.num_tokens, held.blocks, block_size)
            d.count(held, held.tokens)

    def remove(self, request_id: str) -> Held | None:
        held = self.by_id.pop(request_id, None)
        if held is not None:
            self.decode(held.decode).leave(held)
        return held

    def take(self, request_id: str) -> Held | None:
        """A turn took the entry: out of the table (never a victim, never renewed), still held on D."""
        held = self.by_id.get(request_id)
        if held is not None:
            held.key = None
        return held

    def forget_decode(self, name: str) -> list[Held]:
        d = self.decode(name)
        gone = list(d.entries.values())
        for held in gone:
            self.by_id.pop(held.request_id, None)
        d.entries.clear()
        d.tenants.clear()
        d.tenant_tokens.clear()
        d.tokens = 0
        return gone

    def restarted(self, name: str) -> None:
        """A new engine on this server: what the ledger knew of it is gone, its capacity asked again."""
        self.forget_decode(name)
        d = self.decode(name)
        d.capacity = d.block_size = d.control = None

    def over_budget(self, name: str) -> list[Held]:
        """The entries to release so that D's held tokens fit its budget, removed from the ledger. Fair shares:
        each victim is the least recently used entry in the table of the tenant holding the most (so over its
        equal share of the budget, budget / tenants holding anything on this D); a tenant at or under its share
        is never a victim, whoever's turn crossed the budget. One tenant alone is plain LRU (the newest last: a
        turn larger than the whole budget goes too). Entries taken for a turn count but are never victims: D's
        held tokens can pass the budget by turns in flight only."""
        budget = self.budget(name)
        d = self.decode(name)
        victims: list[Held] = []
        while budget is not None and d.tokens > budget:
            held = self._victim(d, budget / len(d.tenant_tokens))
            if held is None:
                break
            victims.append(held)
            self.remove(held.request_id)
        return victims

    @staticmethod
    def _victim(d: DecodeHeld, share: float) -> Held | None:
        for tenant in sorted(d.tenant_tokens, key=d.tenant_tokens.__getitem__, reverse=True):
            if d.tenant_tokens[tenant] <= share:
                return None         # this one and every one after it are within their share
            for held in d.tenants.get(tenant, {}).values():
                if held.in_table:
                    return held
        return None

    def under_budget(self, name: str) -> bool:
        budget = self.budget(name)
        return budget is not None and self.decode(name).tokens <= budget

    def due(self, lead: float, span: float = 0.0) -> list[Held]:
        """Entries to renew now: in the table, the router's expiry within `lead`, their conversation came back
        (`continued`: a one-turn conversation goes at the router's expiry, reuse_ttl), and renewing them (for
        `span` more seconds in the table) keeps them no longer than `lease` after their last use; their D able
        to renew and under its budget (pressure wins over leases)."""
        if self.lease <= 0:
            return []
        now = self.clock()
        out = []
        for d in self.decodes.values():
            if d.control is not True or not self.under_budget(d.name):
                continue
            out += [h for h in d.entries.values() if h.in_table and h.continued and h.deadline is not None
                    and h.expires - now <= lead and now + span - h.used < self.lease]
        return out


class Tombstones:
    """Keys whose entry the budget released, the newest `limit` of them: the next turn of such a conversation
    is told why it missed (`released`), once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.keys: OrderedDict[Key, None] = OrderedDict()

    def add(self, key: Key) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.limit:
            self.keys.popitem(last=False)

    def discard(self, key: Key) -> None:
        self.keys.pop(key, None)

    def claim(self, keys: list[Key]) -> bool:
        """One of `keys` had its entry released (said once: it is forgotten then)."""
        for key in keys if self.keys else ():
            if key in self.keys:
                del self.keys[key]
                return True
        return False
