"""Typed records of a cluster's state.json: one ClusterState, one ProcessRecord per process.

The supervisor writes them; every command reads them through ClusterDir.read_state. The file is versioned:
a version-1 file (pdserve 0.1, flat pid/create_time) is read as the same records; a file from a newer
pdserve is refused with a clear message rather than misread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import PdserveError
from pdserve.launchers.base import Handle, LauncherKind

STATE_VERSION = 2


class ProcState(str, enum.Enum):
    """One process's place in its life cycle (transitions: pdserve.supervise.transitions)."""
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    BACKOFF = "backoff"
    FATAL = "fatal"
    STOPPING = "stopping"

    @property
    def has_process(self) -> bool:
        """A started process should exist in this state (so its death is news)."""
        return self in (ProcState.STARTING, ProcState.READY, ProcState.UNHEALTHY)


class Phase(str, enum.Enum):
    """The whole cluster's phase, as `up`, `status` and `down` see it."""
    STARTING = "starting"     # processes starting, or the start-up canary not yet passed
    RUNNING = "running"       # every role has a ready server and the canary passed
    DEGRADED = "degraded"     # up once, but a role has no ready server now, or a process gave up
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"         # `up` failed: a process gave up before the cluster was ever running

    @property
    def settled(self) -> bool:
        """`up` stops waiting in these phases."""
        return self in (Phase.RUNNING, Phase.DEGRADED, Phase.STOPPED, Phase.FAILED)


@dataclass
class ProcessRecord:
    name: str
    role: str
    state: ProcState
    host: str
    port: int
    handle: Handle | None = None
    started_at: float | None = None      # wall clock, for the uptime shown to people
    restarts: int = 0
    message: str = ""
    host_name: str = ""       # the spec's host it runs on ("local": this machine)
    url: str = ""             # where the router (and a scraper on this machine) reaches it

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "state": self.state.value, "host": self.host,
                "port": self.port, "handle": self.handle.to_dict() if self.handle else None,
                "started_at": self.started_at, "restarts": self.restarts, "message": self.message,
                "host_name": self.host_name, "url": self.url}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProcessRecord":
        handle = data.get("handle")
        return cls(name=data["name"], role=data["role"], state=ProcState(data["state"]), host=data["host"],
                   port=int(data["port"]), handle=Handle.from_dict(handle) if handle else None,
                   started_at=data.get("started_at"), restarts=int(data.get("restarts") or 0),
                   message=data.get("message") or "", host_name=data.get("host_name") or "",
                   url=data.get("url") or "")

    @classmethod
    def from_v1(cls, name: str, data: dict[str, Any], log_path: str) -> "ProcessRecord":
        """pdserve 0.1 kept pid, create_time and marker flat in each process entry."""
        pid = data.get("pid")
        handle = Handle(LauncherKind.LOCAL, "local", pid, data.get("create_time"), data.get("marker") or "",
                        log_path) if pid else None
        return cls(name=name, role=data.get("role") or "", state=ProcState(data.get("state") or "stopped"),
                   host=data.get("host") or "", port=int(data.get("port") or 0), handle=handle,
                   started_at=data.get("started_at"), restarts=int(data.get("restarts") or 0),
                   message=data.get("message") or "")


@dataclass
class SupervisorRecord:
    pid: int
    start_time: float


@dataclass
class ClusterState:
    cluster: str
    phase: Phase
    router_url: str
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    supervisor: SupervisorRecord | None = None
    error: str | None = None
    updated_at: float = 0.0
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "cluster": self.cluster, "phase": self.phase.value,
                "error": self.error, "updated_at": self.updated_at, "router_url": self.router_url,
                "supervisor": {"pid": self.supervisor.pid, "start_time": self.supervisor.start_time}
                if self.supervisor else None,
                "processes": {name: p.to_dict() for name, p in self.processes.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any], logs_dir: str = "") -> "ClusterState":
        version = int(data.get("version") or 1)
        if version > STATE_VERSION:
            raise PdserveError(f"state.json has version {version}; this pdserve reads up to {STATE_VERSION}",
                               hint="use the pdserve that started this cluster, or upgrade this one")
        sup = data.get("supervisor") or None
        if version == 1:
            procs = {name: ProcessRecord.from_v1(name, p, f"{logs_dir}/{name}.log")
                     for name, p in (data.get("processes") or {}).items()}
            sup_rec = SupervisorRecord(sup["pid"], sup["create_time"]) if sup else None
        else:
            procs = {name: ProcessRecord.from_dict(p) for name, p in (data.get("processes") or {}).items()}
            sup_rec = SupervisorRecord(sup["pid"], sup["start_time"]) if sup else None
        return cls(cluster=data.get("cluster") or "", phase=Phase(data.get("phase") or "stopped"),
                   router_url=data.get("router_url") or "", processes=procs, supervisor=sup_rec,
                   error=data.get("error"), updated_at=float(data.get("updated_at") or 0.0))
