"""The router's objects, built and wired in one place (as vLLM's init_app_state beside build_app): the
backend clients, the pools and their prober, the reuse store, D's held KV, the policy, the legs and the
flow; and what runs beside the requests (probes, the store's purge, the held-KV lease)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from pdserve.router.config import RouterConfig
from pdserve.router.front.drain import awaiting
from pdserve.router.kv.held import HeldKV
from pdserve.router.kv import store_file
from pdserve.router.kv.held_control import CONTROL, HttpControl
from pdserve.router.kv.store import ReuseStore, open_store, scheme
from pdserve.router.kv.reuse import ReuseEntry
from pdserve.router.kv.store_memory import MemoryTable
from pdserve.router.legs import http1 as lean_http
from pdserve.router.legs.book import TurnBook
from pdserve.router.legs.client import AiohttpClient, BackendClient, Traced
from pdserve.router.legs.decode import DecodeLeg
from pdserve.router.legs.flow import Flow
from pdserve.router.legs.offer import Offers
from pdserve.router.legs.plan import Planner
from pdserve.router.legs.prefill import PrefillLeg
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend, HealthProber, Pool
from pdserve.router.route.breaker import CircuitBreaker
from pdserve.router.route.cost import CostModel
from pdserve.router.route.policy import RoutePolicy
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.roles import DECODE, PREFILL

log = logging.getLogger("pdserve.router")


class Router:
    """The composed router: its flow (what the routes call) and what runs beside it until close()."""

    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics, flow: Flow, session: aiohttp.ClientSession,
                 client: BackendClient, prober: HealthProber, store: ReuseStore, held: HeldKV, spans: Any,
                 control: HttpControl | None = None, decode: Pool | None = None):
        self.cfg, self.metrics, self.flow = cfg, metrics, flow
        self.session, self.client, self.prober, self.store, self.held, self.spans = \
            session, client, prober, store, held, spans
        self.control, self.decode = control, decode
        self.tasks: list[asyncio.Task] = []
        self.drops: set[asyncio.Task] = set()

    def _kept_table(self) -> MemoryTable | None:
        """The memory table a drained stop keeps in router.reuse_file (None: no file, or a shared store)."""
        table = getattr(self.store, "table", None)
        return table if self.cfg.reuse_file and isinstance(table, MemoryTable) else None

    async def restore(self) -> None:
        """Before listening: the entries a drained predecessor left that their decode servers still hold."""
        table = self._kept_table()
        if table is None:
            return
        names = [d.name for d in self.cfg.decode]
        saved, expired = await asyncio.to_thread(store_file.load, self.cfg.reuse_file, self.cfg.cluster,
                                                 self.cfg.reuse_max_bytes, names)
        if not saved and not expired:
            return
        held = await store_file.still_held(saved, lambda d: self.control.call(d, "GET", CONTROL)) \
            if self.control is not None else []
        n = store_file.restore(table, held, lambda d: self.decode.by_name(d).generation if self.decode else 0,
                               used=self._set_used)
        self.metrics.entries_live.set(len(self.store))
        self.metrics.entries_bytes.set(self.store.bytes)
        log.info("reuse store: restored %d conversation(s) from %s (%d expired, %d no longer held by their "
                 "decode server)", n, self.cfg.reuse_file, expired, len(saved) - n)

    def _used(self, entry: ReuseEntry) -> float | None:
        """An entry's last use, as the held-KV ledger knows it (its lease renews what was used lately)."""
        held = self.held.ledger.by_id.get(entry.params.get("remote_request_id"))
        return held.used if held is not None else None

    def _set_used(self, entry: ReuseEntry, used: float) -> None:
        held = self.held.ledger.by_id.get(entry.params.get("remote_request_id"))
        if held is not None:
            held.used = used

    async def _keep(self) -> None:
        """A drained stop: write the memory table for the next router (store_file.py)."""
        table = self._kept_table()
        if table is None:
            return
        try:
            n = await asyncio.to_thread(store_file.save, table, self.cfg.reuse_file, self.cfg.cluster, self._used)
            log.info("reuse store: %d conversation(s) written to %s for the next router", n, self.cfg.reuse_file)
        except OSError as err:
            log.warning("reuse store: could not write %s (%s): the next router starts empty", self.cfg.reuse_file,
                        err)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.prober.forever()),
                      asyncio.create_task(self._purge_forever()),
                      asyncio.create_task(self.held.forever())]

    def on_down(self, backend: Backend) -> None:
        """A decode server seen gone: its entries are dropped (its KV is gone with it)."""
        if backend.role == DECODE:
            task = asyncio.create_task(self._drop(backend))
            self.drops.add(task)
            task.add_done_callback(self.drops.discard)

    async def _drop(self, backend: Backend) -> None:
        dropped = await self.store.drop_decode(backend.name)
        self.metrics.entries_live.set(len(self.store))
        if dropped:
            log.info("dropped %d reuse entries held by %s", dropped, backend.name)

    async def _purge_forever(self) -> None:
        # Expired entries also leave an idle router on time (put and take purge as they go); a shared
        # store is checked every second (its health, and the gauges).
        store = self.store
        while True:
            await asyncio.sleep(1.0 if store.remote else min(self.cfg.reuse_ttl, 10.0))
            await store.refresh()
            self.metrics.entries_live.set(len(store))
            self.metrics.entries_bytes.set(store.bytes)

    async def close(self) -> None:
        """Each step bounded (CLOSE_STEP_S): a step that hangs is named in the log and the stop goes on."""
        await self._keep()
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            _, left = await asyncio.wait(self.tasks, timeout=CLOSE_STEP_S)
            for task in left:
                log.warning("closing: %s went on %gs after its cancel, at %s", task.get_name(), CLOSE_STEP_S,
                            " -> ".join(awaiting(task.get_coro())))
        await _within("held-KV calls", self.held.close())
        await _within("the backends' connections", self.session.close())
        await _within("the backends' lean client", self.client.close())
        if self.spans is not None:
            await _within("the trace export", asyncio.to_thread(self.spans.shutdown))     # export what is queued
        await _within("the reuse store", self.store.close())


