"""`pdserve export kubernetes`: the plan of a cluster.yaml as Kubernetes objects (docs/kubernetes.md).

The servers' command lines and environments are the plan's own (plan/build.py), with only what the plan
marks as host-specific replaced; the router's config is the planner's router_config with each server at its
stable DNS name. What cannot mean the same on Kubernetes is refused naming its field (exit 2), or mapped by a
rule that `notes()` states for this config.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.errors import ConfigError, UsageError
from pdserve.export import Export
from pdserve.export.k8s_common import (DEFAULT_GPUS_PER_NODE, DEFAULT_IMAGE, DNS_LABEL, FORMATS, LWS_API,
                                       LWS_RELEASE, MAX_WORKLOAD_NAME, MODELS_DIR, PYTHON, REDIS_IMAGE, STATE_DIR,
                                       STORE_SECRET_SUFFIX, Target, k8s_base)
from pdserve.export.k8s_memory import derived, memory_of, parse_memory
from pdserve.export.k8s_router import router_objects, scrape_objects, store_objects, store_secret
from pdserve.export.k8s_servers import gpu_layout, server_objects
from pdserve.plan.build import build_plan
from pdserve.plan.records import CORES, GPUS, ProcessPlan
from pdserve.plan.routers import SECRET_FILE
from pdserve.roles import SERVER_ROLES
from pdserve.spec.load import is_model_path
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX, MANAGED_STORE, ClusterSpec, LauncherKind
from pdserve.spec.topology import PLATFORMS


def export_kubernetes(spec: ClusterSpec, *, namespace: str = "default", image: str | None = None,
                      fmt: str = FORMATS[0], gpus_per_node: int | None = None,
                      memory: list[str] | None = None) -> Export:
    """The cluster's objects in apply order: config maps, the servers (per server a StatefulSet under its
    role's headless Service, or a LeaderWorkerSet), the managed Redis, the router's Deployment and Service.
    `memory`: --memory ROLE=QUANTITY, each role's memory limit instead of the one derived (k8s_memory.py)."""
    if not DNS_LABEL.match(namespace) or len(namespace) > 63:
        raise UsageError(f"--namespace: {namespace!r} is not a Kubernetes namespace name",
                         hint="lower-case letters, digits and '-', at most 63, starting and ending alphanumeric")
    if fmt not in FORMATS:
        raise UsageError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    image = image or DEFAULT_IMAGE
    if any(c.isspace() for c in image):
        raise UsageError(f"--image: {image!r} is not an image reference")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node: {gpus_per_node} must be at least 1")
    overrides = parse_memory(memory)
    problems = kubernetes_problems(spec)
    if problems:
        first = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + "; ".join(problems)
        raise ConfigError(f"{spec.name}: {first}", hint="docs/kubernetes.md says how each field maps")
    # The plan as for any machine, but this one's memory unknown (CPU servers' default KV cache then 1 GiB):
    # a pod has its own.
    # Each server pod gets whole GPUs of its own: nothing shares one, so no MPS daemon (notes say so).
    plan = build_plan(spec.model_copy(update={"gpu_sharing": "time_slice"}), python=PYTHON,
                      cluster_dir=Path(STATE_DIR) / spec.name, models_dir=Path(MODELS_DIR), memory_gib=None)
    platform = PLATFORMS.get(spec.platform or "")
    t = Target(spec, plan, namespace, image, fmt,
               gpus_per_node or (platform.gpus_per_host if platform else DEFAULT_GPUS_PER_NODE), overrides)
    router = router_objects(t)      # ConfigMap, Deployment, Service
    documents = [router[0], *scrape_objects(t), *server_objects(t), *store_objects(t), *router[1:]]
    return Export(documents, notes(t))


def _is_loopback_url(url: str | None) -> bool:
    host = urlsplit(url or "").hostname or ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def kubernetes_problems(spec: ClusterSpec) -> list[str]:
    """What a valid cluster.yaml says that cannot mean the same in pods, one `field: why` line each."""
    problems = []
    base = k8s_base(spec.name)
    longest = max(len(f"{base}-{role}-{getattr(spec, role).replicas - 1}") for role in SERVER_ROLES)
    if longest > MAX_WORKLOAD_NAME:
        problems.append(f"name: {spec.name!r} makes object names of {longest} characters; Kubernetes allows "
                        f"{MAX_WORKLOAD_NAME} here (a StatefulSet's pods carry its name in a 63-character label): "
                        f"use a name of at most {len(base) - longest + MAX_WORKLOAD_NAME} characters")
    if spec.router.store != MANAGED_STORE and _is_loopback_url(spec.router.store):
        problems.append(f"router.store: {spec.router.store} is this machine's loopback, which a router pod does not "
                        f"reach; use {MANAGED_STORE} (a Redis Deployment) or a redis:// URL the pods reach")
    if _is_loopback_url(spec.observability.otlp_endpoint):
        problems.append(f"observability.otlp_endpoint: {spec.observability.otlp_endpoint} is this machine's "
                        "loopback: the pods' traces would go nowhere; give a collector the pods reach")
    return problems


