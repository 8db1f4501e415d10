"""The vLLM servers on Kubernetes: one workload per planned server (a StatefulSet of one pod, or a
LeaderWorkerSet of one group), whose container runs that server's planned argv and env with only the
host-specific values replaced (records.py): the image's Python, bind 0.0.0.0, the side-channel host from the
pod's IP, GPUs and cores as resource requests instead of device and core ids, and a memory limit
where the plan bounds one (k8s_memory.py).

One workload per server, not one per role, because the plan gives each server its own ports (on one machine
they must differ) and the router lists each by name: every pod then runs exactly its plan's command line.
"""

from __future__ import annotations

import math
from typing import Any

from pdserve.engine.entry import own_cores
from pdserve.errors import ConfigError
from pdserve.export.k8s_common import LWS_API, MODELS_DIR, PYTHON, Target, command_of, container_env, pod_spec
from pdserve.export.k8s_memory import memory_of, with_memory
from pdserve.plan.records import BIND, CORES, GPUS, MARKER, MODEL, PROGRAM, SIDE_CHANNEL_HOST, ProcessPlan
from pdserve.roles import ROUTER, SERVER_ROLES
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX
from pdserve.spec.topology import PLATFORMS

# vLLM's own CLI; `serve --headless` runs a worker node's ranks of a multi-node server (no API server).
VLLM_CLI = [PYTHON, "-m", "vllm.entrypoints.cli.main", "serve"]
DEFAULT_PROGRAM_LEN = 3     # [python, -m, module]: what PROGRAM marks when server_command is not set


def server_values(t: Target) -> dict[str, str | None]:
    """Host-specific kind -> its value in a pod (None: the variable is left out; the side-channel host comes
    from the pod's IP instead, in container_env)."""
    values: dict[str, str | None] = {PROGRAM: PYTHON, BIND: "0.0.0.0", SIDE_CHANNEL_HOST: None, GPUS: None,
                                     CORES: None, MARKER: None}
    if t.spec.model.startswith(BUILTIN_MODEL_PREFIX):
        values[MODEL] = f"{MODELS_DIR}/{builtin_kind(t)}"
    return values


def builtin_kind(t: Target) -> str:
    return t.spec.model[len(BUILTIN_MODEL_PREFIX):]


def gpu_layout(t: Target, proc: ProcessPlan) -> tuple[int, int]:
    """(pods, GPUs per pod) of one server: one pod while its GPUs fit a node, else a leader and workers
    (--format lws) of gpus_per_node each. A server has tensor_parallel_size GPUs (role.gpus holds that
    many per replica; without it, a server on cuda KV buffers still needs them); a CPU server none."""
    role = getattr(t.spec, proc.role)
    on_gpus = role.gpus is not None or t.spec.kv_transfer.kv_buffer_device == "cuda"
    gpus = role.tensor_parallel_size if on_gpus else 0
    if gpus <= t.gpus_per_node:
        return 1, gpus
    field = f"{proc.role}.tensor_parallel_size"
    if t.fmt != "lws":
        raise ConfigError(f"{field}: {gpus} GPUs per server do not fit one node of {t.gpus_per_node} GPUs; "
                          f"--format {t.fmt} runs each server in one pod",
                          hint="use --format lws (a leader and workers per server, LeaderWorkerSet), or a "
                               "tensor_parallel_size that fits one node (--gpus-per-node sets the node's size)")
    if gpus % t.gpus_per_node:
        raise ConfigError(f"{field}: {gpus} GPUs do not split into whole nodes of {t.gpus_per_node} GPUs",
                          hint=f"use a multiple of {t.gpus_per_node} (or set --gpus-per-node)")
    return gpus // t.gpus_per_node, t.gpus_per_node


