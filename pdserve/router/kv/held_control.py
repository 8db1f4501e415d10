"""What the router asks of the decode servers for their held KV (held.py decides when): D's control routes
(pdserve/engine/held.py) over HTTP, the calls (release, renew, capacity) with what D answered them, and the
lease that renews the table's entries on D."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp

from pdserve.router.kv.held_ledger import Held, Ledger, capacity_of
from pdserve.router.wire import CONTROL_TOKEN_ENV

log = logging.getLogger("pdserve.router")

CONTROL = "/pdserve/held"
# P declines a read when its deadline is this close (vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN); a release of
# blocks P may be reading waits as long (pdserve/engine/held.py's default grace).
P_READ_MARGIN_S = 5.0
CALL_TIMEOUT_S = 35.0      # D's control call waits up to 30 s for its engine
MAX_IDS_PER_CALL = 1000


class Control(Protocol):
    """D's control routes and /metrics (HTTP in the router; a fake in unit tests)."""

    async def call(self, decode: str, method: str, path: str, body: dict[str, Any] | None = None
                   ) -> tuple[int, Any]: ...


class HttpControl:
    """The control routes over the router's HTTP session, with the cluster's control token (CONTROL_TOKEN_ENV,
    from pdserve's supervisor: D's routes check it), else the router's API key (a D started without the token
    checks that)."""

    def __init__(self, session: aiohttp.ClientSession, urls: Callable[[str], str | None], auth: dict[str, str]):
        self.session = session
        self.urls = urls
        token = os.environ.get(CONTROL_TOKEN_ENV)
        self.auth = {"Authorization": f"Bearer {token}"} if token else auth
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


