"""Held KV on the decode servers (issue 32): the blocks each decode server (D) keeps for the router's
conversations, bounded by a budget, released as soon as the router no longer needs them, and renewed (a lease)
for conversations that come back after D's timer.

With `bidirectional_kv_xfer`, D keeps every finished turn's KV blocks `decoder_kv_blocks_ttl` seconds so that
P can read them on the next turn; only P's read (single use) or the timer frees them, and held blocks cannot be
evicted or preempted. Once the conversations a D holds fill its KV cache, every new turn waits for a timer.
D's control routes (pdserve/engine/held.py, installed by pdserve's entry: `GET /pdserve/held`, `POST
/pdserve/held/release` and `/renew`, by D's `remote_request_id`) free and renew blocks on demand; this module
decides when:

- **Budget.** Per D, the tokens held by the entries this router stored stay under `held_kv_share` of D's KV
  capacity (its `vllm:cache_config_info`). A stored turn that crosses it releases that D's least recently used
  entries (`lru`); their conversations' next turns recompute (miss reason `released`).
- **At once, what the router no longer needs:** an entry replaced by a newer one under the same key
  (`replaced`), evicted from the table by its size bounds (`evicted`) or its TTL (`expired`), taken for a turn
  that did not pull it (`unused`: a miss, or a turn served on D alone), and the handles of a turn the router
  keeps no entry for (`untracked`: no conversation identity).
- **Lease.** Entries still in the table are renewed on D (`ttl` decoder_kv_blocks_ttl) before the router's own
  expiry while their D is under budget and they were used less than `held_kv_lease` ago; the renewed deadline
  (D's clock) replaces `remote_blocks_expiry_time` in the stored params (P declines a read within 5 s of the
  deadline it is handed) and the entry's expiry in the table follows it.

Safety: P can read an entry it was handed until D frees it, so nothing handed to P is released under it. An LRU
victim leaves the table before its release is sent (no turn can take it after); an entry a turn took is
released when that turn's P leg is over (P answered: its read is done, grace 0), or was never run (a turn on D
alone), else with P's read margin as grace (a read P may have started finishes first). D restarting (a new
engine id, or seen gone) drops its entries as before: nothing is released on a new engine.

Scope: the budget, the replaced/evicted/expired releases and the lease need the memory store (the ledger is
this router process's, and the table is where it withdraws and renews). With a shared store (Redis, several
replicas) an entry may be taken by another replica at any moment, so only what a turn of this replica took
itself (single use: no other replica can have it) and did not use, and handles never stored, are released;
the rest waits for D's timer, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from pdserve.router.identity import Key
from pdserve.router.policy import DECODE_ONLY
from pdserve.router.reuse import ReuseEntry

log = logging.getLogger("pdserve.router")

# Why the router released held blocks (pdserve_router_held_kv_releases_total{reason}).
LRU = "lru"                # the budget: least recently used first
REPLACED = "replaced"      # a newer entry was stored under the same key
EVICTED = "evicted"        # the table's size bounds (reuse_max_entries, reuse_max_mb)
EXPIRED = "expired"        # the table's TTL (reuse_ttl, or the end of the lease)
UNUSED = "unused"          # taken for a turn that did not pull it (a miss, D alone, a failed P leg)
UNTRACKED = "untracked"    # a turn the router keeps no entry for (no conversation identity)
RELEASE_REASONS = (LRU, REPLACED, EVICTED, EXPIRED, UNUSED, UNTRACKED)
# MemoryTable's reasons for an entry that left it untaken -> the release's reason ("restart": none, D is new)
TABLE_REASONS = {"replaced": REPLACED, "capacity": EVICTED, "expired": EXPIRED}
RELEASED = "released"      # the miss reason of a turn whose entry the budget released

CONTROL = "/pdserve/held"
# P declines a read when its deadline is this close (vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN); a release of
# blocks P may be reading waits as long (pdserve/engine/held.py's default grace).
P_READ_MARGIN_S = 5.0
CALL_TIMEOUT_S = 35.0      # D's control call waits up to 30 s for its engine
MAX_IDS_PER_CALL = 1000
TOMBSTONES = 100_000       # keys whose entry the budget released, remembered for the miss reason
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

    def add(self, key: Key | None, params: dict[str, Any], decode: str, expires: float = math.inf) -> Held | None:
        rid = params.get("remote_request_id")
        if not isinstance(rid, str) or not rid:
            return None
        self.remove(rid)
        d = self.decode(decode)
        deadline = params.get("remote_blocks_expiry_time")
        held = Held(rid, decode, held_tokens(params, d.block_size), self.clock(), expires, key,
                    float(deadline) if isinstance(deadline, int | float) else None,
                    int(params.get("remote_num_tokens") or 0), _blocks(params))
        d.entries[rid] = held
        d.tokens += held.tokens
        self.by_id[rid] = held
        return held

    def learned(self, name: str, capacity: int, block_size: int | None) -> None:
        """D's capacity and block size: what its entries hold is counted again in whole blocks."""
        d = self.decode(name)
        d.capacity, d.block_size = capacity, block_size
        for held in d.entries.values():
            d.tokens -= held.tokens
            held.tokens = _tokens(held.num_tokens, held.blocks, block_size)
            d.tokens += held.tokens

    def remove(self, request_id: str) -> Held | None:
        held = self.by_id.pop(request_id, None)
        if held is not None:
            d = self.decode(held.decode)
            if d.entries.pop(request_id, None) is not None:
                d.tokens -= held.tokens
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
        d.tokens = 0
        return gone

    def over_budget(self, name: str) -> list[Held]:
        """The entries to release so that D's held tokens fit its budget: in the table, least recently used
        first (the newest last: a turn larger than the whole budget goes too). Removed from the ledger."""
        budget = self.budget(name)
        d = self.decode(name)
        if budget is None or d.tokens <= budget:
            return []
        victims = []
        for held in list(d.entries.values()):
            if d.tokens <= budget:
                break
            if held.in_table:
                victims.append(held)
                self.remove(held.request_id)
        return victims

    def under_budget(self, name: str) -> bool:
        budget = self.budget(name)
        return budget is not None and self.decode(name).tokens <= budget

    def due(self, lead: float) -> list[Held]:
        """Entries to renew now: in the table, the router's expiry within `lead`, used less than `lease` ago,
        their D able to renew and under its budget (pressure wins over leases)."""
        if self.lease <= 0:
            return []
        now = self.clock()
        out = []
        for d in self.decodes.values():
            if d.control is not True or not self.under_budget(d.name):
                continue
            out += [h for h in d.entries.values() if h.in_table and h.deadline is not None
                    and h.expires - now <= lead and now - h.used < self.lease]
        return out


