"""Pure planning: a ClusterSpec in, the exact processes out (argv, added env, host, ports, health URL).

Nothing here starts a process or opens a socket, so every decision is unit-tested without either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.engine.names import CORES_ENV, DELAY_ENV, ENTRY_MODULE, VLLM_SERVER_MODULE
from pdserve.spec.load import ROLES, replica_devices, replica_ports
from pdserve.plan.records import MARKER_ENV, ClusterPlan, ProcessPlan, connect_host
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX, ClusterSpec, RoleSpec

KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}


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
    return {
        "kv_connector": kv.kv_connector,
        "kv_role": KV_ROLE[role],
        "kv_buffer_device": kv.kv_buffer_device,
        "kv_load_failure_policy": kv.kv_load_failure_policy,
        "kv_connector_extra_config": extra,
    }


def marker(cluster_dir: Path, process: str) -> str:
    """Unique per cluster state folder, so two PDSERVE_HOMEs with the same cluster name never mix."""
    return f"{cluster_dir}#{process}"


def _server_plan(spec: ClusterSpec, role_name: str, role: RoleSpec, i: int, python: str, model: str,
                 cluster_dir: Path) -> ProcessPlan:
    name = f"{role_name}-{i}"
    http_port, side_ports = replica_ports(role, i)
    delay = spec.nixl_progress_delay_us
    cpus = replica_devices(role.cpus, role.replicas, i)
    server = [python, "-m", ENTRY_MODULE if delay or cpus else VLLM_SERVER_MODULE]
    argv = [*(spec.server_command or server),
            "--model", model,
            "--served-model-name", spec.model_name,
            "--host", role.host,
            "--port", str(http_port),
            "--tensor-parallel-size", str(role.tensor_parallel_size),
            "--kv-transfer-config", json.dumps(kv_transfer_config(spec, role_name), separators=(",", ":")),
            *role.vllm_args]
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_ports[0]),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": connect_host(role.host),
    }
    gpus = replica_devices(role.gpus, role.replicas, i)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    if cpus:
        env[CORES_ENV] = ",".join(map(str, cpus))
    if delay:
        env[DELAY_ENV] = str(delay)
    if spec.model.startswith(BUILTIN_MODEL_PREFIX):
        env["HF_HUB_OFFLINE"] = "1"   # a locally built model: never ask a hub
    env.update(role.env)
    env[MARKER_ENV] = marker(cluster_dir, name)
    host = connect_host(role.host)
    env_from = {"VLLM_API_KEY": spec.router.api_key_env} if spec.router.api_key_env else {}
    return ProcessPlan(name=name, role=role_name, argv=argv, env=env, host=role.host, port=http_port,
                       health_url=f"http://{host}:{http_port}/health", side_channel_ports=side_ports,
                       env_from=env_from)


def build_plan(spec: ClusterSpec, *, python: str, cluster_dir: Path, models_dir: Path) -> ClusterPlan:
    """All processes of a cluster. `python` runs vLLM and the router; paths come from the state layout."""
    builtin = spec.model[len(BUILTIN_MODEL_PREFIX):] if spec.model.startswith(BUILTIN_MODEL_PREFIX) else None
    model = str(models_dir / builtin) if builtin else spec.model
    servers = [_server_plan(spec, r, getattr(spec, r), i, python, model, cluster_dir)
               for r in ROLES for i in range(getattr(spec, r).replicas)]
    router_cfg_path = str(cluster_dir / "router.json")
    router_config = {
        "cluster": spec.name,
        "host": spec.router.host,
        "port": spec.router.port,
        "model": spec.model_name,
        "prefill": [{"name": p.name, "url": p.url} for p in servers if p.role == "prefill"],
        "decode": [{"name": p.name, "url": p.url} for p in servers if p.role == "decode"],
        "reuse_ttl": spec.reuse_ttl,
        "kv_recompute_threshold": spec.kv_transfer.kv_recompute_threshold,
        "bidirectional_kv_xfer": spec.kv_transfer.bidirectional_kv_xfer,
        "request_timeout": spec.router.request_timeout,
        "api_key_env": spec.router.api_key_env,
        "cost_aware": spec.router.cost_aware,
        "prefill_policy": spec.router.prefill_policy,
        "breaker_failures": spec.router.breaker_failures,
        "breaker_cooldown": spec.router.breaker_cooldown,
        "max_body_bytes": int(spec.router.max_body_mb * 1024 * 1024),
        "health_interval": spec.supervisor.health_interval,
        # finish in-flight requests on SIGTERM, inside the supervisor's SIGTERM -> SIGKILL window
        "drain_timeout": max(1.0, spec.supervisor.stop_timeout - 2.0),
    }
    rhost = connect_host(spec.router.host)
    router = ProcessPlan(
        name="router", role="router",
        argv=[python, "-m", "pdserve.router", "--config", router_cfg_path],
        env={MARKER_ENV: marker(cluster_dir, "router")},
        host=spec.router.host, port=spec.router.port,
        health_url=f"http://{rhost}:{spec.router.port}/health")
    return ClusterPlan(name=spec.name, processes=[*servers, router], router_config=router_config,
                       router_config_path=router_cfg_path, builtin_model=builtin, model_path=model,
                       supervisor=spec.supervisor.model_dump())
