"""Runs vLLM's OpenAI API server with pdserve's runtime patches.

pdserve runs this module instead of `vllm.entrypoints.openai.api_server` whenever a patch is needed (see
plan/build.py): with `bidirectional_kv_xfer`, the reuse patches of engine/patches.py (streamed turns return
D's block handles; P reports the tokens it pulled from D apart from its own prefix cache) and engine/descs.py
(each NIXL read in as few descriptors as its blocks allow); and three fixes
for servers that share a host's CPU cores, when a server has its own `cpus:` or
`kv_transfer.nixl_progress_delay_us` is above 0. Without them, servers on a few shared cores
prefill many times slower and P's KV leases expire before D can read them (docs/operations.md):

- Cores (VLLM_CPU_OMP_THREADS_BIND, a plain list like "0" or "2,3"): the whole server (API server,
  engine core, workers) is pinned to them, so a neighbour's busy threads cannot land on them.
- NIXL's reserved KV core: vLLM's NIXL worker on CPU pins its main thread, which also runs the model,
  to the last core of each NUMA node, wherever the server's own cores are. Both P and D ended up on
  core 1. Here that reserved core is taken from the server's own cores.
- NIXL's progress thread (PDSERVE_NIXL_PROGRESS_DELAY_US): NIXL's Python API creates its agent with a
  delay of 0, a busy loop that holds one core per worker even when idle. Here it sleeps between polls.

Every shared-memory segment the server's processes create is named after the server, and what a dead server
left is unlinked when the next one starts (engine/shm_names.py). On GPUs, with UCX's CUDA IPC mapping cache on,
the process that creates NIXL's agent also drops the mappings it holds of a peer that died (engine/ipc_sweep.py),
so the peer's GPU memory is freed for its restart.

The patches run when this module is a process's main module: as `python -m pdserve.engine.entry`, and as
`__mp_main__` in the engine core and workers, which vLLM starts with multiprocessing's spawn, so every
process of the server gets them. Importing it changes nothing.

With the reuse patches the server also gets `--enable-scale-out` (when its CLI has it and the command line
does not say either way): the router checks a new turn's tokens with `/v1/messages/render`,
`/v1/responses/render` and `/v1/chat/completions/render`, which vLLM registers only with that flag. It
registers `/inference/v1/generate` too: like every other endpoint of these servers, not for clients. It also
gets `--enable-request-id-headers` (the same way): vLLM then echoes each request's X-Request-Id on the answer,
by which the router's HTTP client tells an answer to another request from its own (docs/router.md).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import runpy
import sys

from pdserve.engine.names import (CORES_ENV, DELAY_ENV, FORK_ENV, MARKER_ENV, REUSE_PATCHES_ENV, UCX_LEAK_GUARD,
                                  VLLM_SERVER_MODULE)


def own_cores(bind: str | None) -> list[int]:
    """The cores of a one-rank VLLM_CPU_OMP_THREADS_BIND ("0", "2,3", "4-7"); [] for auto, nobind or
    several ranks ("0-3|4-7"), which vLLM binds itself."""
    if not bind or "|" in bind or bind in ("auto", "nobind"):
        return []
    cores: list[int] = []
    for part in bind.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return []
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def pin_to_own_cores() -> list[int]:
    cores = own_cores(os.environ.get(CORES_ENV))
    if not cores:
        return []
    os.sched_setaffinity(0, cores)      # inherited by every process and thread started from here on
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.discover_numa_topology = classmethod(lambda cls: [[max(cores)]])
    return cores


def patch_nixl_progress_delay() -> int:
    """Make every NIXL agent created from now on use the delay from DELAY_ENV; returns it (0: untouched)."""
    delay = int(os.environ.get(DELAY_ENV) or 0)
    if delay <= 0:
        return 0
    os.environ.setdefault(*UCX_LEAK_GUARD)
    try:
        import nixl._api as nixl_api
    except ImportError:   # vLLM reports the missing NIXL itself
        return 0
    make_agent = nixl_api.nixlBind.nixlAgent
    if getattr(make_agent, "pdserve_delay_us", None) is not None:
        return delay

    def agent_with_delay(name, config):
        config.pthrDelay = delay
        return make_agent(name, config)

    agent_with_delay.pdserve_delay_us = delay
    nixl_api.nixlBind.nixlAgent = agent_with_delay
    return delay


SCALE_OUT_FLAG = "--enable-scale-out"
# Where FrontendArgs (the API server's own options) lives, newest layout first.
FRONTEND_ARGS_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")
# What the server process decided about SCALE_OUT_FLAG, for its spawned children's log line.
SCALE_OUT_STATE_ENV = "PDSERVE_ENTRY_SCALE_OUT"
# vLLM echoes each request's X-Request-Id on its answer: the router's HTTP client then tells an answer to
# another request (a stray one from a proxy or a broken server) from its own (docs/router.md, issue 35).
REQUEST_IDS_FLAG = "--enable-request-id-headers"
REQUEST_IDS_STATE_ENV = "PDSERVE_ENTRY_REQUEST_IDS"


def cli_knows(field: str) -> bool:
    """Whether this vLLM's API server has the option (a FrontendArgs field), whatever its version."""
    for module in FRONTEND_ARGS_MODULES:
        try:
            args_cls = importlib.import_module(module).FrontendArgs
        except (ImportError, AttributeError):
            continue
        if dataclasses.is_dataclass(args_cls):
            return field in {f.name for f in dataclasses.fields(args_cls)}
        return hasattr(args_cls, field)
    return False


