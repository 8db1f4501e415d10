"""aiohttp routes: every wire format's completion route (api/), models, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.router import api, identity
from pdserve.router.api.inputs import BadInput, read_json
from pdserve.router.config import RouterConfig
from pdserve.router.errors import error_body
from pdserve.router.front import observe
from pdserve.router.front import admission
from pdserve.router.kv.held import HeldKV
from pdserve.router.kv.held_control import HttpControl
from pdserve.router.kv.store import open_store, scheme
from pdserve.router.legs import http1 as lean_http
from pdserve.router.legs.book import TurnBook
from pdserve.router.legs.decode import DecodeLeg
from pdserve.router.legs.flow import Flow
from pdserve.router.legs.offer import Offers
from pdserve.router.legs.plan import Planner
from pdserve.router.legs.prefill import PrefillLeg
from pdserve.router.legs.turn import FAILED, TURN
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend, HealthProber, Pool
from pdserve.router.route.breaker import CircuitBreaker
from pdserve.router.route.cost import CostModel
from pdserve.router.route.policy import RoutePolicy
from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")

COMPLETION_ROUTES = api.ROUTES
COUNT_TOKENS = "/v1/messages/count_tokens"   # Claude Code asks it before long turns: any prefill server answers
FLOW = web.AppKey("flow", Flow)
CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
API_KEY = web.AppKey("api_key", str)
OPEN_PATHS = ("/health",)
REPLICA_HEADER = "X-PDServe-Router"   # which router replica answered (its name only, nothing of the backends)
LINGER_SECONDS = 1.0
DRAINING = web.AppKey("draining", asyncio.Event)   # set on SIGTERM (__main__.serve)


async def completions(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    resp = await _completions(request, request.path)
    request.app[METRICS].latency.labels(request.path).observe(time.perf_counter() - started)
    return resp


async def _completions(request: web.Request, route: str) -> web.StreamResponse:
    fmt = api.BY_ROUTE[route]
    try:
        body = await read_json(request, request.app[CONFIG].body_timeout, fmt.validate)
    except BadInput as bad:
        request.app[METRICS].turns.labels(FAILED, fmt.api).inc()   # refused for its content: a turn that failed
        return bad.response(fmt)
    return await request.app[FLOW].handle(request, fmt, body)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's token count, answered by a prefill server (not a turn: nothing is generated)."""
    fmt = api.for_path(request.path)
    try:
        body = await read_json(request, request.app[CONFIG].body_timeout, fmt.validate)
    except BadInput as bad:
        return bad.response(fmt)
    for field in api.base.ROUTER_ONLY:
        body.pop(field, None)
    return await request.app[FLOW].forward(fmt, COUNT_TOKENS, body)


async def root(request: web.Request) -> web.Response:
    """`HEAD /` and `GET /`: Claude Code checks the base URL answers before its first request."""
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [
        {"id": cfg.model, "object": "model", "created": 0, "owned_by": "pdserve"}]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    flow = request.app.get(FLOW)
    if flow is not None:
        await flow.counted()
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def count_requests(request: web.Request, handler):
    """Every answer counted by route and status (401s and 404s included); a client that went away
    counted apart. Unknown paths share one route label, so clients cannot grow the label set."""
    metrics = request.app[METRICS]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "other"
    try:
        resp = await handler(request)
    except asyncio.CancelledError:
        turn = request.get(TURN)
        if turn is not None and turn.answered:     # it hung up once it had its answer: no cancellation
            metrics.requests.labels(route, "200").inc()
        else:
            metrics.client_cancelled.labels(route).inc()
        raise
    metrics.requests.labels(route, str(resp.status)).inc()
    return resp


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error the router itself produces has the OpenAI shape, 404/405 included."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(api.for_path(request.path).error(exc.status, exc.reason or "error"),
                                 status=exc.status)
    except Exception:  # noqa: BLE001 - the client must get a JSON error, not a dropped connection
        request.app[METRICS].internal_errors.inc()
        log.exception("unhandled error on %s", request.path)
        return web.json_response(api.for_path(request.path).error(500, "internal router error", "server_error"),
                                 status=500)


