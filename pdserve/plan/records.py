"""The plan's typed records: what the planner produces and the launchers, supervisor and CLI consume."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.engine.names import MARKER_ENV  # noqa: F401 (the planner's and launchers' name for it; the entry reads it too)
from pdserve.roles import ROLE_ORDER, ROUTER
from pdserve.spec.schema import LauncherKind


@dataclass(frozen=True)
class EnvDefault:
    """An environment variable pdserve sets on a server unless the user's env names it, and why (the reason
    `pdserve plan` prints): transport, MPS and engine-start settings."""
    name: str
    value: str
    why: str


# Host name of the machine `pdserve up` runs on: the router, and every server of a cluster without `hosts:`.
LOCAL_HOST = "local"

# Kinds of values in a process's argv or env that belong to the machine its plan was made for
# (ProcessPlan.host_specific): a renderer for another place (`pdserve export`) replaces them by kind, never
# by parsing argv. Everything else in argv and env is the same wherever the process runs.
PROGRAM = "program"                 # argv[0]: this machine's Python (or redis-server)
BIND = "bind"                       # the address the process binds to
SIDE_CHANNEL_HOST = "side_channel_host"   # where NIXL peers reach the server's side channel
GPUS = "gpus"                       # the GPUs of this machine the server sees (CUDA_VISIBLE_DEVICES)
CORES = "cores"                     # the cores of this machine the server is pinned to
MEMORY = "memory"                   # a CPU server's default KV cache, sized from this machine's memory
MARKER = "marker"                   # the marker variable that finds the process tree again (MARKER_ENV)
MODEL = "model"                     # a built-in model's path under this machine's $PDSERVE_HOME
STATE = "state"                     # a path in the cluster's state folder (the router's config, Redis's dir)
SECRET = "secret"                   # the cluster's store secret file in the state folder (routers.SECRET_FILE)
REPLICA = "replica"                 # a router replica's name, one per process on this machine
LOOPBACK_ONLY = "loopback_only"     # the managed Redis's --protected-mode: `yes` while it is bound to loopback


def argv_slot(i: int) -> str:
    return f"argv:{i}"


def env_slot(name: str) -> str:
    return f"env:{name}"


@dataclass(frozen=True)
class ProcessPlan:
    name: str                 # prefill-0, decode-0, router
    role: str                 # one of roles.py: mps (the MPS daemon) | prefill | decode | store (Redis) | router
    argv: list[str]
    env: dict[str, str]       # added to the inherited environment
    host: str
    port: int
    health_url: str
    side_channel_ports: list[int] = field(default_factory=list)
    # Variables copied at launch from the launching environment, target <- source; secrets such as the
    # API key travel this way so they are never written into the plan or the state folder.
    env_from: dict[str, str] = field(default_factory=dict)
    # Processes that must be ready before this one starts (servers sharing a GPU: vLLM's memory profiling
    # needs the GPU quiet while a server starts). The supervisor honours it.
    start_after: list[str] = field(default_factory=list)
    host_name: str = LOCAL_HOST   # the spec's host this process runs on (`host` is its bind address there)
    # Variables of `env` that pdserve set by default rather than the user, name -> why (plan/transport.py).
    defaults: dict[str, str] = field(default_factory=dict)
    # Host-specific values, kind (PROGRAM, BIND, ...) -> where: argv_slot(i) or env_slot(NAME).
    host_specific: dict[str, str] = field(default_factory=dict)
    # SIGTERM -> SIGKILL at least this long, whatever supervisor.stop_timeout says (a router's drain + margin)
    stop_grace: float = 0.0

    @property
    def url(self) -> str:

        """Where the process answers, in its health check's scheme (http, or redis for the managed store)."""
        scheme = self.health_url.split("://", 1)[0] if "://" in (self.health_url or "") else "http"
        return f"{scheme}://{connect_host(self.host)}:{self.port}"

    def fingerprint(self) -> str:
        """Stable identity of what would run: changes whenever argv or env change."""
        return json.dumps([self.argv, sorted(self.env.items()), sorted(self.env_from.items())])

    def host_value(self, kind: str) -> str | None:
        """The planned value of a host-specific kind (None when this process has none)."""
        where = self.host_specific.get(kind)
        if where is None:
            return None
        source, _, key = where.partition(":")
        return self.argv[int(key)] if source == "argv" else self.env.get(key)

    def replaced(self, values: Mapping[str, str | None]) -> tuple[list[str], dict[str, str]]:
        """argv and env with the host-specific values of the kinds in `values` replaced: a string in its
        place, None to leave an env variable out (an argv item is never left out: positions would move)."""
        argv, env = list(self.argv), dict(self.env)
        for kind, value in values.items():
            where = self.host_specific.get(kind)
            if where is None:
                continue
            source, _, key = where.partition(":")
            if source == "argv":
                if value is None:
                    raise ValueError(f"{self.name}: argv's {kind} cannot be left out")
                argv[int(key)] = value
            elif value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return argv, env


