"""D's held-KV control over HTTP (engine/held.py has the engine side): the API server's routes
`GET /pdserve/held`, `POST /pdserve/held/release` and `/renew`, their input checks and answers, and how they get
onto vLLM's app (0.32: build_app wrapped where it is defined; 0.26: the models router's attach_router, which its
build_app calls)."""

from __future__ import annotations

import importlib
import json
import logging
import math
from typing import Any

from pdserve.engine import held, tier
from pdserve.router.wire import CONTROL_TOKEN_ENV
from pdserve.engine.held import (APP_MODULE, CALL_TIMEOUT_S, CLOCK, ENGINE_METHOD, MAX_GRACE_S, MAX_IDS, MAX_TTL_S,
                                 P_READ_MARGIN_S, PATH, ROUTER_MODULE, Unsupported, merge_answers)


class BadRequest(ValueError):
    pass

log = logging.getLogger("pdserve.engine")


def parse_ids(body: Any) -> list[str]:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    ids = body.get("request_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
        raise BadRequest("request_ids must be a non-empty list of strings (D's remote_request_id)")
    if len(ids) > MAX_IDS:
        raise BadRequest(f"at most {MAX_IDS} request_ids per call")
    return list(dict.fromkeys(ids))


def parse_seconds(body: dict, key: str, default: float | None, limit: float, positive: bool) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0) or value > limit:
        raise BadRequest(f"{key} must be a number of seconds, {'above' if positive else 'at least'} 0 and at "
                         f"most {limit:g}")
    return float(value)


