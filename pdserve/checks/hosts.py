"""Preflight on every host of a multi-host plan, run there (over ssh, or as an srun step): vLLM and NIXL
installed and the same versions on every host, the GPUs named exist, EFA present when LIBFABRIC is used,
and the ports free on the host's own address. Nothing is bound on this machine for another host's address.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.checks.findings import Finding
from pdserve.errors import PdserveError
from pdserve.plan.records import ClusterPlan

# host name, address, ports, efa? -> the facts remote_ops.op_probe reports
Probe = Callable[[str, str, list[int], bool], dict[str, Any]]


def _gpu_indices(env: dict[str, str]) -> list[int]:
    return [int(g) for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip().isdigit()]


def host_findings(plan: ClusterPlan, probe: Probe, *, check_ports: bool = True,
                  skip: frozenset[str] = frozenset()) -> list[Finding]:
    efa = any('"LIBFABRIC"' in " ".join(p.argv) for p in plan.processes)
    out: list[Finding] = []
    versions: dict[str, dict[str, str]] = {"vllm": {}, "nixl": {}}
    for host in plan.hosts:
        procs = [p for p in plan.processes if p.host_name == host.name and plan.is_remote(p)]
        if not procs:
            continue
        ports = sorted({port for p in procs if p.name not in skip
                        for port in [p.port, *p.side_channel_ports]}) if check_ports else []
        try:
            facts = probe(host.name, host.address, ports, efa)
        except PdserveError as err:
            out.append(Finding("fail", f"host {host.name}", err.message, err.hint or ""))
            continue
        for sw in ("vllm", "nixl"):
            if facts.get(sw):
                versions[sw][host.name] = " ".join(facts[sw])
            else:
                out.append(Finding("fail", f"host {host.name}", f"{sw} is not installed in {host.python}",
                                   f"install it on {host.name}, or set hosts[].python to the right Python"))
        wanted = [g for p in procs for g in _gpu_indices(p.env)]
        if wanted and facts.get("gpus") is None:
            out.append(Finding("fail", f"host {host.name}", "GPUs are configured but nvidia-smi finds none there",
                               "install the NVIDIA driver on that host"))
        elif wanted and max(wanted) >= facts["gpus"]:
            out.append(Finding("fail", f"host {host.name}", f"GPU {max(wanted)} does not exist there "
                               f"(nvidia-smi lists {facts['gpus']})", f"use GPUs 0-{facts['gpus'] - 1}"))
        if efa and facts.get("efa_rc") != 0:
            out.append(Finding("fail", f"host {host.name}", "fi_info -p efa finds no EFA provider there",
                               "install the EFA software (aws-efa-installer) and check the security group"))
        for port, why in facts.get("busy", []):
            out.append(Finding("fail", f"host {host.name}", f"port {port} on {host.address}: {why}",
                               "stop what uses it or change the ports in the config"))
    for sw, seen in versions.items():
        if len(set(seen.values())) > 1:
            listed = ", ".join(f"{v} on {h}" for h, v in seen.items())
            out.append(Finding("fail", sw, f"versions differ across hosts: {listed}",
                               "install the same vLLM and NIXL everywhere: P and D must speak one protocol"))
    failed_hosts = {f.check for f in out if f.level == "fail"}
    out += [Finding("ok", f"host {h.name}", "reachable; software, devices and ports fine")
            for h in plan.hosts if f"host {h.name}" not in failed_hosts
            and any(p.host_name == h.name and plan.is_remote(p) for p in plan.processes)]
    return out


def launcher_probe(plan: ClusterPlan) -> Probe:
    """The probe that runs through the plan's own launcher (ssh or srun) on each host."""
    from pdserve.launchers import launcher_for
    remote = next(p for p in plan.processes if plan.is_remote(p))
    launcher = launcher_for(plan, remote)
    return launcher.probe
