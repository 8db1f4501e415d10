"""cluster.yaml -> ClusterSpec, with every problem reported as `field.path: what is wrong`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pdserve.errors import ConfigError
from pdserve.router.kv.store import MEMORY, STORES, scheme
from pdserve.spec.canary_size import canary_tokens_at_least
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX, MANAGED_STORE, RESERVED_VLLM_FLAGS, ClusterSpec, RoleSpec
from pdserve.roles import SERVER_ROLES
from pdserve.spec.topology import ROUTER_MACHINE, apply_platform, port_key, topology_problems
# Shipped configs travel inside the package (the top-level configs/ links here), so a wheel has them.
SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = SHIPPED_CONFIGS / "local-cpu.yaml"


class SpecErrors(ConfigError):
    """All problems of one file; `problems` holds one line each."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        first = problems[0] if len(problems) == 1 else f"{len(problems)} problems: " + "; ".join(problems)
        super().__init__(f"{source}: {first}", hint="see the config reference in README.md (or `pdserve schema`)")


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _pydantic_problems(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        where = _loc(e["loc"])
        if e["type"] == "extra_forbidden":
            problems.append(f"{where}: unknown field")
        elif e["type"] == "missing":
            problems.append(f"{where}: required field is missing")
        else:
            got = e.get("input")
            shown = f" (got {got!r})" if isinstance(got, (str, int, float, bool)) and len(repr(got)) < 60 else ""
            problems.append(f"{where}: {e['msg']}{shown}")
    return problems


def replica_ports(role: RoleSpec, i: int) -> tuple[int, list[int]]:
    """HTTP port and the side-channel ports that replica i of a role reserves."""
    tp = role.tensor_parallel_size
    base = role.nixl_side_channel_port + i * tp
    return role.port + i, list(range(base, base + tp))


def replica_devices(devices: list[int] | None, replicas: int, i: int) -> list[int]:
    if not devices:
        return []
    per = len(devices) // replicas
    return devices[i * per:(i + 1) * per]


def is_model_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def store_problems(spec: ClusterSpec) -> list[str]:
    store, replicas = spec.router.store, spec.router.replicas
    if store != MANAGED_STORE and scheme(store) not in STORES:
        return [f"router.store: {store!r} is not {MANAGED_STORE}, {MEMORY} or a URL of "
                + ", ".join(f"{s}://" for s in STORES if s != MEMORY)]
    if replicas > 1 and store == MEMORY:
        return [f"router.replicas: {replicas} routers cannot share the memory store (each would hold its own "
                f"part of the conversations); set router.store to {MANAGED_STORE} or redis://HOST:PORT/DB"]
    return []


def semantic_problems(spec: ClusterSpec) -> list[str]:
    """Checks that need the whole topology: clashes between servers, device splits, reserved flags."""
    problems: list[str] = []
    ports: dict[tuple[str, int], str] = {}
    devices: dict[tuple[str, str, int], str] = {}

    def claim_port(host: str, port: int, owner: str, field: str) -> None:
        host = "*" if host in ("0.0.0.0", "::") else host
        clash = next((o for (h, p), o in ports.items() if p == port and (h == host or "*" in (h, host))), None)
        if clash:
            problems.append(f"{field}: {port} is already used by {clash}")
        else:
            ports[(host, port)] = owner

    # With hosts:, the router runs on the machine of `pdserve up`, apart from every host's ports.
    router_machine = ROUTER_MACHINE if spec.hosts else spec.router.host
    claim_port(router_machine, spec.router.port, "router", "router.port")
    for i in range(spec.router.replicas if spec.router.replicas > 1 else 0):
        claim_port(router_machine, spec.router.replica_port(i), f"router[{i}]", "router.replicas")
    if spec.router.store == MANAGED_STORE:
        claim_port(ROUTER_MACHINE if spec.hosts else "127.0.0.1", spec.router.managed_store_port, "the managed Redis",
                   "router.store_port")
    problems += store_problems(spec)
    problems += topology_problems(spec)
    if problems:
        return problems     # host references must resolve before ports can be placed on hosts
    for role_name in SERVER_ROLES:
        role: RoleSpec = getattr(spec, role_name)
        for flag in role.vllm_args:
            name = flag.split("=", 1)[0]
            if name in RESERVED_VLLM_FLAGS:
                problems.append(f"{role_name}.vllm_args: {name} is set by pdserve from the topology; remove it")
        for kind in ("gpus", "cpus"):
            devs = getattr(role, kind)
            if devs is None:
                continue
            need = role.replicas * (role.tensor_parallel_size if kind == "gpus" else 1)
            if kind == "gpus" and len(devs) != need:
                problems.append(f"{role_name}.gpus: {len(devs)} given, need replicas x tensor_parallel_size = {need}")
            elif kind == "cpus" and (not devs or len(devs) % role.replicas):
                problems.append(f"{role_name}.cpus: {len(devs)} cores do not split evenly over {role.replicas} replicas")
        for i in range(role.replicas):
            owner = f"{role_name}[{i}]"
            http, side = replica_ports(role, i)
            where = port_key(spec, role, i)
            claim_port(where, http, owner, f"{role_name}.port")
            for p in side:
                claim_port(where, p, f"{owner} (nixl side channel)", f"{role_name}.nixl_side_channel_port")
            for kind in ("gpus", "cpus"):
                for dev in replica_devices(getattr(role, kind), role.replicas, i):
                    key = (where, kind, dev)
                    if key in devices and not (kind == "gpus" and spec.share_gpus):
                        problems.append(f"{role_name}.{kind}: {kind[:-1].upper()} {dev} is already used by {devices[key]}")
                    else:
                        devices[key] = owner
    problems += kv_problems(spec) + share_problems(spec) + mps_problems(spec)
    if spec.reuse_ttl >= spec.kv_transfer.decoder_kv_blocks_ttl:
        problems.append(f"router.reuse_ttl: {spec.reuse_ttl:g} must be below kv_transfer.decoder_kv_blocks_ttl "
                        f"({spec.kv_transfer.decoder_kv_blocks_ttl:g}): D frees its blocks after that")
    if spec.router.queue_size and not spec.router.max_in_flight:
        problems.append(f"router.queue_size: {spec.router.queue_size} needs router.max_in_flight (a queue waits "
                        "for a free slot under that cap; without it nothing ever waits)")
    if spec.router.max_buffered_mb < spec.router.max_body_mb:
        problems.append(f"router.max_buffered_mb: {spec.router.max_buffered_mb:g} is below router.max_body_mb "
                        f"({spec.router.max_body_mb:g}): a body of the size accepted would never fit (503)")
    if spec.router.tenant_burst and not spec.router.tenant_rate:
        problems.append("router.tenant_burst: needs router.tenant_rate (the bucket refills at that rate)")
    if spec.router.client_burst and not spec.router.client_rate:
        problems.append("router.client_burst: needs router.client_rate (the bucket refills at that rate)")
    if spec.model.startswith(BUILTIN_MODEL_PREFIX):
        from pdserve.engine.models import BUILTIN_MODELS  # light module: sizes only
        kind = spec.model[len(BUILTIN_MODEL_PREFIX):]
        if kind not in BUILTIN_MODELS:
            problems.append(f"model: unknown built-in model {spec.model!r} (known: "
                            + ", ".join(BUILTIN_MODEL_PREFIX + k for k in BUILTIN_MODELS) + ")")
    elif is_model_path(spec.model) and not Path(os.path.expanduser(spec.model)).exists():
        problems.append(f"model: path {spec.model} does not exist")
    return problems


def _max_model_len(args: list[str]) -> int | None:
    for i, a in enumerate(args):
        value = a.split("=", 1)[1] if a.startswith("--max-model-len=") else (
            args[i + 1] if a == "--max-model-len" and i + 1 < len(args) else None)
        if value is not None and value.isdigit():
            return int(value)
    return None


def kv_problems(spec: ClusterSpec) -> list[str]:
    """P/D KV-transfer combinations vLLM cannot serve."""
    problems = []
    kv = spec.kv_transfer
    if spec.decode.tensor_parallel_size < spec.prefill.tensor_parallel_size:
        problems.append(f"decode.tensor_parallel_size: {spec.decode.tensor_parallel_size} is below prefill's "
                        f"{spec.prefill.tensor_parallel_size}; NIXL P/D needs decode TP >= prefill TP")
    on_gpus = spec.prefill.gpus is not None or spec.decode.gpus is not None
    if on_gpus and kv.bidirectional_kv_xfer and kv.kv_buffer_device == "cpu":
        problems.append("kv_transfer.kv_buffer_device: cpu with bidirectional_kv_xfer on GPUs is not supported "
                        "(vLLM reads D->P only from device buffers); use cuda")
    problems += tier_problems(spec)
    for role_name in SERVER_ROLES:
        limit = _max_model_len(getattr(spec, role_name).vllm_args)
        if not kv.bidirectional_kv_xfer or limit is None:
            continue
        canary = canary_tokens_at_least(kv.kv_recompute_threshold,
                                       spec.router.decode_only_max_tokens if spec.router.decode_only else 0)
        if kv.kv_recompute_threshold >= limit:
            problems.append(f"kv_transfer.kv_recompute_threshold: {kv.kv_recompute_threshold} is not below "
                            f"{role_name}'s --max-model-len {limit}: nothing would ever be reused")
        elif spec.supervisor.canary and canary > limit:
            problems.append(f"kv_transfer.kv_recompute_threshold: {kv.kv_recompute_threshold} leaves the canary "
                            f"no room to prove the D->P pull within {role_name}'s --max-model-len {limit} (its "
                            f"second turn takes at least {canary} tokens); lower the threshold or set supervisor.canary: false")
    return problems


def tier_problems(spec: ClusterSpec) -> list[str]:
    """A CPU KV tier (kv_offloading_size) as vLLM can run it beside NIXL."""
    problems = []
    for role_name in SERVER_ROLES:
        role: RoleSpec = getattr(spec, role_name)
        flags = {a.split("=", 1)[0] for a in role.vllm_args}
        for flag in sorted(flags & {"--kv-offloading-size", "--kv-offloading-backend"}):
            problems.append(f"{role_name}.vllm_args: {flag} replaces the NixlConnector pdserve configures (vLLM "
                            f"sets its own connector); use {role_name}.kv_offloading_size (GiB) instead")
        if not role.kv_offloading_size:
            continue
        if spec.kv_transfer.kv_buffer_device != "cuda":
            problems.append(f"{role_name}.kv_offloading_size: a CPU tier copies GPU blocks to host memory; with "
                            "kv_transfer.kv_buffer_device cpu the KV cache already lives there (remove it)")
        if "--no-enable-prefix-caching" in flags:
            problems.append(f"{role_name}.kv_offloading_size: vLLM's CPU tier is keyed by prefix-cache hashes; "
                            f"remove --no-enable-prefix-caching from {role_name}.vllm_args")
    return problems


def parse_spec(data: Any, source: str = "cluster.yaml") -> ClusterSpec:
    if not isinstance(data, dict):
        raise SpecErrors(source, ["(top level): expected a mapping of fields (name, model, prefill, decode, ...)"])
    try:
        spec = ClusterSpec.model_validate(apply_platform(data))
    except ValidationError as err:
        raise SpecErrors(source, _pydantic_problems(err)) from None
    problems = semantic_problems(spec)
    if problems:
        raise SpecErrors(source, problems)
    return spec


def load_spec(path: str | Path) -> ClusterSpec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}", hint="check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}:{where}: invalid YAML: {problem}", hint="fix the YAML syntax") from None
    # Relative model paths are relative to the config file, like every other tool that reads one.
    if isinstance(data, dict) and isinstance(data.get("model"), str) and data["model"].startswith(("./", "../")):
        data["model"] = str((path.parent / data["model"]).resolve())
    return parse_spec(data, str(path))


