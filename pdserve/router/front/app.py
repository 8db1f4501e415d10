"""aiohttp routes: every wire format's completion route (api/), models, health, metrics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.router import api, identity
from pdserve.router.api.inputs import BadInput, read_json
from pdserve.router.buffers import CHARGE, RETRY_AFTER_S, BufferBudget, OverBudget
from pdserve.router.config import RouterConfig
from pdserve.router.errors import error_body
from pdserve.router.front import observe
from pdserve.router.front import admission, drain

from pdserve.router.front.compose import compose
from pdserve.router.kv.reuse import FIRST, HIT, HIT_REASONS, MISS, NO_ENTRY
from pdserve.router.legs.flow import Flow
from pdserve.router.legs.turn import FAILED, TURN, ClientGone, write_within
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
    return await request.app[FLOW].forward(fmt, COUNT_TOKENS, body)    # forward strips the router's fields


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
            # A wrong key stays wrong: the Anthropic and OpenAI SDKs honour this header (Claude Code retried
            # a 401 for ~3 minutes without it).
            return web.json_response(body, status=401, headers={"x-should-retry": "false"})
    return await handler(request)


def buffered(budget: BufferBudget, formats: dict[str, api.WireFormat], on_refused, stall: float):
    """Each request's buffers charged to the router's budget (buffers.py) and given back at its end; a
    request that finds no room, when it comes or while its body arrives, gets a 503 with Retry-After in its
    API's shape. A whole answer is written here, charged, within `stall` seconds (client_stall_timeout):
    written by aiohttp after the handler, a client that never read it held its bytes with no end."""

    @web.middleware
    async def guard(request: web.Request, handler):
        fmt = formats.get(request.path)
        if fmt is None:
            return await handler(request)
        charge = request[CHARGE] = budget.charge()
        try:
            if not budget.room(min(request.content_length or 0, request.app[CONFIG].max_body_bytes)):
                raise OverBudget()
            resp = await handler(request)
            if isinstance(resp, web.Response) and not resp.prepared and len(resp.body or b"") > WRITE_UNTIMED:
                charge.force(len(resp.body))        # type: ignore[arg-type]
                try:
                    await write_within(_write_whole(request, resp), request, stall, request.app[METRICS])
                except ClientGone:
                    pass                            # aiohttp finds it closed and counts nothing more
            return resp
        except OverBudget:
            request.app[METRICS].buffer_refused.labels(request.path).inc()
            on_refused(request.path, fmt)
            message = (f"the router is holding its limit of buffered request and answer bytes "
                       f"(router.max_buffered_mb); retry after {RETRY_AFTER_S} s")
            resp = web.json_response(fmt.client_error(error_body(message, "server_overloaded", 503), 503),
                                     status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
            resp.force_close()                      # the rest of its body is not read
            return resp
        finally:
            charge.close()

    return guard


WRITE_UNTIMED = 64 * 1024   # a whole answer up to this fits the transport's buffer: its write never waits


async def _write_whole(request: web.Request, resp: web.Response) -> None:
    await resp.prepare(request)
    await resp.write_eof()


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
    observers = [observe.middleware(spans, cfg.json_logs, cfg.access_log)] \
        if spans is not None or cfg.json_logs or cfg.access_log else []
    metrics = RouterMetrics()
    # Reuse series at 0 before the first turn: Prometheus' rate() of a series born at its first increments
    # reads 0, so after a router (re)start the dashboard's hit rate would be 0/0 until the next turns.
    for fmt_api in api.APIS:
        for reason in HIT_REASONS:
            metrics.reuse.labels(HIT, reason, fmt_api)
        metrics.reuse.labels(MISS, NO_ENTRY, fmt_api)
        metrics.reuse.labels(FIRST, NO_ENTRY, fmt_api)
    # Without a key, no key middleware, and without limits no admission: each is a coroutine more per request.
    limits = admission.Limits.from_config(cfg)
    # count_tokens too: P tokenizes each (8 bodies of 15 MB took the router to 552 MB); only turns count a turn
    admitted = {**api.BY_ROUTE, COUNT_TOKENS: api.for_path(COUNT_TOKENS)}
    def turn_failed(path: str, fmt: api.WireFormat) -> None:
        if path in api.BY_ROUTE:       # a turn refused before its route: it failed (count_tokens is no turn)
            metrics.turns.labels(FAILED, fmt.api).inc()

    admit = [admission.middleware(admission.Admission(limits, metrics), admitted, turn_failed, cfg.body_timeout)
             ] if limits.enabled else []
    budget = BufferBudget(cfg.max_buffered_bytes)
    metrics.buffered_bytes.set_function(lambda: budget.held)
    app = web.Application(client_max_size=cfg.max_body_bytes,
                          middlewares=[*observers, drain.track, count_requests, openai_errors,
 *([require_api_key] if key else []),
                                       buffered(budget, admitted, turn_failed, cfg.client_stall_timeout), *admit])
    app[CONFIG] = cfg
    app[METRICS] = metrics
    app[API_KEY] = key
    app[drain.IN_FLIGHT] = {}

    for route in COMPLETION_ROUTES:
        app.router.add_post(route, completions)
    app.router.add_post(COUNT_TOKENS, count_tokens)
    app.router.add_get("/", root)          # add_get answers HEAD too
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)

    async def lifecycle(app: web.Application):
        router = compose(cfg, metrics, app[API_KEY], spans)
        app[FLOW] = router.flow
        await router.restore()         # a drained predecessor's reuse entries (kv/store_file.py), before listening
        router.start()
        yield
        await router.close()

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
