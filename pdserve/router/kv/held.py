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
  capacity (its `vllm:cache_config_info`). A stored turn that crosses it releases entries of the tenant
  (identity.reuse_scope) holding the most on that D, least recently used first, while it holds more than its
  equal share (the budget over the tenants holding anything there): its own (`lru`), or another's
  (`over_share`); a tenant within its share keeps its conversations whoever floods. Their next turns
  recompute (miss reason `released`).
- **At once, what the router no longer needs:** an entry replaced by a newer one under the same key
  (`replaced`), evicted from the table by its size bounds (`evicted`) or its TTL (`expired`), taken for a turn
  that did not pull it (`unused`: a miss, or a turn served on D alone), and the handles of a turn the router
  keeps no entry for (`untracked`: no conversation identity).
- **Lease.** Entries still in the table are renewed on D (`ttl` decoder_kv_blocks_ttl) before the router's own
  expiry while their D is under budget, their conversation came back (a turn after its first stored them: a
  one-turn conversation goes at reuse_ttl) and the renewal keeps them no longer than `held_kv_lease` after
  their last use (that, or reuse_ttl if longer, is the most a conversation's blocks outlive it); the renewed
  deadline (D's clock) replaces `remote_blocks_expiry_time` in the stored params (P declines a read within 5 s
  of the deadline it is handed) and the entry's expiry in the table follows it.

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

The bookkeeping is held_ledger.py (no I/O), the calls to D and the lease's renewals held_control.py; HeldKV
here wires them to the flow, the memory table and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from pdserve.router.identity import Key
from pdserve.router.kv.held_control import P_READ_MARGIN_S, Control, DecodeCalls, Lease, Tasks
from pdserve.router.kv.held_ledger import DecodeHeld, Held, Ledger, Tombstones, held_tokens
from pdserve.router.kv.reuse import FIRST, ReuseEntry
from pdserve.router.wire import DECODE_ONLY

log = logging.getLogger("pdserve.router")

# Why the router released held blocks (pdserve_router_held_kv_releases_total{reason}).
LRU = "lru"                # the budget: the least recently used of the tenant whose turn crossed it
OVER_SHARE = "over_share"  # the budget: another tenant's least recently used, that tenant over its fair share
REPLACED = "replaced"      # a newer entry was stored under the same key
EVICTED = "evicted"        # the table's size bounds (reuse_max_entries, reuse_max_mb)
EXPIRED = "expired"        # the table's TTL (reuse_ttl, or the end of the lease)
UNUSED = "unused"          # taken for a turn that did not pull it (a miss, D alone, a failed P leg)
UNTRACKED = "untracked"    # a turn the router keeps no entry for (no conversation identity)
ABANDONED = "abandoned"    # the client left before D's handles reached the router (found in D's own list)
RELEASE_REASONS = (LRU, OVER_SHARE, REPLACED, EVICTED, EXPIRED, UNUSED, UNTRACKED, ABANDONED)
# MemoryTable's reasons for an entry that left it untaken -> the release's reason ("restart": none, D is new)
TABLE_REASONS = {"replaced": REPLACED, "capacity": EVICTED, "expired": EXPIRED}
RELEASED = "released"      # the miss reason of a turn whose entry the budget released
TOMBSTONES = 100_000       # keys whose entry the budget released, remembered for the miss reason
# When D's list is searched for an abandoned turn (seconds after the client left): D finishes a turn whose last
# tokens were under way, or aborts it, once it sees the router's connection gone (a token or two).
ABANDONED_SWEEPS_S = (1.0, 5.0, 15.0)


class TurnFacts(Protocol):
    """What the hooks read of a turn (router/legs/turn.py's Turn)."""
    request_id: str
    plan: str
    prefill_ms: float | None
    pulled: int | None
    reuse: tuple[str, str] | None          # (result, reason) of its reuse decision
    conversation: Any                      # its Conversation (messages: the history, None without one)



def withdrawn(table: Any, tombstones: Tombstones, victims: list[Held], tenant: str | None) -> dict[str, list[str]]:
    """The budget's victims taken out of the table, their keys remembered (the miss reason `released`); their
    ids by release reason: the crossing `tenant`'s own `lru`, another tenant's `over_share`."""
    released: dict[str, list[str]] = {}
    for held in victims:
        # Out of the table first: no turn can take it (and hand it to P) once its release is sent.
        entry = table.withdraw(held.key, held.request_id) if held.key is not None else None
        if entry is not None:
            tombstones.add(held.key)
            if entry.alias is not None:      # its prompt's key: a client that rewrote the reply looks there
                tombstones.add(entry.alias)
            reason = OVER_SHARE if tenant is not None and held.tenant != tenant else LRU
            released.setdefault(reason, []).append(held.request_id)
    return released


def show(metrics: Any, d: DecodeHeld) -> None:
    """A decode server's held tokens and its tenants, on the gauges."""
    metrics.held_tokens.labels(d.name).set(d.tokens)
    metrics.held_tenants.labels(d.name).set(len(d.tenant_tokens))


def came_back(turn: TurnFacts, took: bool) -> bool:
    """The turn continues a conversation: it `took` its entry, or the budget had released it, or its history
    holds earlier model output (chat, Messages, Responses; completions have no history to tell)."""
    if took:
        return True
    result, reason = turn.reuse or (FIRST, "")
    return reason == RELEASED or (result != FIRST and getattr(turn.conversation, "messages", None) is not None)


class HeldKV:
    """The ledger wired to the router: hooks for the flow and the memory table, the metrics, and the
    background task (capacity, the lease); the calls to D go through DecodeCalls, the renewals through Lease."""

    def __init__(self, cfg: Any, decodes: list[str], metrics: Any, control: Control,
                 clock: Callable[[], float] = time.monotonic):
        self.on = bool(cfg.held_kv and cfg.bidirectional_kv_xfer)
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self.ledger = Ledger(cfg.held_kv_share, cfg.held_kv_lease, clock)
        self.calls = DecodeCalls(control, self.ledger, metrics)
        self.lease = Lease(cfg, self.ledger, self.calls, metrics, clock, self._show)
        self.table: Any = None                 # the MemoryTable (budget and lease need it)
        self.turns: dict[str, Held] = {}       # turn request id -> the entry it took
        self.tombstones = Tombstones(TOMBSTONES)   # keys whose entry the budget released: the miss reason
        self.tasks = Tasks()                   # the calls to D in flight
        self.learning: dict[str, asyncio.Task] = {}
        self.sweeps_s = ABANDONED_SWEEPS_S
        for name in decodes:
            self.ledger.decode(name)
        if self.on:
            for reason in RELEASE_REASONS:
                metrics.held_releases.labels(reason)
            for name in decodes:
                metrics.held_tokens.labels(name).set(0)

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
            return RELEASED if why == "no_entry" and self.tombstones.claim(keys) else why
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

    def stored(self, turn: TurnFacts, decode: str, params: Any = None) -> None:
        """The turn's handles (`params`) were kept (leased if it came back); D's budget is checked."""
        if not self.on:
            return
        rid = params.get("remote_request_id") if isinstance(params, dict) else None
        held = self.ledger.by_id.get(rid) if isinstance(rid, str) else None
        if held is not None and self.table is not None and came_back(turn, turn.request_id in self.turns):
            held.continued = True
            self.table.continued(held.key, rid)     # kept across a drained restart (store_file.py)
        self.settle(turn)
        self._enforce(decode, held.tenant if held is not None else None)

    def ended(self, turn: TurnFacts) -> None:
        if self.on and self.turns:
            self.settle(turn)

    def abandoned(self, turn: TurnFacts, decode: str) -> None:
        """The turn ended (its client left) before D's handles reached the router, but D may have finished it:
        the last tokens were generated, or were under way when the connection closed. D then holds its blocks
        for decoder_kv_blocks_ttl with the router none the wiser. D's engine names the request after the id
        the router sent it (vLLM: a prefix and a random suffix around it), so D's own list finds it."""
        if self.on and self.ledger.decode(decode).control is not False:
            self.tasks.spawn(self.calls.sweep(decode, turn.request_id.removeprefix("pdserve-"), ABANDONED,
                                              self.sweeps_s))

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
        self.tombstones.discard(key)
        self.ledger.add(key, entry.params, entry.decode, entry.expires, entry.continued)
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
    def _enforce(self, decode: str, tenant: str | None = None) -> None:
        """Release what passes D's budget (`tenant`: whose turn crossed it)."""
        if self.budgeted:
            released = withdrawn(self.table, self.tombstones, self.ledger.over_budget(decode), tenant)
            self._show(decode)
            for reason, ids in released.items():
                self._release(decode, ids, reason, 0.0)

    def _restarted(self, decode: str) -> None:
        """A new engine on this server: what the ledger knew of it is gone (the table drops the entries)."""
        self.ledger.restarted(decode)
        self.calls.forget(decode)
        self._show(decode)

    # -- calls to D ----------------------------------------------------------------------------------
    def _release(self, decode: str, ids: list[str], reason: str, grace: float) -> None:
        if self.ledger.decode(decode).control is not False:
            self.tasks.spawn(self.calls.release(decode, ids, reason, grace))

    def _learn_soon(self, decode: str) -> None:
        task = self.learning.get(decode)
        if task is None or task.done():
            self.learning[decode] = self.tasks.spawn(self.learn(decode))

    async def learn(self, decode: str) -> None:
        """D's KV capacity (its /metrics) and whether it answers the control routes; then the budget holds."""
        d = self.ledger.decode(decode)
        if d.capacity is None:
            learned = await self.calls.capacity(decode)
            if learned is None:
                return          # not up yet (the next tick asks again), or no capacity in its /metrics
            self.ledger.learned(decode, *learned)
            self.metrics.held_capacity.labels(decode).set(learned[0])
            self._show(decode)
        if d.control is None:
            await self.calls.probe(decode)
        budget = self.ledger.budget(decode)
        if budget is not None:
            self.metrics.held_budget.labels(decode).set(budget)
            log.info("decode server %s: KV capacity %d tokens; held KV budget %d tokens (held_kv_share %g)",
                     decode, d.capacity, budget, self.ledger.share)
            self._enforce(decode)

    async def renew_due(self) -> int:
        """Renew the entries the lease keeps (one call per D); the renewed deadline goes to P from now on."""
        return await self.lease.renew_due(self.table) if self.budgeted else 0

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
            await asyncio.sleep(self.lease.tick)

    async def settled(self) -> None:
        """Wait for the calls in flight (tests, and shutdown)."""
        await self.tasks.settled()

    async def close(self) -> None:
        await self.tasks.close()

    def _show(self, decode: str) -> None:
        if self.on:
            show(self.metrics, self.ledger.decode(decode))


class NoHeld:
    """The flow's hooks when nothing is watched (a Flow built without HeldKV)."""

    def taken(self, turn: TurnFacts, keys: list[Key], entry: ReuseEntry | None, why: str) -> str:
        return why

    def untracked(self, turn: TurnFacts, decode: str, params: Any) -> None:
        pass

    def stored(self, turn: TurnFacts, decode: str, params: Any = None) -> None:
        pass

    def ended(self, turn: TurnFacts) -> None:
        pass

    def abandoned(self, turn: TurnFacts, decode: str) -> None:
        pass
