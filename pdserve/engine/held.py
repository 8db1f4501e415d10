"""Release and renew the KV blocks a decode server holds for P, on demand (issue 32).

With `bidirectional_kv_xfer`, vLLM's NIXL decode server (D) keeps every finished turn's KV blocks for
`decoder_kv_blocks_ttl` seconds so that P can read them for the next turn; only P's read (single use) or the
deadline frees them, and vLLM has no API for either. Held blocks cannot be evicted, so a D full of held turns
makes new turns wait for a timer. This module and held_http.py give D's API server three endpoints (patched in by
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

vLLM 0.26 differs in two places, both handled here: its worker frees expired entries from the front of
_reqs_to_send in get_finished() and stops at the first live one (it assumes insertion order is deadline order,
which a release or renewal breaks), so the worker's get_finished is wrapped to keep the dict in deadline order
first (keep_deadline_order); and its build_app lives in the API server module that runs as __main__, so the
routes are added by wrapping the models router's attach_router, which build_app imports when it runs.

The engine core runs a utility method added here (EngineCore.pdserve_held), which reaches the workers with
collective_rpc (WorkerWrapperBase.pdserve_held_worker); both run on the engine's own thread between steps.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "Releasing expired KV blocks for request"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler", "self._reqs_need_send"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler", "remote_blocks_expiry_time"),
)
APP_MODULE = "vllm.entrypoints.launchers.app"   # defines build_app (0.32); importers are rebound too
ROUTER_MODULE = "vllm.entrypoints.openai.models.api_router"   # attach_router(app), called by 0.26's build_app
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
WORKER_CLASS = "NixlBaseConnectorWorker"
# 0.26's reaper, which stops at the first live entry; 0.32's scans them all (_reap_expired_send_leases).
FRONT_REAPER = "Sorted dict, oldest requests are put first so we can exit early"


class Unsupported(RuntimeError):
    """This vLLM lacks a piece the control needs (the message names it)."""


# -- engine side ---------------------------------------------------------------------------------------
def is_nixl(connector: Any) -> bool:
    """vLLM's NIXL connectors (NixlConnector, NixlPullConnector, ...) by class, subclasses included."""
    return any("Nixl" in cls.__name__ for cls in type(connector).__mro__)


def nixl_part(connector: Any, side: str) -> Any:
    """The connector_scheduler / connector_worker of a NIXL connector, also inside a MultiConnector. A NIXL
    child is preferred: vLLM's OffloadingConnector (the CPU tier beside it) has a connector_scheduler too."""
    if connector is None:
        return None
    part = getattr(connector, side, None)
    if part is not None:
        return part
    children = list(getattr(connector, "_connectors", None) or ())
    for sub in sorted(children, key=lambda c: not is_nixl(c)):   # stable: NIXL children first, else in order
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
    if left:
        in_deadline_order(to_send)
    return left


def in_deadline_order(to_send: dict[str, float]) -> bool:
    """Reorder `to_send` (in place: vLLM holds the dict) by deadline, earliest first, where it is not: a
    reaper that stops at the first live entry (vLLM 0.26) then frees every expired one. True if it moved any."""
    deadlines = list(to_send.values())
    if all(a <= b for a, b in zip(deadlines, deadlines[1:])):
        return False
    ordered = sorted(to_send.items(), key=lambda item: item[1])
    to_send.clear()
    to_send.update(ordered)
    return True


def keep_deadline_order(get_finished):
    """The worker's get_finished with _reqs_to_send in deadline order first (vLLM 0.26): a turn the router
    released, or one released before its worker had it (appended behind later deadlines), is freed at the next
    step, not when the entries in front of it expire. O(n) per step over the held turns when in order."""
    if getattr(get_finished, "pdserve_held", False):
        return get_finished

    def get_finished_in_deadline_order(self, *args, **kwargs):
        to_send = getattr(self, "_reqs_to_send", None)
        if isinstance(to_send, dict) and len(to_send) > 1:
            in_deadline_order(to_send)
        return get_finished(self, *args, **kwargs)

    get_finished_in_deadline_order.pdserve_held = True
    get_finished_in_deadline_order.__wrapped__ = get_finished
    return get_finished_in_deadline_order


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


# -- install ---------------------------------------------------------------------------------------------
def _source(module: str) -> str:
    """A module's source text, read from its file without importing it ("" when there is none)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = getattr(spec, "origin", None)
    try:
        return open(origin, encoding="utf-8").read() if origin else ""
    except OSError:
        return ""


def missing_source() -> list[str]:
    """The REQUIRED_SOURCE facts this vLLM lacks (read from its files, nothing imported)."""
    return [f"{module}: {text}" for module, text in REQUIRED_SOURCE if text not in _source(module)]


def patch_reaper_order() -> str:
    """vLLM 0.26: wrap the NIXL worker's get_finished (keep_deadline_order). '' where not needed."""
    if FRONT_REAPER not in _source(WORKER_MODULE):
        return ""
    cls = getattr(importlib.import_module(WORKER_MODULE), WORKER_CLASS, None)
    if cls is None or not hasattr(cls, "get_finished"):
        raise Unsupported(f"{WORKER_MODULE} has no {WORKER_CLASS}.get_finished")
    cls.get_finished = keep_deadline_order(cls.get_finished)
    return "expiry in deadline order"
