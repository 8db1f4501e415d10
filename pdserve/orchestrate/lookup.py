"""A cluster found: its state folder by name, its plan (from a cluster.yaml, or the one it was started with),
its supervisor and which of its processes live, and which of the plan's ports are taken. Every operation
starts here; nothing here starts or stops a process."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import psutil

from pdserve.errors import NotRunningError
from pdserve.launchers import launcher_for_handle
from pdserve.launchers.base import HostUnreachable
from pdserve.launchers.local import same_process
from pdserve.plan.build import build_plan
from pdserve.plan.records import ClusterPlan
from pdserve.spec.load import DEFAULT_CONFIG, load_spec
from pdserve.spec.schema import ClusterSpec, SupervisorSpec
from pdserve.state.folder import ClusterDir, models_dir
from pdserve.state.records import ClusterState


def plan_from_file(path: str | Path | None) -> tuple[ClusterSpec, ClusterPlan, ClusterDir]:
    spec = load_spec(path or DEFAULT_CONFIG)
    cdir = ClusterDir(spec.name)
    plan = build_plan(spec, python=sys.executable, cluster_dir=cdir.root, models_dir=models_dir(),
                      memory_gib=psutil.virtual_memory().total / 2**30)
    return spec, plan, cdir


def find_cluster(name: str) -> ClusterDir:
    """The state folder of a cluster `pdserve up` has seen, or exit 3 saying there is none."""
    cdir = ClusterDir(name)
    if not cdir.exists():
        raise NotRunningError(f"no cluster named {name}", hint="`pdserve status` lists the known clusters")
    return cdir


def stored_plan(cdir: ClusterDir) -> ClusterPlan | None:
    data = cdir.read_plan()
    return ClusterPlan.from_dict(data) if data else None


def supervisor_process(state: ClusterState | None) -> psutil.Process | None:
    sup = state.supervisor if state else None
    return same_process(sup.pid, sup.start_time) if sup else None


def has_supervisor(cdir: ClusterDir) -> bool:
    return supervisor_process(cdir.read_state()) is not None


def live_processes(cdir: ClusterDir, state: ClusterState | None = None) -> dict[str, bool]:
    """Process name -> whether anything of its tree is alive (leader by pid + start time, its group, its
    marker), asked of the launcher that started it."""
    state = state if state is not None else cdir.read_state()
    if state is None:
        return {}
    plan = stored_plan(cdir)
    return {name: _tree_alive(plan, p.handle) for name, p in state.processes.items()}


def _tree_alive(plan: ClusterPlan | None, handle) -> bool:
    """Anything of the tree alive; on a host that cannot be reached, assume so (it may well run there)."""
    if handle is None:
        return False
    try:
        return bool(launcher_for_handle(plan, handle).tree_alive(handle))
    except HostUnreachable:
        return True


def has_live_processes(cdir: ClusterDir) -> bool:
    """The supervisor or any process of the cluster is alive."""
    state = cdir.read_state()
    return bool(supervisor_process(state)) or any(live_processes(cdir, state).values())


def busy_ports(plan: ClusterPlan, skip: set[str] = frozenset()) -> list[str]:
    """Ports of the plan that something else already listens on (checked by binding)."""
    busy = []
    # Only this machine's processes: another host's address cannot be bound here (checks/hosts.py binds it there).
    for proc in (p for p in plan.processes if p.name not in skip and not plan.is_remote(p)):
        for port in [proc.port, *proc.side_channel_ports]:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((proc.host, port))
                except OSError:
                    busy.append(f"{proc.name}: port {port}")
    return busy


def stop_timeout_of(cdir: ClusterDir) -> float:
    """The stored plan's SIGTERM -> SIGKILL window (the spec's default when there is no plan)."""
    plan = stored_plan(cdir)
    return SupervisorSpec.model_validate(plan.supervisor if plan else {}).stop_timeout