@dataclass(frozen=True)
class HostPlan:
    """How to reach one host: what the ssh and Slurm launchers and the per-host checks need."""
    name: str
    address: str                        # where the router and the other hosts reach it
    ssh_host: str | None = None         # ssh destination when not the address
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    ssh_options: list[str] = field(default_factory=list)
    python: str | None = None           # Python for control commands (and the servers) on that host

    @property
    def destination(self) -> str:
        return self.ssh_host or self.address


@dataclass(frozen=True)
class ClusterPlan:
    name: str
    processes: list[ProcessPlan]        # in start order: prefill, decode, router
    router_config: dict[str, Any]       # written to router_config_path before the router starts
    router_config_path: str
    builtin_model: str | None           # kind to build before start, when model is `pdserve:<kind>`
    model_path: str
    supervisor: dict[str, Any]          # restart policy (SupervisorSpec fields)
    launcher: str = LauncherKind.LOCAL.value   # how processes on hosts other than LOCAL_HOST start (LauncherKind)
    hosts: list[HostPlan] = field(default_factory=list)    # empty: everything on this machine
    # the launcher's own settings, whole (slurm: the spec's `slurm:` section); its launcher reads them
    launcher_settings: dict[str, Any] = field(default_factory=dict)
    transfer_floor_gbps: float = 0.0    # the canary's KV transfers must be at least this fast (0: no floor)

    def host(self, name: str) -> HostPlan | None:
        return next((h for h in self.hosts if h.name == name), None)

    def is_remote(self, process: ProcessPlan) -> bool:
        """Whether the process runs elsewhere than this machine (ssh host or Slurm node)."""
        return process.host_name != LOCAL_HOST and self.launcher != LauncherKind.LOCAL

    @property
    def router(self) -> ProcessPlan:
        return next(p for p in self.processes if p.role == ROUTER)

    @property
    def router_url(self) -> str:
        """Where clients reach the router: with replicas, the port they share (each also has its own)."""
        if int(self.router_config.get("replicas", 1)) > 1:
            return f"http://{connect_host(self.router.host)}:{self.router_config['port']}"
        return self.router.url

    def by_name(self, name: str) -> ProcessPlan:
        return next(p for p in self.processes if p.name == name)

    def stop_order(self) -> list[ProcessPlan]:
        """Router first (no new traffic), then decode, then prefill: the start order reversed."""
        return sorted(self.processes, key=lambda p: -ROLE_ORDER[p.role])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ClusterPlan":
        procs = [ProcessPlan(**p) for p in data["processes"]]
        hosts = [HostPlan(**h) for h in data.get("hosts") or []]
        data = dict(data)
        old = {"job_id": data.pop("slurm_job_id", None), "srun_args": data.pop("slurm_args", None) or []}
        if data.get("launcher") == LauncherKind.SLURM and "launcher_settings" not in data:
            data["launcher_settings"] = old        # a plan.json written before launcher_settings
        return cls(**{**data, "processes": procs, "hosts": hosts})


def connect_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)