def cli_knows_scale_out() -> bool:
    return cli_knows("enable_scale_out")


def flag_in(argv: list[str], flag: str) -> bool:
    """Whether the command line sets the option either way (--flag[=..], --no-flag; vLLM's parser also takes
    underscores)."""
    names = {flag, "--no-" + flag[2:]}
    return any(arg.split("=", 1)[0].replace("_", "-") in names for arg in argv[1:])


def scale_out_in(argv: list[str]) -> bool:
    return flag_in(argv, SCALE_OUT_FLAG)


def add_flag(argv: list[str], flag: str, knows) -> str:
    """Append `flag` to argv (in place) when absent and the CLI has it; says what was done."""
    if flag_in(argv, flag):
        return "as given"
    if not knows():
        return "not in this vLLM"
    argv.append(flag)
    return flag + " added"


def add_scale_out(argv: list[str], knows=cli_knows_scale_out) -> str:
    return add_flag(argv, SCALE_OUT_FLAG, knows)


def apply_reuse_patches(argv: list[str] | None = None) -> None:
    """The reuse patches; with argv (the server process's own), also the scale-out option."""
    if os.environ.get(REUSE_PATCHES_ENV) != "1":
        return
    from pdserve.engine import decode_stream, descs, held_http, patches, prompt_ids, segment_tokens, sync_pull
    streamed = patches.patch_streamed_kv_params()
    counted = patches.patch_pulled_token_counts()
    held_kv = held_http.patch_held_kv()    # D's held KV blocks: release/renew routes (engine/held*.py)
    message_stop = patches.patch_message_stop_kv_params()
    pull_order = descs.patch_pull_order() and descs.patch_free_order()   # NIXL reads in few descriptors
    ascending = descs.patch_alloc_order()   # each allocation's blocks upwards, as P's pulls expect
    forwarded_ids = prompt_ids.patch_forwarded_prompt_ids()   # D skips rendering what P tokenized
    pieces = segment_tokens.patch_segment_tokens()    # a follow-up's history is not tokenized again
    first_token = decode_stream.patch_decode_stream_prefill()   # nor decoded again for its first token
    in_step = sync_pull.patch_sync_pull()    # P's pull of D's KV inside the step that computes the turn
    if argv is not None:
        os.environ[SCALE_OUT_STATE_ENV] = add_scale_out(argv)
        os.environ[REQUEST_IDS_STATE_ENV] = add_flag(argv, REQUEST_IDS_FLAG,
                                                     lambda: cli_knows("enable_request_id_headers"))
    # One line in the server log says what this vLLM got (doctor and the e2e tests read it); the server's
    # children print the same line.
    print(f"pdserve-entry: streamed kv_transfer_params patched: {','.join(streamed) or 'none'}; "
          f"pulled-token counts: {'yes' if counted else 'no'}; "
          f"message_stop kv_transfer_params: {','.join(message_stop) or 'none'}; "
          f"render endpoints: {os.environ.get(SCALE_OUT_STATE_ENV, 'unknown')}; held KV: {held_kv}; "
          f"request ids: {os.environ.get(REQUEST_IDS_STATE_ENV, 'unknown')}; "
          f"reads in local order: {'yes' if pull_order else 'no'}; "
          f"allocations ascending: {'yes' if ascending else 'no'}; prompt ids from P: {forwarded_ids}; "
          f"tokenized-piece cache: {pieces}; decode stream from a prompt suffix: {first_token}; "
          f"pulls in the step: {in_step}", flush=True)


def name_shared_memory(server: bool) -> None:
    """Every segment this server's processes create is named after it (engine/shm_names.py); the server
    process itself first unlinks what its predecessor left, and what is left when it exits."""
    marker = os.environ.get(MARKER_ENV)
    if not marker:                     # not started by pdserve's supervisor
        return
    from pdserve.engine import shm_names
    prefix = shm_names.owner_prefix(marker)
    shm_names.name_created_segments(prefix)
    if server:
        left = shm_names.remove_left(prefix)
        if left:
            print(f"pdserve-shm: unlinked {len(left)} shared-memory segment(s) the previous server left: "
                  f"{', '.join(left)}", flush=True)
        atexit.register(shm_names.remove_left, prefix)


if __name__ in ("__main__", "__mp_main__"):      # the server itself, or a child spawn re-ran us in
    name_shared_memory(server=__name__ == "__main__")
    pin_to_own_cores()
    patch_nixl_progress_delay()
    from pdserve.engine import ipc_sweep
    ipc_sweep.patch_agent_start()
    apply_reuse_patches(sys.argv if __name__ == "__main__" else None)

if __name__ == "__main__":
    if os.environ.get(FORK_ENV) == "1":
        from pdserve.engine.fork_start import start_children_by_fork
        print(f"pdserve-fork: engine children by fork: {start_children_by_fork(sys.argv)}", flush=True)
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__")
