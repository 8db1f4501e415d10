"""Release and renew the KV blocks a decode server holds for P, on demand (issue 32).

With `bidirectional_kv_xfer`, vLLM's NIXL decode server (D) keeps every finished turn's KV blocks for
`decoder_kv_blocks_ttl` seconds so that P can read them for the next turn; only P's read (single use) or the
deadline frees them, and vLLM has no API for either. Held blocks cannot be evicted, so a D full of held turns
makes new turns wait for a timer. This module gives D's API server three endpoints (patched in by
pdserve/engine/entry.py, version-checked: absent pieces are logged and vLLM is left alone):

- `GET  /pdserve/held`: held turns, their deadlines and block counts.
- `POST /pdserve/held/release {"request_ids": [...], "grace": s}`: free them at now + grace (default: P's
  read margin, so a read P already started finishes first; 0 frees them at the engine's next step).
- `POST /pdserve/held/renew {"request_ids": [...], "ttl": s}`: deadline = max(deadline, now + ttl).

Ids are D's `remote_request_id` (the kv_transfer_params D returns for the turn). Deadlines are in D's clock,
the one of `remote_blocks_expiry_time` (perf_counter of D's engine core, where vLLM's handshake listener
answers P's clock probe), so a renewed deadline can be handed to P in place of the exported one.

Where the state lives (vLLM 0.32; see the tests for the checked facts):
- Scheduler (engine core): NixlBaseConnectorScheduler._reqs_need_send {req_id: deadline}, filled by
  request_finished() and handed to the workers (and emptied) by the next build_connector_meta().
- Worker: NixlBaseConnectorWorker._reqs_to_send {req_id: deadline in the worker's perf_counter}; a deadline
  reached there is freed by get_transfer_results() (_reap_expired_send_leases -> finished_sending, the
  scheduler frees the blocks); P's read notification frees it too (_get_new_notifs).
Release and renew change those deadlines (both places), so the freeing is vLLM's own expiry path.

The engine core runs a utility method added here (EngineCore.pdserve_held), which reaches the workers with
collective_rpc (WorkerWrapperBase.pdserve_held_worker); both run on the engine's own thread between steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import time
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("pdserve.engine")

PATH = "/pdserve/held"
ENGINE_METHOD = "pdserve_held"
WORKER_METHOD = "pdserve_held_worker"
MAX_TTL_S = 24 * 3600.0
MAX_GRACE_S = 600.0
MAX_IDS = 10_000
CALL_TIMEOUT_S = 30.0
# P declines a read of D's blocks when its deadline is this close (vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN):
# a read P has started is assumed to end within it, so a release waits as long by default.
P_READ_MARGIN_S = 5.0
CLOCK = "perf_counter of D's engine core (the clock of remote_blocks_expiry_time)"

# Source facts the code relies on (module, text): checked without importing NIXL.
REQUIRED_SOURCE = (
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "self._reqs_to_send"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "def _reap_expired_send_leases"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler", "self._reqs_need_send"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler", "remote_blocks_expiry_time"),
)
APP_MODULE = "vllm.entrypoints.launchers.app"   # defines build_app (0.32); importers are rebound too


class Unsupported(RuntimeError):
    """This vLLM lacks a piece the control needs (the message names it)."""


# -- engine side ---------------------------------------------------------------------------------------
def nixl_part(connector: Any, side: str) -> Any:
    """The connector_scheduler / connector_worker of a NIXL connector, also inside a MultiConnector."""
    if connector is None:
        return None
    part = getattr(connector, side, None)
    if part is not None:
        return part
    for sub in getattr(connector, "_connectors", None) or ():
        part = getattr(sub, side, None)
        if part is not None:
            return part
    return None


def worker_held(part: Any, op: str, request_ids: Iterable[str], seconds: float | None,
                now: float | None = None) -> dict[str, float]:
    """One worker's held entries as {request_id: seconds left} after `op` (list, release, renew).

    release: deadline = min(deadline, now + seconds); renew: deadline = max(deadline, now + seconds); only ids
    this worker holds are touched (an id P's read or the expiry freed meanwhile stays gone)."""
    to_send = getattr(part, "_reqs_to_send", None)
    if not isinstance(to_send, dict):
        raise Unsupported("the NIXL worker has no _reqs_to_send")
    processing = getattr(part, "_reqs_to_process", None)
    now = time.perf_counter() if now is None else now
    if op == "list":
        return {rid: deadline - now for rid, deadline in list(to_send.items())}
    left: dict[str, float] = {}
    for rid in request_ids:
        deadline = to_send.get(rid)
        if deadline is None or (processing is not None and rid not in processing):
            continue
        new = min(deadline, now + seconds) if op == "release" else max(deadline, now + seconds)
        to_send[rid] = new
        left[rid] = new - now
    return left


def worker_method(self, op: str, request_ids: list, seconds: float | None) -> dict[str, float]:
    """WorkerWrapperBase.pdserve_held_worker: runs in each worker process (collective_rpc)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        raise Unsupported("this worker has no KV connector")
    part = nixl_part(get_kv_transfer_group(), "connector_worker")
    if part is None:
        raise Unsupported("the KV connector is not NIXL's (no connector_worker)")
    return worker_held(part, op, request_ids, seconds)


def _blocks(scheduler: Any, rid: str) -> int | None:
    try:
        return sum(len(group) for group in scheduler.kv_cache_manager.get_block_ids(rid))
    except Exception:       # a count is informative only
        return None


def _is_p_lease(request: Any) -> bool:
    """P's own finished prefill, waiting for D to read it (not a turn D holds for P)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def engine_held(core: Any, op: str, request_ids: list | None, seconds: float | None) -> dict[str, Any]:
    """EngineCore.pdserve_held: the answer of one engine core (its clock, its workers)."""
    scheduler = getattr(core, "scheduler", None)
    part = nixl_part(getattr(scheduler, "connector", None), "connector_scheduler")
    if part is None:
        raise Unsupported("the engine has no NIXL scheduler connector")
    pending = getattr(part, "_reqs_need_send", None)
    if not isinstance(pending, dict):
        raise Unsupported("the NIXL scheduler has no _reqs_need_send")
    requests = getattr(scheduler, "requests", {})
    now = time.perf_counter()           # before the workers' clocks: answers err early, never late
    ids = list(dict.fromkeys(request_ids or ()))
    held_ids = [rid for rid in ids if rid in requests and not _is_p_lease(requests[rid])]
    ranks = core.collective_rpc(WORKER_METHOD, args=(op, held_ids, seconds))
    left: dict[str, float] = {}
    for rank in ranks:                  # every rank holds its share: the earliest deadline counts
        for rid, s in (rank or {}).items():
            left[rid] = min(s, left.get(rid, math.inf))
    deadlines = {rid: now + s for rid, s in left.items()}
    for rid in list(pending) if op == "list" else held_ids:
        if rid in deadlines or rid not in pending:
            continue
        # Finished this step: the workers get the deadline with the next step's metadata.
        if op == "release":
            pending[rid] = min(pending[rid], now + seconds)
        elif op == "renew":
            pending[rid] = max(pending[rid], now + seconds)
        deadlines[rid] = pending[rid]

    def entry(rid: str) -> dict[str, Any]:
        request = requests.get(rid)
        return {"deadline": deadlines[rid], "blocks": _blocks(scheduler, rid),
                "tokens": getattr(request, "num_computed_tokens", None)}

    answer: dict[str, Any] = {"now": now, "engine_id": getattr(part, "engine_id", None)}
    if op == "list":
        answer["held"] = {rid: entry(rid) for rid in deadlines
                          if not (rid in requests and _is_p_lease(requests[rid]))}
        return answer
    done = "released" if op == "release" else "renewed"
    results: dict[str, Any] = {}
    for rid in ids:
        if rid in deadlines:
            results[rid] = {"status": done, **entry(rid)}
        elif rid in requests and _is_p_lease(requests[rid]):
            results[rid] = {"status": "not_held", "reason": "a prefill lease (D reads it), not a held turn"}
        elif rid in requests:
            results[rid] = {"status": "not_held", "reason": "not finished or not holding blocks"}
        else:
            results[rid] = {"status": "unknown", "reason": "not held: read by P, expired, released or never held"}
    answer["results"] = results
    return answer


def engine_method(self, op: str, request_ids: list | None = None, seconds: float | None = None) -> dict:
    """EngineCore.pdserve_held (a utility call: runs on the engine core's thread between steps)."""
    return engine_held(self, op, request_ids, seconds)


def merge_answers(answers: list[dict[str, Any]], op: str) -> dict[str, Any]:
    """One answer from the engine cores' (data parallel: each holds its own requests, in its own clock)."""
    if len(answers) == 1:
        return answers[0]
    merged: dict[str, Any] = {"now": answers[0]["now"], "engine_id": answers[0].get("engine_id")}
    if op == "list":
        merged["held"] = {rid: {**e, "engine_id": a.get("engine_id")} for a in answers
                          for rid, e in a["held"].items()}
        return merged
    results: dict[str, Any] = {}
    for a in answers:
        for rid, r in a["results"].items():
            if "deadline" in r:         # the engine that holds it answers for it
                results[rid] = {**r, "engine_id": a.get("engine_id")}
            elif rid not in results or r["status"] == "not_held" and "deadline" not in results[rid]:
                results[rid] = r
    merged["results"] = results
    return merged


# -- API server side -----------------------------------------------------------------------------------
class BadRequest(ValueError):
    pass


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
    """The server's --api-key values (or VLLM_API_KEY), as vLLM's own middleware takes them: it guards only
    /v1, /v2, /inference and /cohere, so these routes check them themselves."""
    import os
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
    if isinstance(cfg, dict):
        role, extra = cfg.get("kv_role"), cfg.get("kv_connector_extra_config") or {}
    elif cfg is not None:
        role, extra = getattr(cfg, "kv_role", None), getattr(cfg, "kv_connector_extra_config", None) or {}
    else:
        return None, False
    return role, bool(extra.get("bidirectional_kv_xfer", False))


def add_routes(app: Any, args: Any) -> str:
    role, bidirectional = server_role(args)
    if not bidirectional or role not in ("kv_consumer", "kv_both"):
        return f"none (kv_role {role}, bidirectional_kv_xfer {bidirectional}: not a decode server holding turns)"
    if not hasattr(app, "include_router"):
        return "none (the app has no include_router)"
    tokens = api_tokens(args)
    app.include_router(make_router(tokens))
    return f"{PATH}, {PATH}/release, {PATH}/renew" + (" (API key required)" if tokens else "")


def wrap_build_app(build_app):
    if getattr(build_app, "pdserve_held", False):
        return build_app

    def build_app_with_held(args, *rest, **kwargs):
        app = build_app(args, *rest, **kwargs)
        try:
            print(f"pdserve-held: routes: {add_routes(app, args)}", flush=True)
        except Exception as e:      # never keep the server from starting
            print(f"pdserve-held: routes not added: {e!r}", flush=True)
        return app

    build_app_with_held.pdserve_held = True
    build_app_with_held.__wrapped__ = build_app
    return build_app_with_held


# -- install ---------------------------------------------------------------------------------------------
def missing_source() -> list[str]:
    """The REQUIRED_SOURCE facts this vLLM lacks (read from its files, nothing imported)."""
    missing = []
    for module, text in REQUIRED_SOURCE:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        try:
            source = open(origin, encoding="utf-8").read() if origin else ""
        except OSError:
            source = ""
        if text not in source:
            missing.append(f"{module}: {text}")
    return missing


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
    missing = missing_source()
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
    EngineCore.pdserve_held = engine_method
    WorkerWrapperBase.pdserve_held_worker = worker_method
    if not patch_build_app():
        log.warning("pdserve held-KV control: no %s.build_app, so no HTTP routes", APP_MODULE)
        return "engine only (no build_app to add routes to)"
    return "yes"