async def call_engines(engine_client: Any, op: str, ids: list[str] | None, seconds: float | None) -> list[dict]:
    import asyncio
    core = getattr(engine_client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    call_one = getattr(core, "call_utility_async", None)
    if call_all is not None:
        coro = call_all(ENGINE_METHOD, op, ids, seconds)
    elif call_one is not None:
        coro = call_one(ENGINE_METHOD, op, ids, seconds)
    else:
        raise Unsupported("the engine client has no utility call (engine_core.call_utility_async)")
    result = await asyncio.wait_for(coro, CALL_TIMEOUT_S)
    return result if call_all is not None else [result]


async def handle(engine_client: Any, op: str, raw_body: bytes | None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of one call; never raises."""
    ids: list[str] | None = None
    seconds: float | None = None
    try:
        if op != "list":
            try:
                body = json.loads(raw_body or b"")
            except ValueError as e:
                raise BadRequest(f"the body is not JSON: {e}") from None
            ids = parse_ids(body)
            seconds = (parse_seconds(body, "ttl", None, MAX_TTL_S, positive=True) if op == "renew"
                       else parse_seconds(body, "grace", P_READ_MARGIN_S, MAX_GRACE_S, positive=False))
    except BadRequest as e:
        return 400, {"error": {"message": str(e), "type": "BadRequestError", "code": 400}}
    try:
        answers = await call_engines(engine_client, op, ids, seconds)
    except Unsupported as e:
        return 501, {"error": {"message": f"held-KV control unsupported: {e}", "type": "NotImplemented",
                               "code": 501}}
    except TimeoutError:
        return 503, {"error": {"message": f"the engine did not answer in {CALL_TIMEOUT_S:g} s",
                               "type": "EngineTimeout", "code": 503}}
    except Exception as e:      # an engine-side failure comes back as a plain Exception
        msg = str(e)
        unsupported = "unsupported" in msg.lower() or "has no" in msg
        return (501 if unsupported else 503), {"error": {"message": f"held-KV control failed: {msg}",
                                                         "type": "EngineError", "code": 501 if unsupported else 503}}
    answer = merge_answers(answers, op)
    out: dict[str, Any] = {"now": answer["now"], "clock": CLOCK, "engine_id": answer.get("engine_id")}
    if op == "list":
        held = [{"request_id": rid, "remaining_s": e["deadline"] - answer["now"], **e}
                for rid, e in sorted(answer["held"].items(), key=lambda kv: kv[1]["deadline"])]
        out.update(count=len(held), blocks=sum(e["blocks"] or 0 for e in held), held=held)
    else:
        out["results"] = answer["results"]
        if op == "release":
            out["grace"] = seconds
        else:
            out["ttl"] = seconds
    return 200, out


def api_tokens(args: Any) -> list[str]:
    """Who may call these routes: the router alone, by the cluster's control token (CONTROL_TOKEN_ENV, which
    pdserve's supervisor gives its servers and routers), else (a server started without it) the server's
    --api-key values or VLLM_API_KEY, as vLLM's own middleware takes them: it guards only /v1, /v2,
    /inference and /cohere, so these routes check them themselves. A client's API key is not the control
    token: knowing the router's key does not open another tenant's held turns."""
    import os
    control = os.environ.get(CONTROL_TOKEN_ENV)
    if control:
        return [control]
    keys = getattr(args, "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    return [k for k in (keys or [os.environ.get("VLLM_API_KEY")]) if k]


def authorized(header: str | None, tokens: list[str]) -> bool:
    import hashlib
    import secrets
    if not tokens:
        return True
    scheme, _, param = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(param.encode()).digest()
    return any([secrets.compare_digest(digest, hashlib.sha256(t.encode()).digest()) for t in tokens])


def make_router(tokens: list[str] | None = None):
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse
    router = APIRouter()

    async def answer(request: Request, op: str):
        if not authorized(request.headers.get("Authorization"), tokens or []):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = None if op == "list" else await request.body()
        status, payload = await handle(getattr(request.app.state, "engine_client", None), op, body)
        return JSONResponse(payload, status_code=status)

    async def held_list(request: Request):
        return await answer(request, "list")

    async def held_release(request: Request):
        return await answer(request, "release")

    async def held_renew(request: Request):
        return await answer(request, "renew")

    for fn, method, path in ((held_list, "GET", PATH), (held_release, "POST", PATH + "/release"),
                             (held_renew, "POST", PATH + "/renew")):
        # This module's annotations are strings (postponed) and Request is not one of its globals.
        fn.__annotations__ = {"request": Request}
        router.add_api_route(path, fn, methods=[method])
    return router


def server_role(args: Any) -> tuple[str | None, bool]:
    """(kv_role, bidirectional_kv_xfer) of the server's --kv-transfer-config (object, dict or JSON)."""
    cfg = getattr(args, "kv_transfer_config", None)
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return None, False
    if cfg is None:
        return None, False
    if not isinstance(cfg, dict):
        cfg = {"kv_role": getattr(cfg, "kv_role", None),
               "kv_connector_extra_config": getattr(cfg, "kv_connector_extra_config", None)}
    extra = cfg.get("kv_connector_extra_config") or {}
    # Under vLLM's MultiConnector (a CPU tier beside NIXL) the NIXL child's own settings say it.
    children = [c for c in extra.get("connectors") or () if isinstance(c, dict)]
    bidirectional = any(bool((c.get("kv_connector_extra_config") or {}).get("bidirectional_kv_xfer"))
                        for c in [cfg, *children])
    return cfg.get("kv_role"), bidirectional


def add_routes(app: Any, args: Any) -> str:
    if not hasattr(app, "include_router"):
        return "none (the app has no include_router)"
    tokens = api_tokens(args)
    # A server with a CPU KV tier (engine/tier.py), whatever its role: its occupancy for `status`.
    with_tier = tier.has_tier(args)
    if with_tier:
        app.include_router(tier.make_router(lambda header: authorized(header, tokens)))
    role, bidirectional = server_role(args)
    if not bidirectional or role not in ("kv_consumer", "kv_both"):
        return (f"{tier.PATH}; " if with_tier else "") + \
            f"none (kv_role {role}, bidirectional_kv_xfer {bidirectional}: not a decode server holding turns)"
    app.include_router(make_router(tokens))
    import os
    guard = " (control token required)" if os.environ.get(CONTROL_TOKEN_ENV) else \
        " (API key required)" if tokens else " (open: no control token nor API key)"
    return (f"{tier.PATH}, " if with_tier else "") + f"{PATH}, {PATH}/release, {PATH}/renew" + guard


def _adding_routes(fn, app_and_args):
    """`fn` (a vLLM function that builds or fills the app), then the routes on that app; `app_and_args` finds
    them from fn's arguments and result. Never keeps the server from starting."""
    if getattr(fn, "pdserve_held", False):
        return fn

    def with_held(*args, **kwargs):
        result = fn(*args, **kwargs)
        try:
            app, server_args = app_and_args(args, result)
            print(f"pdserve-held: routes: {add_routes(app, server_args)}", flush=True)
        except Exception as e:      # never keep the server from starting
            print(f"pdserve-held: routes not added: {e!r}", flush=True)
        return result

    with_held.pdserve_held = True
    with_held.__wrapped__ = fn
    return with_held


def wrap_build_app(build_app):
    """0.32: build_app(args, ...) returns the app."""
    return _adding_routes(build_app, lambda args, app: (app, args[0]))


def wrap_attach_router(attach_router):
    """0.26: the models router's attach_router(app), which build_app calls with app.state.args set."""
    return _adding_routes(attach_router, lambda args, _: (args[0], args[0].state.args))


def patch_attach_router() -> bool:
    try:
        module = importlib.import_module(ROUTER_MODULE)
    except ImportError:
        return False
    if getattr(module, "attach_router", None) is None:
        return False
    module.attach_router = wrap_attach_router(module.attach_router)
    return True


def patch_build_app() -> bool:
    """Wrap build_app where it is defined and in every loaded module that imported it by name."""
    import sys
    try:
        module = importlib.import_module(APP_MODULE)
    except ImportError:
        return False
    original = getattr(module, "build_app", None)
    if original is None:
        return False
    if getattr(original, "pdserve_held", False):
        return True
    wrapped = wrap_build_app(original)
    for loaded in list(sys.modules.values()):
        # Only a module's own dict: getattr on lazy modules (transformers) would import things.
        if (getattr(loaded, "__dict__", None) or {}).get("build_app") is original:
            loaded.build_app = wrapped
    return True


def patch_held_kv() -> str:
    """Install the engine and worker methods and the API routes; a word for the entry's log line."""
    missing = held.missing_source()
    if missing:
        log.warning("pdserve held-KV control not installed, this vLLM lacks: %s", "; ".join(missing))
        return "no (vLLM lacks " + ", ".join(m.split(": ")[1] for m in missing) + ")"
    try:
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except ImportError as e:
        log.warning("pdserve held-KV control not installed: %s", e)
        return "no (no EngineCore/WorkerWrapperBase)"
    if not hasattr(EngineCore, "collective_rpc"):
        return "no (EngineCore has no collective_rpc)"
    try:
        order = held.patch_reaper_order()
    except (ImportError, held.Unsupported) as e:
        log.warning("pdserve held-KV control not installed: %s", e)
        return "no (the NIXL worker's expiry could not be kept in deadline order)"
    EngineCore.pdserve_held = held.engine_method
    EngineCore.pdserve_tier = tier.engine_method      # a CPU KV tier's occupancy (engine/tier.py)
    WorkerWrapperBase.pdserve_held_worker = held.worker_method
    if not (patch_build_app() or patch_attach_router()):
        log.warning("pdserve held-KV control: no %s.build_app nor %s.attach_router, so no HTTP routes",
                    APP_MODULE, ROUTER_MODULE)
        return "engine only (no build_app to add routes to)"
    return "yes" + (f" ({order})" if order else "")
