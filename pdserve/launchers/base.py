"""The launcher contract: how the supervisor starts, watches and stops one process, wherever it runs.

The supervisor and `down` are given a Launcher; they never call the OS themselves. A Handle is plain data
that goes into state.json and stays valid after the supervisor restarts, so a later `pdserve` (or a new
supervisor) can find, prove and stop the same process: a pid alone is never trusted, only pid + start time
on the same host, or a Slurm step named after the cluster and process.

Signals go to a process's whole tree: the leader's process group (its session, since every launcher starts
the leader as a session leader) and whatever carries the process's marker. A dead leader's group lives on
in its children (vLLM's engine and workers, retitled `VLLM::EngineCore`), so the tree is found by group,
not by parentage or the leader's liveness.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from pdserve.errors import PdserveError
from pdserve.plan.records import ClusterPlan, ProcessPlan
from pdserve.spec.schema import LauncherKind

__all__ = ["Handle", "HostHealth", "HostUnreachable", "Launcher", "LauncherKind"]


class HostUnreachable(PdserveError):
    """A host could not be reached (or did not answer in time); `host` and `reason` say which and why."""

    def __init__(self, host: str, reason: str, check: str | None = None):
        """`check`: a shell command that makes the very connection that failed (the ssh launcher's own)."""
        self.host, self.reason = host, reason
        super().__init__(f"host {host} is unreachable: {reason}",
                         hint=f"check that `{check}` works from here" if check
                         else "check the host's network and its launcher settings in hosts[]")


@dataclass
class HostHealth:
    """What a launcher last learned of a host's reachability."""
    reachable: bool = True
    reason: str = ""
    since: float = 0.0          # when it became unreachable (time.time())
    retry_at: float = 0.0       # monotonic time before which calls fail at once
    failures: int = 0


@dataclass(frozen=True)
class Handle:
    """Identity of one started process. Plain data: written to state.json, read back by any pdserve."""
    launcher: LauncherKind
    host: str                      # the spec's host name ("local" for this machine)
    pid: int | None                # the leader's pid on its host; also its process group and session id
    start_time: float | None       # the leader's start time on its host (seconds since the epoch)
    marker: str                    # PDSERVE_PROCESS value every process of its tree inherits
    log_path: str                  # the process's log file on its host
    job_id: str | None = None      # Slurm: the allocation's job id ...
    step_name: str | None = None   # ... and the step's name (cluster + process), for scancel

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "launcher": self.launcher.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Handle":
        return cls(**{**data, "launcher": LauncherKind(data["launcher"])})


class Launcher(Protocol):
    """What the supervisor, `down`, `logs` and the checks need of a way to run processes. Every call returns
    promptly (no waiting on a process to exit): stopping is a timed stop (stop.py), SIGTERM on one tick,
    SIGKILL on a later one."""

    kind: LauncherKind
    plan: ClusterPlan | None          # the cluster's plan (hosts, settings); the factory keeps it current

    def host_health(self, host: str) -> HostHealth:
        """What the launcher last learned of a host (reachable, or since when not and why)."""
        ...

    def probe(self, host_name: str, address: str, ports: list[int], efa: bool) -> dict[str, Any]:
        """Preflight facts of one host (software versions, GPUs, EFA, ports taken there): remote_ops' probe."""
        ...

    def start(self, plan: ProcessPlan, log_path: Path) -> Handle:
        """Start the process detached, as the leader of a new session, its output appended to log_path."""
        ...

    def is_alive(self, handle: Handle) -> bool:
        """The leader itself (pid + start time) is alive and not a zombie."""
        ...

    def exit_code(self, handle: Handle) -> int | None:
        """The leader's exit code when this launcher started it and it has exited, else None."""
        ...

    def tree_alive(self, handle: Handle) -> int:
        """How many processes of the handle's tree (leader, its group, its marker) are alive."""
        ...

    def signal(self, handle: Handle, sig: int) -> int:
        """Send sig to every process of the tree, the leader dead or alive; returns how many got it."""
        ...

    def adopt(self, handle: Handle) -> Handle | None:
        """The same handle when its leader is provably the process that was started (pid, start time and
        marker), else None."""
        ...

    def read_log(self, handle: Handle, lines: int) -> list[str]:
        """The last lines of the process's log, wherever it lives."""
        ...