def notes(t: Target) -> list[str]:
    """The mapping rules this config needed, one line each (the export prints them on stderr)."""
    spec, out = t.spec, []
    servers: list[ProcessPlan] = [p for p in t.plan.processes if p.role in SERVER_ROLES]
    if spec.hosts or spec.launcher != LauncherKind.LOCAL:
        out.append(f"launcher {spec.launcher} and hosts: the scheduler places the pods; host names, addresses and "
                   "ssh/Slurm settings are not used, a host's env stays in its servers' env")
    if any(CORES in p.host_specific for p in servers):
        out.append("cpus (VLLM_CPU_OMP_THREADS_BIND): core ids of one machine are dropped; each server requests "
                   "that many cores (requests = limits; cores of its own with the kubelet's static CPU manager and "
                   "a memory limit, docs/kubernetes.md)")
    if any(GPUS in p.host_specific for p in servers):
        out.append("gpus (CUDA_VISIBLE_DEVICES): device ids are dropped; each server requests its GPUs as "
                   "nvidia.com/gpu and the device plugin picks them")
    if spec.share_gpus:
        out.append("share_gpus: each server gets whole GPUs of its own; its planned --gpu-memory-utilization stays"
                   + ("; gpu_sharing mps: no MPS daemon (nothing shares a GPU)" if spec.gpu_sharing == "mps" else ""))
    if spec.platform:
        platform = PLATFORMS[spec.platform]
        out.append(f"platform {spec.platform}: GPU pods on {platform.instance_type} nodes with "
                   f"vpc.amazonaws.com/efa in proportion to their GPUs ({platform.efa_devices} a node) and the "
                   "preset's env")
    if spec.model.startswith(BUILTIN_MODEL_PREFIX):
        out.append(f"model {spec.model}: built in each server pod by an init container from the image "
                   f"(seed 0: byte-identical weights in every pod) into {MODELS_DIR}")
    elif is_model_path(spec.model):
        out.append(f"model {spec.model}: a path, read at the same path in the pods (bake it into the image or "
                   "mount a volume there)")
    if spec.server_command:
        out.append(f"server_command: runs as given, from the image ({' '.join(spec.server_command)})")
    if t.fmt == "lws":
        out.append(f"--format lws: LeaderWorkerSets ({LWS_API}) as LWS {LWS_RELEASE} defines them: install that "
                   "release's controller first (docs/kubernetes.md)")
    multi = [p.name for p in servers if gpu_layout(t, p)[0] > 1]
    if multi:
        out.append(f"{', '.join(multi)}: GPUs span nodes: a LeaderWorkerSet group per server, the leader with "
                   "vLLM's --nnodes/--node-rank/--master-addr, workers on vLLM's headless CLI (docs/kubernetes.md: "
                   "untested on real nodes)")
    out.append(f"router.host: the router binds 0.0.0.0 in its pods; Service {t.name('router')} is ClusterIP "
               "(expose it on purpose)")
    if spec.router.store == MANAGED_STORE:
        out.append(f"router.store managed: Redis ({REDIS_IMAGE}) as Deployment and Service {t.name('redis')}; a "
                   "NetworkPolicy admits only the router pods")
    if store_secret(t)[0]:
        secret = t.name(STORE_SECRET_SUFFIX)
        out.append(f"router.store: the store secret (the managed Redis's password; its hash names the cluster's "
                   f"keys) comes from Secret {secret}, key {SECRET_FILE}: kubectl create secret generic {secret} "
                   f"-n {t.namespace} --from-literal={SECRET_FILE}=\"requirepass $(openssl rand -hex 32)\"")
    out += memory_notes(t)
    if spec.router.api_key_env:
        out.append(f"router.api_key_env: the key comes from Secret {t.secret}, key {spec.router.api_key_env}: "
                   f"kubectl create secret generic {t.secret} -n {t.namespace} "
                   f"--from-literal={spec.router.api_key_env}=...")
    return out


def memory_notes(t: Target) -> list[str]:
    """Each process's memory requests = limits and where it comes from; the servers left without one."""
    given, bounds, unbounded = [], [], []
    for p in t.plan.processes:
        gpus = gpu_layout(t, p)[1] if p.role in SERVER_ROLES else 0
        quantity = memory_of(t.spec, t.memory, p, gpus)
        if p.role in t.memory:
            plan = derived(t.spec, p, gpus)
            given.append(f"{p.name} {quantity}" + (f" (the plan's bound: {plan})" if plan else ""))
        elif quantity:
            bounds.append(f"{p.name} {quantity}")
        else:
            unbounded.append(p.name)
    out = []
    if given:
        out.append(f"memory (--memory): requests = limits {', '.join(given)}")
    if bounds:
        out.append(f"memory: requests = limits from the plan's bounds: {', '.join(bounds)} (router: "
                   "max_buffered_mb + reuse_max_mb in memory + a baseline; servers: KV cache + weights + a "
                   "baseline; docs/kubernetes.md)")
    if unbounded:
        out.append(f"memory: no limit for {', '.join(unbounded)}: the plan does not know their host memory (a GPU "
                   "server's, or the weights of a model it does not build); set one with --memory ROLE=QUANTITY "
                   "(e.g. --memory prefill=64Gi --memory decode=64Gi)")
    return out