@web.middleware
async def require_api_key(request: web.Request, handler):
    """With an API key configured, every endpoint but /health wants `Authorization: Bearer <key>` (or, as
    Anthropic clients send it, `x-api-key: <key>`)."""
    key = request.app[API_KEY]
    if key and request.path not in OPEN_PATHS:
        # Header bytes that are not UTF-8 arrive as surrogate escapes: encode them back, never fail.
        scheme, _, given = identity.credential(request).partition(" ")
        # Compare digests: constant time whatever the lengths.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest(), hashlib.sha256(key.encode()).digest()):
            fmt = api.for_path(request.path)
            message = "invalid or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            body = fmt.client_error(error_body(message, "invalid_request_error", "invalid_api_key"), 401)
            return web.json_response(body, status=401)
    return await handler(request)


def api_key_from_env(cfg: RouterConfig) -> str:
    if not cfg.api_key_env:
        return ""
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        raise SystemExit(f"error: router.api_key_env names {cfg.api_key_env}, which is not set or empty")
    return key


def server_limits(cfg: RouterConfig) -> dict[str, Any]:
    """aiohttp per-connection settings: an oversized request line or header is refused (plain 400) before
    any handler; an idle keep-alive connection is closed after idle_timeout; after an answer sent before
    the body was read (408, 413), what is left of it is drained at most LINGER_SECONDS, then the
    connection closes (aiohttp's default, 10 s, would let a never-ending body hold it that long)."""
    return {"max_line_size": cfg.max_header_bytes, "max_field_size": cfg.max_header_bytes,
            "keepalive_timeout": cfg.idle_timeout, "lingering_time": LINGER_SECONDS,
            "auto_decompress": False}   # compressed bodies are refused (inputs.py), never inflated