class DecodeCalls:
    """The calls to D, and whether it answers them: a server without the control routes is marked in the
    ledger (never budgeted, released or renewed), and each failure is said once in the log."""

    def __init__(self, control: Control, ledger: Ledger, metrics: Any):
        self.control = control
        self.ledger = ledger
        self.metrics = metrics
        self.said: set[tuple[str, str]] = set()   # (decode, what) said once in the log

    def forget(self, decode: str) -> None:
        """A new engine on this server: say its failures again."""
        self.said = {s for s in self.said if s[0] != decode}

    async def release(self, decode: str, ids: list[str], reason: str, grace: float) -> None:
        for start in range(0, len(ids), MAX_IDS_PER_CALL):
            part = ids[start:start + MAX_IDS_PER_CALL]
            status, answer = await self.control.call(decode, "POST", CONTROL + "/release",
                                                     {"request_ids": part, "grace": grace})
            if not self.answered(decode, "release", status):
                return
            results = answer.get("results") if isinstance(answer, dict) else None
            self.metrics.held_releases.labels(reason).inc(len(part))
            log.debug("released %d held turns on %s (%s, grace %g s): %s", len(part), decode, reason, grace,
                      results)

    async def sweep(self, decode: str, marker: str, reason: str, after_s: tuple[float, ...]) -> None:
        """Release what D lists as held under ids holding `marker`, looked for `after_s` seconds from now
        (until found: one request holds one entry)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        for at in after_s:
            await asyncio.sleep(max(0.0, started + at - loop.time()))
            status, answer = await self.control.call(decode, "GET", CONTROL)
            if not self.answered(decode, "list", status):
                return
            listed = answer.get("held") if isinstance(answer, dict) else None
            found = [h["request_id"] for h in (listed if isinstance(listed, list) else ()) if isinstance(h, dict)
                     and isinstance(h.get("request_id"), str) and marker in h["request_id"]]
            if found:
                await self.release(decode, found, reason, 0.0)
                return

    async def renew(self, decode: str, ids: list[str], ttl: float) -> dict[str, Any] | None:
        """D's answer to renewing these entries ({"now": D's clock, "results": per id}); None when it gave none."""
        status, answer = await self.control.call(decode, "POST", CONTROL + "/renew", {"request_ids": ids, "ttl": ttl})
        if not self.answered(decode, "renew", status):
            return None
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(answer.get("now") if isinstance(answer, dict) else None, int | float) \
                or not isinstance(results, dict) or not all(isinstance(r, dict) for r in results.values()):
            # Unreadable: nothing is renewed and nothing withdrawn (the router's own expiry stands).
            self.failed(decode, "renew", "an answer it could not read")
            return None
        return answer

    async def capacity(self, decode: str) -> tuple[int, int | None] | None:
        """D's KV capacity in tokens and its block size, from its /metrics; None when it is not up yet (the
        next tick asks again) or its /metrics has none (said once)."""
        status, text = await self.control.call(decode, "GET", "/metrics")
        if status != 200 or not isinstance(text, str):
            return None
        capacity, block_size = capacity_of(text)
        if capacity is None:
            self.metrics.held_failures.labels("capacity").inc()
            if (decode, "capacity") not in self.said:
                self.said.add((decode, "capacity"))
                log.warning("decode server %s: no KV capacity in its /metrics (vllm:cache_config_info): its "
                            "held KV is not budgeted", decode)
            return None
        return capacity, block_size

    async def probe(self, decode: str) -> None:
        """Whether D answers the control routes (its list)."""
        status, _ = await self.control.call(decode, "GET", CONTROL)
        self.answered(decode, "list", status)

    def answered(self, decode: str, op: str, status: int) -> bool:
        """Whether D answered the control call; a server without the routes is said once and left alone."""
        d = self.ledger.decode(decode)
        if status == 200:
            if d.control is not True:
                d.control = True
                self.metrics.held_control.labels(decode).set(1)
            return True
        if status in (404, 405, 501):
            self.no_control(decode, f"HTTP {status} on {CONTROL}")
        else:
            self.failed(decode, op, f"HTTP {status}" if status else "no answer")
        return False

    def failed(self, decode: str, op: str, why: str) -> None:
        """A control call that did not do its work: counted, and said once per server and call."""
        self.metrics.held_failures.labels(op).inc()
        if (decode, op) not in self.said:
            self.said.add((decode, op))
            log.warning("held KV %s on %s failed (%s): D frees those blocks at its own timer", op, decode, why)

    def no_control(self, decode: str, why: str) -> None:
        d = self.ledger.decode(decode)
        d.control = False
        self.metrics.held_control.labels(decode).set(0)
        self.metrics.held_budget.labels(decode).set(0)
        if (decode, "control") not in self.said:
            self.said.add((decode, "control"))
            log.warning("decode server %s has no held-KV control (%s): its held KV is not budgeted, released or "
                        "renewed, and it keeps every turn decoder_kv_blocks_ttl; run it through pdserve's entry "
                        "(bidirectional_kv_xfer on) for the control routes", decode, why)


class Lease:
    """Renews on D the table's entries that the ledger says are due, before the router's own expiry; the
    renewed deadline (D's clock) goes to P from then on, and the entry's expiry in the table follows it."""

    def __init__(self, cfg: Any, ledger: Ledger, calls: DecodeCalls, metrics: Any, clock: Callable[[], float],
                 show: Callable[[str], None]):
        self.cfg = cfg
        self.ledger = ledger
        self.calls = calls
        self.metrics = metrics
        self.clock = clock
        self.show = show                                       # the held tokens' gauge of a decode server
        self.tick = min(5.0, max(0.2, cfg.reuse_ttl / 8))    # the lease's round
        self.lead = 3 * self.tick                              # renew this long before the router's expiry
        self.read_margin = P_READ_MARGIN_S

    @property
    def margin(self) -> float:
        """The router keeps a renewed entry until this long before D's new deadline (as reuse_ttl does before
        D's first one), and at least P's read margin and a round: P declines reads that close to it."""
        return max(self.cfg.decoder_kv_blocks_ttl - self.cfg.reuse_ttl, self.read_margin + self.tick)

    async def renew_due(self, table: Any) -> int:
        """Renew the entries the lease keeps (one call per D); the renewed deadline goes to P from now on."""
        by_decode: dict[str, list[Held]] = {}
        # A renewal keeps an entry this much longer in the table: the lease ends before it passes held_kv_lease.
        span = self.cfg.decoder_kv_blocks_ttl - self.margin
        for held in self.ledger.due(self.lead, span):
            by_decode.setdefault(held.decode, []).append(held)
        # One decode server's trouble never stops another's renewals.
        done = await asyncio.gather(*(self._renew(table, d, hs) for d, hs in by_decode.items()),
                                    return_exceptions=True)
        for decode, result in zip(by_decode, done):
            if isinstance(result, BaseException):
                self.calls.failed(decode, "renew", repr(result))
        return sum(r for r in done if isinstance(r, int))

    async def _renew(self, table: Any, decode: str, entries: list[Held]) -> int:
        sent = self.clock()
        ttl = self.cfg.decoder_kv_blocks_ttl
        renewed = 0
        for start in range(0, len(entries), MAX_IDS_PER_CALL):
            part = entries[start:start + MAX_IDS_PER_CALL]
            answer = await self.calls.renew(decode, [h.request_id for h in part], ttl)
            if answer is None:
                return renewed
            now_d = answer.get("now")
            results = answer.get("results") or {}
            for held in part:
                r = results.get(held.request_id) or {}
                if r.get("status") == "renewed" and isinstance(r.get("deadline"), int | float) \
                        and isinstance(now_d, int | float):
                    renewed += self._renewed(table, held, float(r["deadline"]),
                                             sent + (r["deadline"] - now_d) - self.margin)
                elif held.in_table and self.ledger.by_id.get(held.request_id) is held:
                    # D no longer holds it (its timer, or it restarted): no turn may be handed it.
                    self.ledger.remove(held.request_id)
                    table.withdraw(held.key, held.request_id)
                    self.show(decode)
        return renewed

    def _renewed(self, table: Any, held: Held, deadline: float, expires: float) -> int:
        if not held.in_table or self.ledger.by_id.get(held.request_id) is not held:
            return 0        # taken (P got the old deadline: still valid) or released meanwhile
        if not table.renewed(held.key, held.request_id, deadline, expires):
            return 0
        held.deadline, held.expires = deadline, expires
        self.metrics.held_renewals.inc()
        return 1


class Tasks:
    """The calls to D in flight: spawned off the turn's path, awaited (settled), or cancelled (close)."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task] = set()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return task

    async def settled(self) -> None:
        while self.running:
            await asyncio.gather(*list(self.running), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self.running):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*list(self.running), return_exceptions=True)
