"""Which host each server runs on, the platform presets, and the checks that need the host list.

Without `hosts:` a cluster is one machine, exactly as before: `role.host` is a bind address. With it,
`role.host` names a host (or one per replica) and ports only need to be unique per host.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from pdserve.roles import SERVER_ROLES
from pdserve.spec.schema import ClusterSpec, LauncherKind, RoleSpec

ROUTER_MACHINE = "(router)"   # port-clash key of the machine the router runs on (where `pdserve up` runs)


@dataclass(frozen=True)
class Platform:
    gpus_per_host: int
    backends: list[str]
    env: dict[str, str] = field(default_factory=dict)
    instance_type: str | None = None    # the cloud's name for the host (Kubernetes: node.kubernetes.io/instance-type)
    efa_devices: int = 0                # EFA interfaces per host (Kubernetes: vpc.amazonaws.com/efa)


# AWS P5en: 8 H200 per host, EFA between hosts. NIXL reaches EFA through its LIBFABRIC backend; libfabric
# must pick the efa provider (not tcp/sockets). vLLM forks workers after registering memory, hence fork-safe;
# device RDMA is on by default with libfabric >= 1.18 but harmless to state on p5-class hosts.
PLATFORMS = {
    "p5en-efa": Platform(
        gpus_per_host=8, backends=["LIBFABRIC"],
        env={"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"},
        instance_type="p5en.48xlarge", efa_devices=16),
}


def apply_platform(data: dict) -> dict:
    """The preset's defaults under what the file says (explicit settings win)."""
    preset = PLATFORMS.get(data.get("platform")) if isinstance(data.get("platform"), str) else None
    if preset is None:
        return data
    kv = data.get("kv_transfer")
    kv = dict(kv) if isinstance(kv, dict) else {}
    kv.setdefault("backends", list(preset.backends))
    return {**data, "kv_transfer": kv}


def platform_env(spec: ClusterSpec) -> dict[str, str]:
    return dict(PLATFORMS[spec.platform].env) if spec.platform else {}


def replica_host(spec: ClusterSpec, role: RoleSpec, i: int) -> str | None:
    """The host name replica i runs on; None without `hosts:` (this machine)."""
    if not spec.hosts:
        return None
    return role.host[i] if isinstance(role.host, list) else role.host


def port_key(spec: ClusterSpec, role: RoleSpec, i: int) -> str:
    """What ports must be unique within: the host name with `hosts:`, else the bind address."""
    name = replica_host(spec, role, i)
    return name if name is not None else role.host


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def topology_problems(spec: ClusterSpec) -> list[str]:
    problems: list[str] = []
    hosts = spec.hosts or []
    if spec.launcher != LauncherKind.LOCAL and not hosts:
        problems.append(f"hosts: launcher {spec.launcher} needs a hosts: list naming where servers run")
    if spec.launcher == LauncherKind.LOCAL and len(hosts) > 1:
        problems.append(f"launcher: local runs every server on this machine; {len(hosts)} hosts need ssh or slurm")
    seen: dict[str, int] = {}
    for i, h in enumerate(hosts):
        if h.name in seen:
            problems.append(f"hosts[{i}].name: {h.name!r} is already used by hosts[{seen[h.name]}]")
        seen.setdefault(h.name, i)
        if h.address in ("0.0.0.0", "::"):
            problems.append(f"hosts[{i}].address: {h.address} is not an address other hosts can reach")
    for role_name in SERVER_ROLES:
        role: RoleSpec = getattr(spec, role_name)
        if not hosts:
            if isinstance(role.host, list):
                problems.append(f"{role_name}.host: a list of hosts needs a hosts: list")
            continue
        names = role.host if isinstance(role.host, list) else [role.host]
        if isinstance(role.host, list) and len(names) != role.replicas:
            problems.append(f"{role_name}.host: {len(names)} hosts given for {role.replicas} replicas")
        for name in names:
            if name not in seen:
                problems.append(f"{role_name}.host: unknown host {name!r} (hosts: {', '.join(seen)})")
    used = set() if problems else {port_key(spec, getattr(spec, r), i)
                                   for r in SERVER_ROLES for i in range(getattr(spec, r).replicas)}
    if len(used) > 1:
        # Servers on one host pull KV from servers on another at the host's address (NIXL side channel).
        for i, h in enumerate(hosts):
            if _is_loopback(h.address):
                problems.append(f"hosts[{i}].address: {h.address} is loopback, but servers on other hosts "
                                "must reach it; give the address they use")
    if spec.platform:
        per_host = PLATFORMS[spec.platform].gpus_per_host
        for role_name in SERVER_ROLES:
            bad = [g for g in getattr(spec, role_name).gpus or [] if g >= per_host]
            if bad:
                problems.append(f"{role_name}.gpus: GPU {bad[0]} does not exist on a {spec.platform} host "
                                f"({per_host} GPUs)")
    return problems