def build_app(cfg: RouterConfig, api_key: str | None = None) -> web.Application:
    key = api_key_from_env(cfg) if api_key is None else api_key
    spans = None
    if cfg.otlp_endpoint:             # only then is OpenTelemetry imported
        from pdserve.router.telemetry.otel import Tracer
        spans = Tracer(cfg)
    observers = [observe.middleware(spans, cfg.json_logs)] if spans is not None or cfg.json_logs else []
    metrics = RouterMetrics()
    # Without a key, no key middleware, and without limits no admission: each is a coroutine more per request.
    limits = admission.Limits.from_config(cfg)
    admit = [admission.middleware(admission.Admission(limits, metrics), api.BY_ROUTE,
                                  lambda fmt: metrics.turns.labels(FAILED, fmt.api).inc())] if limits.enabled else []
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[*observers, count_requests, openai_errors, *([require_api_key] if key else []),
                                       *admit])
    app[CONFIG] = cfg
    app[METRICS] = metrics
    app[API_KEY] = key
    for route in COMPLETION_ROUTES:
        app.router.add_post(route, completions)
    app.router.add_post(COUNT_TOKENS, count_tokens)
    app.router.add_get("/", root)          # add_get answers HEAD too
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)

    async def lifecycle(app: web.Application):
        # A bounded pool of kept-alive connections: under load requests wait for one (up to
        # upstream_pool_timeout) instead of opening sockets until the router runs out of descriptors.
        # Whole-JSON calls go on the lean client (http1.py), unless traced: aiohttp's trace hooks carry the
        # traceparent of every backend call. The two pools share upstream_max_connections (the descriptor
        # budget), half each; the lean one splits its half evenly over the backends.
        lean = spans is None and lean_http.AVAILABLE
        lean_total = cfg.upstream_max_connections // 2 if lean else 0
        backends = len(cfg.prefill) + len(cfg.decode)
        http1 = lean_http.Http1Client(min(cfg.upstream_max_per_backend, max(1, lean_total // backends)),
                                      max_answer_bytes=cfg.max_answer_bytes) if lean else None
        connector = aiohttp.TCPConnector(limit=max(1, cfg.upstream_max_connections - lean_total),
                                         limit_per_host=cfg.upstream_max_per_backend, keepalive_timeout=30)
        # No cookie jar: a backend's Set-Cookie is never kept nor sent with another client's request (and
        # filtering the jar was work on every backend call).
        session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(),
                                        trace_configs=[spans.trace_config()] if spans is not None else None)
        def breaker() -> CircuitBreaker:
            return CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown)

        prefill = Pool("prefill", cfg.prefill, metrics, breaker)
        decode = Pool("decode", cfg.decode, metrics, breaker)
        store = open_store(cfg.store, ttl=cfg.reuse_ttl, max_entries=cfg.reuse_max_entries,
                           max_bytes=cfg.reuse_max_bytes, cluster=cfg.cluster, decodes=[d.name for d in cfg.decode],
                           timeout=cfg.store_timeout,
                           on_evict=lambda reason, n: metrics.entries_evicted.labels(reason).inc(n),
                           on_error=lambda op, reason: metrics.store_errors.labels(op, reason).inc(),
                           on_health=lambda up: metrics.store_up.labels(scheme(cfg.store)).set(1 if up else 0))
        if not store.remote:
            metrics.store_up.labels(scheme(cfg.store)).set(1)
        drops: set[asyncio.Task] = set()
        upstream = Upstream(session, metrics, cfg.request_timeout, app[API_KEY] or None, cfg.upstream_pool_timeout,
                            (prefill, decode), http1, cfg.max_answer_bytes)
        # Learned always (short turns on D use its rates); it guards pulls only with cost_aware (policy.py).
        costs = CostModel(probe_every=cfg.cost_probe_every, probe_interval=cfg.cost_probe_interval)

        async def drop(backend: Backend) -> None:
            dropped = await store.drop_decode(backend.name)
            metrics.entries_live.set(len(store))
            if dropped:
                log.info("dropped %d reuse entries held by %s", dropped, backend.name)

        def on_down(backend: Backend) -> None:
            if backend.role == "decode":
                task = asyncio.create_task(drop(backend))
                drops.add(task)
                task.add_done_callback(drops.discard)

        async def purge_forever() -> None:
            # Expired entries also leave an idle router on time (put and take purge as they go); a shared
            # store is checked every second (its health, and the gauges).
            while True:
                await asyncio.sleep(1.0 if store.remote else min(cfg.reuse_ttl, 10.0))
                await store.refresh()
                metrics.entries_live.set(len(store))
                metrics.entries_bytes.set(store.bytes)

        prober = HealthProber([prefill, decode], session, cfg.health_interval, on_down)
        # D's held KV: released when no longer needed, under a budget, renewed while used (held.py)
        held = HeldKV(cfg, [d.name for d in cfg.decode], metrics,
                      HttpControl(session, lambda name: getattr(decode.by_name(name), "url", None), upstream.auth))
        held.attach(store)
        policy = RoutePolicy(cfg, costs)
        offers = Offers(cfg, upstream, prefill, decode)
        book = TurnBook(store, metrics, held, stamps=policy.short is not None)
        app[FLOW] = Flow(cfg, upstream, Planner(cfg, policy, offers, book, metrics, prober.recheck),
                         PrefillLeg(upstream, offers, costs, metrics, policy), DecodeLeg(upstream, metrics, costs),
                         book, metrics)
        tasks = [asyncio.create_task(prober.forever()),
                 asyncio.create_task(purge_forever()),
                 asyncio.create_task(held.forever())]
        yield
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await held.close()
        await session.close()
        if http1 is not None:
            await http1.close()
        if spans is not None:
            await asyncio.to_thread(spans.shutdown)     # export what is queued
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    draining = app[DRAINING] = asyncio.Event()
    if cfg.replica:
        async def name_replica(request: web.Request, response: web.StreamResponse) -> None:
            response.headers[REPLICA_HEADER] = cfg.replica
            if draining.is_set():
                # SIGTERM: this answer closes its connection (Connection: close), so the client's next request
                # goes to a sibling on a new connection instead of meeting this one closed (__main__.serve).
                # The hook runs after aiohttp chose the headers: the header is set here, the close forced.
                response.headers["Connection"] = "close"
                response.force_close()
        app.on_response_prepare.append(name_replica)
    return app
