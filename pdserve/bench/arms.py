"""The benchmark's arms: one cluster.yaml per arm, derived from the user's file.

- on:           bidirectional_kv_xfer on, P's prefix cache off (every reused token must come from D), every
                turn P then D (`router.decode_only` off)
- timer:        as on, with `router.held_kv` off: D keeps every finished turn's KV for its fixed timer
                (`decoder_kv_blocks_ttl`) instead of the router's budget, as before issue 32; `--arms timer,on`
                compares the two on a workload that holds more KV than D has (configs/bench-cpu-many.yaml)
- local:        as on, with short follow-up turns served on the holder D alone (`router.decode_only` on,
                the shipped default): no P leg for them, and the next long turn's P still pulls from D
- both:         as on, with P's prefix cache on and the config's CPU tier kept (`kv_offloading_size`): the agent
                configs' own setting, where P computes the shared preamble once and D->P pulls only what P's
                caches (GPU, then host memory) lack
- off:          bidirectional_kv_xfer off, P's prefix cache off (P recomputes the whole history)
- prefix-cache: bidirectional_kv_xfer off, P's prefix cache on (what users run today: P caches prompts
                but never sees D's answers)
- affinity:     as prefix-cache, with pdserve's router pinning each conversation to one prefill server
                (`router.prefill_policy: affinity`): the sticky-session baseline
- vllm-router:  the same servers as prefix-cache, measured through vllm-router (PD mode, NIXL, prefill
                policy cache_aware) instead of pdserve's router; `bench` runs it (see vrouter.py)

Every arm but timer keeps the config's `router.held_kv` (on unless the file turns it off). The arms that turn
P's prefix cache off (on, timer, local, off) also drop the CPU KV tier (`kv_offloading_size`) from P and D:
vLLM's tier is keyed by the prefix cache's block hashes, so it needs prefix caching, and without it on P
these arms measure D->P reuse (or recompute) alone, as before the tier. The others (both, prefix-cache,
affinity, vllm-router) keep the config's tier: P's prefix cache + CPU tier is the anchors' baseline.
The router's cost model is turned off in every arm: the arms measure the feature itself, and the cost
model could only ever switch `on` to the `off` behaviour.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve.errors import PdserveError
from pdserve.orchestrate import ops
from pdserve.router.config import AFFINITY, LEAST_LOADED

ARMS = ("on", "timer", "local", "both", "off", "prefix-cache", "affinity", "vllm-router")
REUSE_ARMS = ("on", "timer", "local", "both")    # bidirectional_kv_xfer on
PREFIX_CACHE_ARMS = ("both", "prefix-cache", "affinity", "vllm-router")    # P's prefix cache on
OFFLOADING = "kv_offloading_size"     # a role's CPU KV tier (GiB), kept only where P's prefix cache is on
PREFIX_FLAGS = ("--enable-prefix-caching", "--no-enable-prefix-caching")


def arm_config(data: dict[str, Any], arm: str) -> dict[str, Any]:
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r} (known: {', '.join(ARMS)})")
    cfg = copy.deepcopy(data)
    cfg["name"] = f"{data['name']}-{arm}"
    kv = cfg.setdefault("kv_transfer", {})
    kv["bidirectional_kv_xfer"] = arm in REUSE_ARMS
    prefill = cfg.setdefault("prefill", {})
    args = [a for a in prefill.get("vllm_args", []) if a not in PREFIX_FLAGS]
    prefill["vllm_args"] = [*args, "--enable-prefix-caching" if arm in PREFIX_CACHE_ARMS
                            else "--no-enable-prefix-caching"]
    if arm not in PREFIX_CACHE_ARMS:
        for role in ("prefill", "decode"):
            if isinstance(cfg.get(role), dict):
                cfg[role].pop(OFFLOADING, None)
    router = cfg.setdefault("router", {})
    router["cost_aware"] = False
    router["prefill_policy"] = AFFINITY if arm == "affinity" else LEAST_LOADED
    router["decode_only"] = arm == "local"
    if arm == "timer":
        router["held_kv"] = False
    return cfg


@contextlib.contextmanager
def deployed(arm: str, config: Path) -> Iterator[None]:
    """One arm's cluster, up for the body and down after it, through the same library `up` and `down` use."""
    try:
        result = ops.up(config, apply_to_running=False)
    except ops.StartFailed as failed:
        raise PdserveError(f"arm {arm}: {failed.message}: {' | '.join(failed.log_lines[-3:])}",
                           hint=f"`pdserve up {config}` to see it") from None
    try:
        yield
    finally:
        ops.down(result.name, result.stop_timeout, strict=False)