class Control(Protocol):
    """D's control routes and /metrics (HTTP in the router; a fake in unit tests)."""

    async def call(self, decode: str, method: str, path: str, body: dict[str, Any] | None = None
                   ) -> tuple[int, Any]: ...


class HttpControl:
    """The control routes over the router's HTTP session, with the router's API key (D's routes check it)."""

    def __init__(self, session: aiohttp.ClientSession, urls: Callable[[str], str | None], auth: dict[str, str]):
        self.session = session
        self.urls = urls
        self.auth = auth
        self.timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)

    async def call(self, decode: str, method: str, path: str, body: dict[str, Any] | None = None
                   ) -> tuple[int, Any]:
        url = self.urls(decode)
        if url is None:
            return 0, None
        try:
            async with self.session.request(method, url + path, json=body, headers=self.auth,
                                            timeout=self.timeout) as resp:
                if path == "/metrics":
                    return resp.status, await resp.text()
                try:
                    return resp.status, await resp.json(content_type=None)
                except ValueError:
                    return resp.status, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return 0, None


class TurnFacts(Protocol):
    """What the hooks read of a turn (router/turn.py's Turn)."""
    request_id: str
    plan: str
    prefill_ms: float | None
    pulled: int | None


class HeldKV:
    """The ledger wired to the router: hooks for the flow and the memory table, calls to D, the metrics, and
    the background task (capacity, the lease)."""

    def __init__(self, cfg: Any, decodes: list[str], metrics: Any, control: Control,
                 clock: Callable[[], float] = time.monotonic):
        self.on = bool(cfg.held_kv and cfg.bidirectional_kv_xfer)
        self.cfg = cfg
        self.metrics = metrics
        self.control = control
        self.clock = clock
        self.ledger = Ledger(cfg.held_kv_share, cfg.held_kv_lease, clock)
        self.table: Any = None                 # the MemoryTable (budget and lease need it)
        self.turns: dict[str, Held] = {}       # turn request id -> the entry it took
        self.tombstones: OrderedDict[Key, None] = OrderedDict()
        self.tasks: set[asyncio.Task] = set()
        self.learning: dict[str, asyncio.Task] = {}
        self.said: set[tuple[str, str]] = set()   # (decode, what) said once in the log
        self.tick = min(5.0, max(0.2, cfg.reuse_ttl / 8))    # the lease's round
        self.lead = 3 * self.tick                              # renew this long before the router's expiry
        self.read_margin = P_READ_MARGIN_S
        for name in decodes:
            self.ledger.decode(name)
        if self.on:
            for reason in RELEASE_REASONS:
                metrics.held_releases.labels(reason)
            for name in decodes:
                metrics.held_tokens.labels(name).set(0)

    @property
    def margin(self) -> float:
        """The router keeps a renewed entry until this long before D's new deadline (as reuse_ttl does before
        D's first one), and at least P's read margin and a round: P declines reads that close to it."""
        return max(self.cfg.decoder_kv_blocks_ttl - self.cfg.reuse_ttl, self.read_margin + self.tick)

    # -- wiring --------------------------------------------------------------------------------------
    def attach(self, store: Any) -> bool:
        """Watch the memory store's table (budget, lease, replaced/evicted/expired releases); a shared
        store has none: only the turn hooks work then."""
        table = getattr(store, "table", None)
        if not self.on or table is None or not hasattr(table, "withdraw"):
            return False
        self.table = table
        table.watcher = self
        return True

    @property
    def budgeted(self) -> bool:
        return self.table is not None

    # -- the flow's hooks ----------------------------------------------------------------------------
    def taken(self, turn: TurnFacts, keys: list[Key], entry: ReuseEntry | None, why: str) -> str:
        """A turn's lookup: remember the entry it took (released when the turn is over unless P read it);
        the miss reason `released` when the budget had released its conversation's entry."""
        if not self.on:
            return why
        if entry is None:
            if why == "no_entry" and self.tombstones:
                for key in keys:
                    if key in self.tombstones:
                        del self.tombstones[key]
                        return RELEASED
            return why
        rid = entry.params.get("remote_request_id")
        held = self.ledger.take(rid) if isinstance(rid, str) else None
        if held is None:        # a shared store's entry, or one stored before the ledger knew the server
            held = Held(rid, entry.decode, held_tokens(entry.params, None), self.clock()) if isinstance(rid, str) \
                else None
        if held is not None:
            self.turns[turn.request_id] = held
        return why

    def untracked(self, turn: TurnFacts, decode: str, params: Any) -> None:
        """D answered a turn the router keeps nothing of: its blocks help no one."""
        if self.on and isinstance(params, dict) and isinstance(params.get("remote_request_id"), str) \
                and params.get("remote_block_ids"):
            self._release(decode, [params["remote_request_id"]], UNTRACKED, 0.0)

    def stored(self, turn: TurnFacts, decode: str) -> None:
        """The turn's handles were kept: its previous entry is done with, and D's budget is checked."""
        if not self.on:
            return
        self.settle(turn)
        self._enforce(decode)

    def ended(self, turn: TurnFacts) -> None:
        if self.on and self.turns:
            self.settle(turn)

    def settle(self, turn: TurnFacts) -> None:
        """The entry the turn took is useless now: P read it (D freed it then) or it will never be read."""
        held = self.turns.pop(turn.request_id, None)
        if held is None:
            return
        self.ledger.remove(held.request_id)
        self._show(held.decode)
        if turn.pulled:
            return          # P's read freed D's blocks
        # P answered (its read, if any, is over) or never ran (D alone): free now; else P may still be reading.
        done = turn.prefill_ms is not None or turn.plan == DECODE_ONLY
        self._release(held.decode, [held.request_id], UNUSED, 0.0 if done else P_READ_MARGIN_S)

    # -- the table's watcher -------------------------------------------------------------------------
    def put(self, key: Key, entry: ReuseEntry) -> None:
        d = self.ledger.decode(entry.decode)
        engine = entry.params.get("remote_engine_id")
        if d.engine is not None and engine != d.engine:
            self._restarted(entry.decode)
        d.engine = engine
        self.tombstones.pop(key, None)
        self.ledger.add(key, entry.params, entry.decode, entry.expires)
        self._show(entry.decode)
        if d.capacity is None or d.control is None:
            self._learn_soon(entry.decode)

    def dropped(self, key: Key, entry: ReuseEntry, reason: str) -> None:
        rid = entry.params.get("remote_request_id")
        if not isinstance(rid, str):
            return
        held = self.ledger.remove(rid)
        self._show(entry.decode)
        release = TABLE_REASONS.get(reason)
        if release is not None and held is not None:
            self._release(entry.decode, [rid], release, 0.0)

    # -- budget --------------------------------------------------------------------------------------
    def _enforce(self, decode: str) -> None:
        if not self.budgeted:
            return
        victims = self.ledger.over_budget(decode)
        released = []
        for held in victims:
            # Out of the table first: no turn can take it (and hand it to P) once its release is sent.
            if held.key is not None and self.table.withdraw(held.key, held.request_id) is not None:
                self._tombstone(held.key)
                released.append(held.request_id)
        self._show(decode)
        if released:
            self._release(decode, released, LRU, 0.0)

    def _tombstone(self, key: Key) -> None:
        self.tombstones[key] = None
        self.tombstones.move_to_end(key)
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def _restarted(self, decode: str) -> None:
        """A new engine on this server: what the ledger knew of it is gone (the table drops the entries)."""
        self.ledger.forget_decode(decode)
        d = self.ledger.decode(decode)
        d.capacity = d.block_size = d.control = None
        self.said = {s for s in self.said if s[0] != decode}
        self._show(decode)

    # -- calls to D ----------------------------------------------------------------------------------
    def _release(self, decode: str, ids: list[str], reason: str, grace: float) -> None:
        if self.ledger.decode(decode).control is False:
            return
        self._spawn(self._post_release(decode, ids, reason, grace))

    async def _post_release(self, decode: str, ids: list[str], reason: str, grace: float) -> None:
        for start in range(0, len(ids), MAX_IDS_PER_CALL):
            part = ids[start:start + MAX_IDS_PER_CALL]
            status, answer = await self.control.call(decode, "POST", CONTROL + "/release",
                                                     {"request_ids": part, "grace": grace})
            if not self._answered(decode, "release", status):
                return
            results = (answer or {}).get("results") or {}
            self.metrics.held_releases.labels(reason).inc(len(part))
            log.debug("released %d held turns on %s (%s, grace %g s): %s", len(part), decode, reason, grace,
                      {rid: (r or {}).get("status") for rid, r in results.items()})

    def _answered(self, decode: str, op: str, status: int) -> bool:
        """Whether D answered the control call; a server without the routes is said once and left alone."""
        d = self.ledger.decode(decode)
        if status == 200:
            if d.control is not True:
                d.control = True
                self.metrics.held_control.labels(decode).set(1)
            return True
        if status in (404, 405, 501):
            self._no_control(decode, f"HTTP {status} on {CONTROL}")
        else:
            self.metrics.held_failures.labels(op).inc()
            if (decode, op) not in self.said:
                self.said.add((decode, op))
                log.warning("held KV %s on %s failed (%s): D frees those blocks at its own timer",
                            op, decode, f"HTTP {status}" if status else "no answer")
        return False

    def _no_control(self, decode: str, why: str) -> None:
        d = self.ledger.decode(decode)
        d.control = False
        self.metrics.held_control.labels(decode).set(0)
        self.metrics.held_budget.labels(decode).set(0)
        if (decode, "control") not in self.said:
            self.said.add((decode, "control"))
            log.warning("decode server %s has no held-KV control (%s): its held KV is not budgeted, released or "
                        "renewed, and it keeps every turn decoder_kv_blocks_ttl; run it through pdserve's entry "
                        "(bidirectional_kv_xfer on) for the control routes", decode, why)

    def _learn_soon(self, decode: str) -> None:
        task = self.learning.get(decode)
        if task is None or task.done():
            self.learning[decode] = self._spawn(self.learn(decode))

    async def learn(self, decode: str) -> None:
        """D's KV capacity (its /metrics) and whether it answers the control routes; then the budget holds."""
        d = self.ledger.decode(decode)
        if d.capacity is None:
            status, text = await self.control.call(decode, "GET", "/metrics")
            if status != 200 or not isinstance(text, str):
                return          # not up yet: the next tick asks again
            capacity, block_size = capacity_of(text)
            if capacity is None:
                self.metrics.held_failures.labels("capacity").inc()
                if (decode, "capacity") not in self.said:
                    self.said.add((decode, "capacity"))
                    log.warning("decode server %s: no KV capacity in its /metrics (vllm:cache_config_info): its "
                                "held KV is not budgeted", decode)
                return
            self.ledger.learned(decode, capacity, block_size)
            self.metrics.held_capacity.labels(decode).set(capacity)
            self._show(decode)
        if d.control is None:
            status, _ = await self.control.call(decode, "GET", CONTROL)
            self._answered(decode, "list", status)
        budget = self.ledger.budget(decode)
        if budget is not None:
            self.metrics.held_budget.labels(decode).set(budget)
            log.info("decode server %s: KV capacity %d tokens; held KV budget %d tokens (held_kv_share %g)",
                     decode, d.capacity, budget, self.ledger.share)
            self._enforce(decode)

    async def renew_due(self) -> int:
        """Renew the entries the lease keeps (one call per D); the renewed deadline goes to P from now on."""
        if not self.budgeted:
            return 0
        by_decode: dict[str, list[Held]] = {}
        for held in self.ledger.due(self.lead):
            by_decode.setdefault(held.decode, []).append(held)
        done = await asyncio.gather(*(self._renew(d, hs) for d, hs in by_decode.items()))
        return sum(done)

    async def _renew(self, decode: str, entries: list[Held]) -> int:
        sent = self.clock()
        ttl = self.cfg.decoder_kv_blocks_ttl
        renewed = 0
        for start in range(0, len(entries), MAX_IDS_PER_CALL):
            part = entries[start:start + MAX_IDS_PER_CALL]
            status, answer = await self.control.call(decode, "POST", CONTROL + "/renew",
                                                     {"request_ids": [h.request_id for h in part], "ttl": ttl})
            if not self._answered(decode, "renew", status) or not isinstance(answer, dict):
                return renewed
            now_d = answer.get("now")
            results = answer.get("results") or {}
            for held in part:
                r = results.get(held.request_id) or {}
                if r.get("status") == "renewed" and isinstance(r.get("deadline"), int | float) \
                        and isinstance(now_d, int | float):
                    renewed += self._renewed(held, float(r["deadline"]), sent + (r["deadline"] - now_d) - self.margin)
                elif held.in_table and self.ledger.by_id.get(held.request_id) is held:
                    # D no longer holds it (its timer, or it restarted): no turn may be handed it.
                    self.ledger.remove(held.request_id)
                    self.table.withdraw(held.key, held.request_id)
                    self._show(decode)
        return renewed

    def _renewed(self, held: Held, deadline: float, expires: float) -> int:
        if not held.in_table or self.ledger.by_id.get(held.request_id) is not held:
            return 0        # taken (P got the old deadline: still valid) or released meanwhile
        if not self.table.renewed(held.key, held.request_id, deadline, expires):
            return 0
        held.deadline, held.expires = deadline, expires
        self.metrics.held_renewals.inc()
        return 1

    # -- background ----------------------------------------------------------------------------------
    async def forever(self) -> None:
        """Learn each D's capacity (again after a restart) and keep the lease, every tick."""
        if not self.on:
            return
        while True:
            for name, d in list(self.ledger.decodes.items()):
                if d.capacity is None or d.control is None:
                    self._learn_soon(name)
            try:
                await self.renew_due()
            except Exception:   # noqa: BLE001 - the lease must never stop
                log.exception("held KV lease round failed")
            await asyncio.sleep(self.tick)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def settled(self) -> None:
        """Wait for the calls in flight (tests, and shutdown)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def _show(self, decode: str) -> None:
        if self.on:
            self.metrics.held_tokens.labels(decode).set(self.ledger.decode(decode).tokens)

    def held_now(self) -> dict[str, int]:
        return {name: d.tokens for name, d in self.ledger.decodes.items()}


class NoHeld:
    """The flow's hooks when nothing is watched (a Flow built without HeldKV)."""

    def taken(self, turn: TurnFacts, keys: list[Key], entry: ReuseEntry | None, why: str) -> str:
        return why

    def untracked(self, turn: TurnFacts, decode: str, params: Any) -> None:
        pass

    def stored(self, turn: TurnFacts, decode: str) -> None:
        pass

    def ended(self, turn: TurnFacts) -> None:
        pass