def resources(t: Target, proc: ProcessPlan, gpus: int) -> dict[str, Any]:
    """GPUs (and, on an EFA platform, the node's EFA interfaces in proportion) and the cores the plan pinned
    the server to, as a count, and its memory (k8s_memory.py): requests = limits (extended resources allow
    nothing else; with whole cores and a memory limit the pod is Guaranteed and the static CPU manager gives
    it cores of its own)."""
    amounts: dict[str, int] = {}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
        platform = PLATFORMS.get(t.spec.platform or "")
        if platform and platform.efa_devices:
            amounts["vpc.amazonaws.com/efa"] = max(1, platform.efa_devices * gpus // platform.gpus_per_host)
    cores = own_cores(proc.host_value(CORES))
    if cores:
        amounts["cpu"] = len(cores)
    out = {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}
    return with_memory(out, memory_of(t.spec, t.memory, proc, gpus))


def probes(t: Target) -> dict[str, Any]:
    """The supervisor's timings as the kubelet's: startup_timeout as the startup budget, unhealthy_grace as
    the time an unanswered /health may last before a restart."""
    sup, get = t.spec.supervisor, {"path": "/health", "port": "http"}
    return {
        "startupProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": max(1, math.ceil(sup.startup_timeout / 10))},
        "readinessProbe": {"httpGet": get, "periodSeconds": max(1, round(sup.health_interval)), "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": max(1, math.ceil(sup.unhealthy_grace / 10))},
    }


def server_container(t: Target, proc: ProcessPlan, gpus: int, *, nodes: int = 1, worker: bool = False) -> dict:
    """The container of one server pod: its plan's argv and env (host-specific values replaced); in a group of
    `nodes` pods, the leader adds vLLM's multi-node flags and a worker runs vLLM's headless CLI with them."""
    command = command_of(proc, server_values(t))
    if nodes > 1:
        rank = "$(LWS_WORKER_INDEX)" if worker else "0"
        command += ["--nnodes", str(nodes), "--node-rank", rank, "--master-addr", "$(LWS_LEADER_ADDRESS)"]
        if worker:
            # pdserve's default program runs vLLM's API server module, which has no headless mode: a worker
            # runs vLLM's CLI with the same flags (a server_command of the user's runs as given)
            if PROGRAM in proc.host_specific:
                command = [*VLLM_CLI, *command[DEFAULT_PROGRAM_LEN:]]
            command.append("--headless")
    container: dict[str, Any] = {
        "name": "vllm", "image": t.image, "command": command,
        "env": container_env(t, proc, server_values(t)),
        "ports": [] if worker else [{"name": "http", "containerPort": proc.port},
                                    *({"name": f"nixl-{i}", "containerPort": p}
                                      for i, p in enumerate(proc.side_channel_ports))],
        "resources": resources(t, proc, gpus),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *model_mounts(t)],
    }
    if not worker:
        container.update(probes(t))
    return {k: v for k, v in container.items() if v not in ([], {})}


def model_mounts(t: Target) -> list[dict[str, Any]]:
    return [{"name": "models", "mountPath": MODELS_DIR}] if t.spec.model.startswith(BUILTIN_MODEL_PREFIX) else []


def host_resources(container: dict[str, Any]) -> dict[str, Any]:
    """A container's cpu and memory requests and limits alone (no GPU or EFA device), or nothing."""
    out = {k: {r: v for r, v in container.get("resources", {}).get(k, {}).items() if r in ("cpu", "memory")}
           for k in ("requests", "limits")}
    return {"resources": out} if out["limits"] else {}


