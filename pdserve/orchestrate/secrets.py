"""Secrets a plan copies from the launching environment (`env_from`: the API key of `router.api_key_env`).

A process gets them from the environment of the supervisor that starts it, and the supervisor has the
environment of the `up` that started it. `up` of a running cluster runs in another environment: the key
added, or given another value, exists only there. So the request that restarts processes carries the values
(`secret_env`), in a request file only the user can read (mode 0600, removed by the supervisor on its next
tick), never in plan.json or router.json; and a value that differs from the one a running process got
(`stale_secrets`, read from that process's environment on this machine) restarts that process, though the
plan is the same.
"""

from __future__ import annotations

import os

import psutil

from pdserve.errors import ConfigError
from pdserve.launchers.base import LauncherKind
from pdserve.observe.proctree import same_process
from pdserve.plan.records import ClusterPlan
from pdserve.spec.schema import ClusterSpec
from pdserve.state.records import ClusterState


def require_key(spec: ClusterSpec) -> None:
    """A key named in the config must be exported where `up` runs (first start or applied to a running one)."""
    key_env = spec.router.api_key_env
    if key_env and not os.environ.get(key_env):
        raise ConfigError(f"router.api_key_env: environment variable {key_env} is not set or empty",
                          hint=f"export {key_env}=<key> before `pdserve up`")


def secret_env(plan: ClusterPlan) -> dict[str, str]:
    """The values of every variable the plan copies from the environment, as this process sees them."""
    return {source: os.environ[source] for p in plan.processes for source in p.env_from.values()
            if os.environ.get(source)}


def stale_secrets(plan: ClusterPlan, state: ClusterState | None) -> list[str]:
    """Processes running on this machine whose copied variables differ from this environment's values
    (the key changed, same name). A process on another host is not read: `pdserve restart` it after the
    next `up` that changes its plan, or `down` and `up`, to give it a new key."""
    out = []
    for p in plan.processes:
        record = state.processes.get(p.name) if state else None
        if not p.env_from or record is None or record.handle is None \
                or record.handle.launcher != LauncherKind.LOCAL:
            continue
        proc = same_process(record.handle.pid, record.handle.start_time)
        try:
            environ = proc.environ() if proc is not None else None
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            environ = None
        # a variable this environment lacks is not the user's to give (the supervisor sets the control token)
        if environ is not None and any(os.environ.get(source) and environ.get(target) != os.environ[source]
                                       for target, source in p.env_from.items()):
            out.append(p.name)
    return out
