"""What NIXL's transport needs that its defaults do not give: environment pdserve sets for every server,
each with the reason `pdserve plan` prints. The user's own env (host or role) always wins.

UCX turns CUDA-IPC GET zero-copy off on GPUs it sees no active NVLink on, and NIXL's READ is a GET. P and
D on one GPU, or on PCIe-only GPUs (L4, L40S, A10), then move KV through UCX's TCP software emulation.
Later NIXL releases set it too and, like pdserve, leave a variable the environment already has (history
in docs/gpu.md).

Over CUDA IPC each server maps its peer's KV cache (D reads P's blocks, P pulls D's). UCX keeps those
mappings in a per-peer cache (on: a 36k pull ~10 ms faster alone, ~100 ms p50 under load on an H200) that
nothing releases when the peer dies (UCX 1.22 closed it at endpoint teardown and reverted that, openucx/ucx
#11335, #11744): a crashed server's GPU memory stayed held by the survivor. pdserve's engine entry drops a dead
peer's mappings itself (engine/ipc_sweep.py), and turns the cache off on a UCX build it has not checked
(docs/operations.md, "A dead peer's CUDA IPC mappings").
"""

from __future__ import annotations

from pdserve.plan.records import EnvDefault
from pdserve.spec.schema import ClusterSpec


GET_ZCOPY = EnvDefault(
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y",
    "UCX disables CUDA-IPC GET zero-copy where it sees no NVLink (one shared GPU, PCIe-only GPUs) and NIXL's "
    "READ is a GET: without it KV moves through UCX's TCP emulation, slower than recomputing (docs/gpu.md)")


IPC_CACHE = EnvDefault(
    "UCX_CUDA_IPC_CACHE", "y",
    "each server maps its peer's KV cache over CUDA IPC once, not per transfer; a crashed peer's mappings are "
    "dropped by the survivor's engine entry, which turns the cache off on a UCX build it has not checked "
    "(docs/operations.md)")


def transport_settings(spec: ClusterSpec) -> list[EnvDefault]:
    """The settings every server of this cluster gets unless its env says otherwise."""
    kv = spec.kv_transfer
    if kv.kv_buffer_device == "cuda" and "UCX" in kv.backends:
        return [GET_ZCOPY, IPC_CACHE]
    return []