CLOSE_STEP_S = 5.0


async def _within(what: str, step: Any) -> None:
    try:
        async with asyncio.timeout(CLOSE_STEP_S):
            await step
    except TimeoutError:
        log.warning("closing: %s not closed after %gs; going on", what, CLOSE_STEP_S)


def compose(cfg: RouterConfig, metrics: RouterMetrics, api_key: str | None, spans: Any = None) -> Router:
    """Every object of the router, wired; nothing runs until Router.start (call it on the running loop)."""
    # A bounded pool of kept-alive connections: under load requests wait for one (up to
    # upstream_pool_timeout) instead of opening sockets until the router runs out of descriptors.
    # The legs' calls go on the lean client (http1.py; on aiohttp where httptools is missing), traced or not:
    # tracing is a hook on it (client.py). The lean client and aiohttp's pool (probes, /metrics, held control)
    # share upstream_max_connections (the descriptor budget), half each; the lean one splits its half evenly
    # over the backends for whole-JSON calls, and its streams keep the bounds they had on aiohttp's pool.
    lean = lean_http.AVAILABLE
    lean_total = cfg.upstream_max_connections // 2 if lean else 0
    backends = len(cfg.prefill) + len(cfg.decode)
    connector = aiohttp.TCPConnector(limit=max(1, cfg.upstream_max_connections - lean_total),
                                     limit_per_host=cfg.upstream_max_per_backend, keepalive_timeout=30)
    # No cookie jar: a backend's Set-Cookie is never kept nor sent with another client's request (and
    # filtering the jar was work on every backend call).
    session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
    client: BackendClient
    if lean:
        client = lean_http.Http1Client(min(cfg.upstream_max_per_backend, max(1, lean_total // backends)),
                                       max_answer_bytes=cfg.max_answer_bytes)
        client.budget_streams(connector.limit, connector.limit_per_host)
    else:
        client = AiohttpClient(session, cfg.max_answer_bytes)
    if spans is not None:
        client = Traced(client, spans)

    def breaker() -> CircuitBreaker:
        return CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown)

    prefill = Pool(PREFILL, cfg.prefill, metrics, breaker)
    decode = Pool(DECODE, cfg.decode, metrics, breaker)
    store = open_store(cfg.store, ttl=cfg.reuse_ttl, max_entries=cfg.reuse_max_entries,
                       max_bytes=cfg.reuse_max_bytes, cluster=cfg.cluster, decodes=[d.name for d in cfg.decode],
                       timeout=cfg.store_timeout,
                       on_evict=lambda reason, n: metrics.entries_evicted.labels(reason).inc(n),
                       on_error=lambda op, reason: metrics.store_errors.labels(op, reason).inc(),
                       on_health=lambda up: metrics.store_up.labels(scheme(cfg.store)).set(1 if up else 0))
    if not store.remote:
        metrics.store_up.labels(scheme(cfg.store)).set(1)
    upstream = Upstream(session, metrics, cfg.request_timeout, api_key or None, cfg.upstream_pool_timeout,
                        (prefill, decode), client, cfg.max_answer_bytes)
    # Learned always (short turns on D use its rates); it guards pulls only with cost_aware (policy.py).
    costs = CostModel(probe_every=cfg.cost_probe_every, probe_interval=cfg.cost_probe_interval)
    # D's held KV: released when no longer needed, under a budget, renewed while used (held.py)
    control = HttpControl(session, lambda name: getattr(decode.by_name(name), "url", None), upstream.auth)
    held = HeldKV(cfg, [d.name for d in cfg.decode], metrics, control)
    held.attach(store)
    policy = RoutePolicy(cfg, costs)
    offers = Offers(cfg, upstream, prefill, decode)
    book = TurnBook(store, metrics, held, stamps=policy.short is not None)
    prober = HealthProber([prefill, decode], session, cfg.health_interval, lambda backend: router.on_down(backend))
    flow = Flow(cfg, upstream, Planner(cfg, policy, offers, book, metrics, prober.recheck),
                PrefillLeg(upstream, offers, costs, metrics, policy),
                DecodeLeg(upstream, metrics, costs, cfg.max_output_tokens, cfg.client_stall_timeout), book, metrics)
    router = Router(cfg, metrics, flow, session, client, prober, store, held, spans, control, decode)
    return router