def server_pod(t: Target, proc: ProcessPlan, *, nodes: int, gpus: int, worker: bool = False) -> dict[str, Any]:
    """A pod template of one server (its leader, or a worker of its group)."""
    init = []
    container = server_container(t, proc, gpus, nodes=nodes, worker=worker)
    if t.spec.model.startswith(BUILTIN_MODEL_PREFIX):
        # Built in the pod from the image's pdserve: seed 0, so every pod gets byte-identical weights. Its
        # server's cores and memory (it runs before it, so the pod asks for no more; ~0.4 GiB for tiny): a
        # pod is Guaranteed only if every container, init ones too, has requests = limits.
        init.append({"name": "model", "image": t.image,
                     "command": [PYTHON, "-m", "pdserve.engine.models", builtin_kind(t), MODELS_DIR],
                     "volumeMounts": model_mounts(t), **host_resources(container)})
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if init:
        volumes.append({"name": "models", "emptyDir": {}})
    labels = t.labels(proc.role, proc.name)
    annotations = {} if worker else t.scrape_annotations(proc.port)
    spec = pod_spec(t, [container], volumes, init, gpus=gpus)
    meta: dict[str, Any] = {"labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def server_dns(t: Target, proc: ProcessPlan) -> str:
    """The server's stable name: its pod in a StatefulSet under the role's headless Service, or the leader of
    its LeaderWorkerSet under the Service LWS makes (named after it)."""
    workload = t.name(proc.name)
    subdomain = workload if t.fmt == "lws" else t.name(proc.role)
    return f"{workload}-0.{subdomain}.{t.namespace}.svc.cluster.local"


def role_service(t: Target, role: str) -> dict[str, Any]:
    """The headless Service that gives each server pod of a role its DNS name. Not-ready pods are listed
    too: the router's own health checks and breakers decide when a server takes turns, as with `pdserve up`."""
    return t.obj("v1", "Service", t.name(role), role, {
        "clusterIP": "None", "publishNotReadyAddresses": True,
        "selector": t.selector(role)})


def statefulset(t: Target, proc: ProcessPlan) -> dict[str, Any]:
    nodes, gpus = gpu_layout(t, proc)
    return t.obj("apps/v1", "StatefulSet", t.name(proc.name), proc.role, {
        "serviceName": t.name(proc.role), "replicas": 1, "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": t.selector(proc.role, proc.name)},
        "template": server_pod(t, proc, nodes=nodes, gpus=gpus)}, process=proc.name)


def leaderworkerset(t: Target, proc: ProcessPlan) -> dict[str, Any]:
    """One group: the leader runs the server (API, rank 0); workers, when its GPUs span nodes, run the other
    ranks headless. A restart of any pod recreates the group (vLLM's ranks start together)."""
    nodes, gpus = gpu_layout(t, proc)
    template: dict[str, Any] = {"size": nodes, "restartPolicy": "RecreateGroupOnPodRestart"}
    if nodes > 1:
        template["leaderTemplate"] = server_pod(t, proc, nodes=nodes, gpus=gpus)
        template["workerTemplate"] = server_pod(t, proc, nodes=nodes, gpus=gpus, worker=True)
    else:
        template["workerTemplate"] = server_pod(t, proc, nodes=1, gpus=gpus)
    return t.obj(LWS_API, "LeaderWorkerSet", t.name(proc.name), proc.role, {
        "replicas": 1, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": template}, process=proc.name)


# Pods of this label in any namespace may scrape the servers' /metrics: the Prometheus Operator's and the
# community Helm chart's server pods carry it (docs/kubernetes.md: another scraper needs a rule of its own).
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}


def servers_network_policy(t: Target) -> dict[str, Any]:
    """Clients reach the router only (issue 45): the servers admit the router pods and each other (the NIXL
    side channel and transfers, a server group's ranks: any port), and Prometheus on each server's HTTP port.
    Their OpenAI routes and D's held-KV control routes are then no client's to call."""
    servers = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": t.base},
                               "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                                     "values": list(SERVER_ROLES)}]}}
    return t.obj("networking.k8s.io/v1", "NetworkPolicy", t.name("servers"), "servers", {
        **servers, "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": t.selector(ROUTER)}}, servers]},
            {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": PROMETHEUS_POD}}],
             "ports": [{"port": "http", "protocol": "TCP"}]},
        ]})


def server_objects(t: Target) -> list[dict[str, Any]]:
    servers = [p for p in t.plan.processes if p.role in SERVER_ROLES]
    if t.fmt == "lws":
        return [*(leaderworkerset(t, p) for p in servers), servers_network_policy(t)]
    return [*(role_service(t, r) for r in SERVER_ROLES), *(statefulset(t, p) for p in servers),
            servers_network_policy(t)]
