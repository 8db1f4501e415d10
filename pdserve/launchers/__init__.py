"""Launchers: how a process starts, is watched and stopped, wherever it runs. The supervisor and `down`
get one from this factory and never call the OS themselves.

One launcher object per (cluster, kind) in a pdserve process: the local one keeps the Popen of what it
started (to reap it), the ssh one keeps each host's reachability (to fail at once while a host is down).
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.errors import PdserveError
from pdserve.launchers.base import Handle, Launcher, LauncherKind
from pdserve.launchers.local import LocalLauncher
from pdserve.plan.records import ClusterPlan, ProcessPlan


def _ssh(plan: ClusterPlan) -> Launcher:
    from pdserve.launchers.ssh import SshLauncher
    return SshLauncher(plan)


def _slurm(plan: ClusterPlan) -> Launcher:
    from pdserve.launchers.slurm import SlurmLauncher
    return SlurmLauncher(plan)


# The launchers of other hosts, one line each (imported when first used); the local one is always there.
REMOTE: dict[LauncherKind, Callable[[ClusterPlan], Launcher]] = {LauncherKind.SSH: _ssh, LauncherKind.SLURM: _slurm}

_shared: dict[tuple[str, str], Launcher] = {}


def _kind_for(plan: ClusterPlan, process: ProcessPlan) -> LauncherKind:
    return LauncherKind(plan.launcher) if plan.is_remote(process) else LauncherKind.LOCAL


def _launcher(plan: ClusterPlan | None, kind: LauncherKind) -> Launcher:
    if plan is None and kind is not LauncherKind.LOCAL:
        raise PdserveError(f"a {kind.value} process needs the cluster's plan.json to reach its host",
                           hint="the state folder lost plan.json; stop the servers on their hosts by hand")
    key = ("" if kind is LauncherKind.LOCAL else plan.name, kind.value)
    if key not in _shared:
        _shared[key] = LocalLauncher() if kind is LauncherKind.LOCAL else REMOTE[kind](plan)
    elif kind is not LauncherKind.LOCAL:
        _shared[key].plan = plan     # the newest plan's hosts; reachability learned so far is kept
    return _shared[key]


def launcher_for(plan: ClusterPlan, process: ProcessPlan) -> Launcher:
    """The launcher that starts `process`: local for the router and for clusters without remote hosts."""
    return _launcher(plan, _kind_for(plan, process))


def launcher_for_handle(plan: ClusterPlan | None, handle: Handle) -> Launcher:
    """The launcher that can watch and stop a process started earlier, from its handle in state.json."""
    return _launcher(plan, handle.launcher)


def unreachable_hosts(plan: ClusterPlan) -> dict[str, str]:
    """Host -> why, for the hosts of `plan` its launchers in this process last found unreachable (for
    status and the supervisor's messages; empty for local clusters)."""
    out: dict[str, str] = {}
    for (cluster, _), launcher in _shared.items():
        if cluster == plan.name:
            out.update({h.name: launcher.host_health(h.name).reason for h in plan.hosts
                        if not launcher.host_health(h.name).reachable})
    return out


def close_connections(plan: ClusterPlan) -> list[str]:
    """Close the shared ssh connections (ControlMaster) to the plan's hosts, whichever pdserve process
    opened them; the hosts that had one. Nothing for other launchers."""
    if plan.launcher != LauncherKind.SSH.value:
        return []
    from pdserve.launchers.ssh import SshLauncher
    launcher = _launcher(plan, LauncherKind.SSH)
    return launcher.close() if isinstance(launcher, SshLauncher) else []


__all__ = ["Handle", "Launcher", "LauncherKind", "close_connections", "launcher_for", "launcher_for_handle",
           "unreachable_hosts"]