SHARED_GPU_BUDGET = 0.92     # vLLM's default utilization of a GPU it has alone, split between its sharers


def gpu_sharers(spec: ClusterSpec) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """(host, GPU) -> [(role, replica)] in start order."""
    out: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for role_name in SERVER_ROLES:
        role = getattr(spec, role_name)
        for i in range(role.replicas):
            for g in replica_devices(role.gpus, role.replicas, i):
                out.setdefault((port_key(spec, role, i), g), []).append((role_name, i))
    return out


def share_problems(spec: ClusterSpec) -> list[str]:
    """Explicit utilizations of servers sharing a GPU must fit in it together."""
    problems = []
    for (host, gpu), users in gpu_sharers(spec).items():
        if len(users) < 2:
            continue
        given = [getattr(spec, r).gpu_memory_utilization for r, _ in users]
        fixed = sum(u for u in given if u is not None)
        left = len([u for u in given if u is None])
        if fixed > SHARED_GPU_BUDGET or (left and fixed >= SHARED_GPU_BUDGET - 0.05 * left):
            role = next(r for r, _ in users if getattr(spec, r).gpu_memory_utilization is not None)
            problems.append(f"{role}.gpu_memory_utilization: servers sharing GPU {gpu} on {host} would use "
                            f"more than {SHARED_GPU_BUDGET:g} of it; lower it so they add up to at most that")
    return problems


def mps_problems(spec: ClusterSpec) -> list[str]:
    """gpu_sharing: mps runs one MPS control daemon on this machine for servers that share its GPUs."""
    if spec.gpu_sharing != "mps":
        return []
    if not spec.share_gpus:
        return ["gpu_sharing: mps is for servers sharing a GPU; set share_gpus: true (or gpu_sharing: time_slice)"]
    if spec.hosts or spec.launcher != "local":
        return ["gpu_sharing: mps runs its daemon on this machine only; remove hosts: and use launcher: local, "
                "or run MPS on those hosts yourself (CUDA_MPS_PIPE_DIRECTORY in env:)"]
    return []
