"""A server's CPU KV tier as `pdserve status` shows it (issue 43 item 3): its capacity and what it stores, read
from vLLM's OffloadingConnector (a role's kv_offloading_size: MultiConnector, NIXL first, then the tier) in the
engine core, the way D's held list is (engine/held.py: an EngineCore utility method; held_http.py: a route).

`GET /pdserve/tier` (the control token, as the held-KV routes) answers, summed over the engine cores:
{"capacity_tokens", "stored_tokens", "in_use_tokens", "capacity_chunks", "stored_chunks", "tokens_per_chunk"}.

Where the state lives: the OffloadingConnector's scheduler part (connector_scheduler) has `manager`, a
CPUOffloadingManager whose pool is counted in chunks of `config.kv_group_configs[i].tokens_per_chunk` tokens
(one chunk per KV-cache group): vLLM 0.26 names them blocks (_num_blocks, _num_allocated_blocks,
_num_evictable_cache_blocks), 0.32 chunks (_num_chunks, ...); both keep freed ones in _free_list. Stored:
allocated and not free (ready, being written, or being read); in use: stored and not evictable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pdserve.engine.held import CALL_TIMEOUT_S, Unsupported, is_nixl

PATH = "/pdserve/tier"
ENGINE_METHOD = "pdserve_tier"
# (capacity, allocated, evictable) attribute names of CPUOffloadingManager: vLLM 0.32, then 0.26
POOL_NAMES = (("_num_chunks", "_num_allocated_chunks", "_num_evictable_cache_chunks"),
              ("_num_blocks", "_num_allocated_blocks", "_num_evictable_cache_blocks"))
FIELDS = ("capacity_tokens", "stored_tokens", "in_use_tokens", "capacity_chunks", "stored_chunks")


def offloading_part(connector: Any) -> Any:
    """The scheduler part of the CPU tier's connector (one with a `manager`), also inside a MultiConnector."""
    for sub in [connector, *(getattr(connector, "_connectors", None) or ())]:
        part = getattr(sub, "connector_scheduler", None)
        if sub is not None and not is_nixl(sub) and getattr(part, "manager", None) is not None:
            return part
    return None


def tier_state(part: Any) -> dict[str, int]:
    """Capacity and occupancy of one engine's CPU tier, in chunks and in tokens (all KV-cache groups together:
    a token's KV takes one chunk per group)."""
    manager = part.manager
    for capacity_name, allocated_name, evictable_name in POOL_NAMES:
        if isinstance(getattr(manager, capacity_name, None), int):
            break
    else:
        raise Unsupported(f"the CPU tier's manager ({type(manager).__name__}) has no chunk pool")
    free = getattr(manager, "_free_list", None)
    if not isinstance(free, list):
        raise Unsupported(f"the CPU tier's manager ({type(manager).__name__}) has no _free_list")
    groups = getattr(getattr(part, "config", None), "kv_group_configs", None) or ()
    per_chunk = {getattr(g, "tokens_per_chunk", None) for g in groups}
    if len(per_chunk) != 1 or not isinstance(next(iter(per_chunk)), int):
        raise Unsupported("the CPU tier's groups do not share one tokens_per_chunk")
    tokens_per_chunk, n_groups = per_chunk.pop(), len(groups)
    capacity = getattr(manager, capacity_name)
    stored = getattr(manager, allocated_name) - len(free)
    in_use = max(0, stored - int(getattr(manager, evictable_name, 0) or 0))
    return {"capacity_chunks": capacity, "stored_chunks": stored, "tokens_per_chunk": tokens_per_chunk,
            "capacity_tokens": capacity * tokens_per_chunk // n_groups,
            "stored_tokens": stored * tokens_per_chunk // n_groups,
            "in_use_tokens": in_use * tokens_per_chunk // n_groups}


def engine_method(self) -> dict[str, int]:
    """EngineCore.pdserve_tier (a utility call: runs on the engine core's thread between steps)."""
    part = offloading_part(getattr(getattr(self, "scheduler", None), "connector", None))
    if part is None:
        raise Unsupported("the engine has no CPU KV tier (OffloadingConnector)")
    return tier_state(part)


def merge(answers: list[dict[str, int]]) -> dict[str, int]:
    """The engine cores' tiers (data parallel: each its own) added up."""
    out = {k: sum(a[k] for a in answers) for k in FIELDS}
    out["tokens_per_chunk"] = answers[0]["tokens_per_chunk"]
    return out


# -- the API server's route -----------------------------------------------------------------------------
def has_tier(args: Any) -> bool:
    """The server's --kv-transfer-config (object, dict or JSON) names an OffloadingConnector (top level, or a
    MultiConnector child, as pdserve's plan writes a role's kv_offloading_size)."""
    cfg = getattr(args, "kv_transfer_config", None)
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            return False
    if cfg is not None and not isinstance(cfg, dict):
        cfg = {"kv_connector": getattr(cfg, "kv_connector", None),
               "kv_connector_extra_config": getattr(cfg, "kv_connector_extra_config", None)}
    if not cfg:
        return False
    children = (cfg.get("kv_connector_extra_config") or {}).get("connectors") or ()
    return any(isinstance(c, dict) and c.get("kv_connector") == "OffloadingConnector" for c in [cfg, *children])


async def handle(engine_client: Any) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body); never raises."""
    core = getattr(engine_client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    call_one = getattr(core, "call_utility_async", None)
    try:
        if call_all is None and call_one is None:
            raise Unsupported("the engine client has no utility call (engine_core.call_utility_async)")
        coro = call_all(ENGINE_METHOD) if call_all is not None else call_one(ENGINE_METHOD)
        result = await asyncio.wait_for(coro, CALL_TIMEOUT_S)
        return 200, merge(result if call_all is not None else [result])
    except TimeoutError:
        return 503, {"error": {"message": f"the engine did not answer in {CALL_TIMEOUT_S:g} s",
                               "type": "EngineTimeout", "code": 503}}
    except Exception as e:      # Unsupported here, or an engine-side failure (a plain Exception)
        return 501, {"error": {"message": f"CPU tier state unavailable: {e}", "type": "NotImplemented",
                               "code": 501}}


def make_router(allowed: Callable[[str | None], bool]):
    """The route; `allowed` checks the Authorization header (held_http's check: the control token)."""
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse
    router = APIRouter()

    async def tier(request: Request):
        if not allowed(request.headers.get("Authorization")):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        status, payload = await handle(getattr(request.app.state, "engine_client", None))
        return JSONResponse(payload, status_code=status)

    tier.__annotations__ = {"request": Request}   # this module's annotations are strings (postponed)
    router.add_api_route(PATH, tier, methods=["GET"])
    return router
