"""Launchers: start, watch and stop one process where the plan puts it (this machine today).

The supervisor and `down` get their launchers from these two functions, never by importing one directly.
"""

from __future__ import annotations

from pdserve.launchers.base import Handle, Launcher, LauncherKind
from pdserve.launchers.local import LocalLauncher
from pdserve.plan.records import ClusterPlan, ProcessPlan

_local: LocalLauncher | None = None


def _local_launcher() -> LocalLauncher:
    global _local
    if _local is None:
        _local = LocalLauncher()
    return _local


def launcher_for(plan: ClusterPlan, process: ProcessPlan) -> Launcher:
    """The launcher that starts `process` of `plan`."""
    return _local_launcher()


def launcher_for_handle(plan: ClusterPlan | None, handle: Handle) -> Launcher:
    """The launcher that can watch and stop a process recorded in state.json."""
    if handle.launcher != LauncherKind.LOCAL:
        raise NotImplementedError(f"no {handle.launcher.value} launcher in this pdserve")
    return _local_launcher()
