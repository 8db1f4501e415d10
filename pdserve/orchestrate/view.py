"""`status`: a cluster as it is now, one typed record (ClusterView) that the CLI renders and `status --json`
prints through to_json(): its phase, each process (state file, liveness of its tree, uptime), what the router
reports, the KV transfer rates of the ready servers and their CPU KV tiers."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pdserve.observe import transfer
from pdserve.observe.promtext import api_key_of
from pdserve.observe.routerstats import read_router, read_routers
from pdserve.orchestrate.lookup import live_processes, stored_plan, supervisor_process
from pdserve.engine import tier
from pdserve.plan.records import ClusterPlan, ProcessPlan
from pdserve.roles import ROUTER, SERVER_ROLES
from pdserve.state.folder import ClusterDir
from pdserve.state.secret import control_token
from pdserve.state.records import ClusterState, Phase, ProcState


@dataclass
class ProcessView:
    """One process as `status` shows it (the fields in their --json order)."""
    name: str
    role: str                   # pdserve/roles.py
    state: ProcState            # stopped when nothing updates the state file and its tree is gone
    pid: int | None
    host: str
    port: int
    restarts: int
    message: str
    uptime_s: float | None      # while its tree lives
    alive: bool                 # anything of its tree alive

    @property
    def is_router(self) -> bool:
        return self.role == ROUTER


@dataclass
class ClusterView:
    """One cluster as `status` shows it. `router` and `transfers` are what observe/ reads, as they read it
    (observe/routerstats.py, observe/transfer.by_direction)."""
    name: str
    phase: Phase                # stopped when nothing of it runs
    running: bool               # its supervisor or any process alive
    supervisor_alive: bool
    error: str | None
    router_url: str | None
    processes: list[ProcessView]
    router: dict[str, Any] | None
    transfers: dict[str, dict] | None
    state_dir: str
    scrape_targets: str
    # The variable router.api_key_env names, when it is not exported here: the router's /metrics wants the key,
    # so `router` (turns, reuse) could not be read.
    router_key_missing: str | None = None
    # Servers with a CPU KV tier (a role's kv_offloading_size), by name: engine/tier.py's answer (capacity and
    # stored tokens), or {"error": why} when it could not be read.
    cpu_tiers: dict[str, dict] | None = None

    @property
    def ready(self) -> int:
        return sum(1 for p in self.processes if p.state == ProcState.READY)

    def to_json(self) -> dict[str, Any]:
        """The `status --json` shape: these fields in this order, states and phase by their values."""
        out = dataclasses.asdict(self)
        out["phase"] = self.phase.value
        for row, proc in zip(out["processes"], self.processes):
            row["state"] = proc.state.value
        return out


def cluster_view(cdir: ClusterDir) -> ClusterView:
    """The cluster as `status` shows it."""
    state = cdir.read_state() or ClusterState(cdir.name, Phase.STOPPED, "")
    plan = stored_plan(cdir)
    alive = live_processes(cdir, state)
    sup_alive = supervisor_process(state) is not None
    now = time.time()
    processes = []
    for name, proc in state.processes.items():
        shown = proc.state
        # Without a supervisor nobody updates state.json: a dead process is simply stopped.
        if not alive.get(name) and not sup_alive and proc.state not in (ProcState.FATAL, ProcState.BACKOFF):
            shown = ProcState.STOPPED
        processes.append(ProcessView(
            name=name, role=proc.role, state=shown, pid=proc.handle.pid if proc.handle else None, host=proc.host,
            port=proc.port, restarts=proc.restarts, message=proc.message,
            uptime_s=round(now - proc.started_at, 1) if proc.started_at and alive.get(name) else None,
            alive=alive.get(name, False)))
    running = sup_alive or any(alive.values())
    router_url = state.router_url or None
    return ClusterView(
        name=cdir.name, phase=state.phase if running else Phase.STOPPED, running=running,
        supervisor_alive=sup_alive, error=state.error, router_url=router_url, processes=processes,
        router=router_view(plan, router_url) if running and router_url else None,
        router_key_missing=key_missing(plan) if running and router_url else None,
        transfers=_transfers(plan, state) if running and plan else None,
        cpu_tiers=_cpu_tiers(plan, state, control_token(cdir.root)) if running and plan else None,
        state_dir=str(cdir.root), scrape_targets=str(cdir.targets_path))


TRANSFER_READ_TIMEOUT = 0.5   # per server, all at once: a hung server must not hold `status` up


def _transfers(plan: ClusterPlan, state: ClusterState) -> dict[str, dict]:
    """Each direction's KV transfer rate over the ready servers' lives (observe/transfer.py)."""
    servers = [p for p in plan.processes if p.role in SERVER_ROLES and (rec := state.processes.get(p.name))
               and rec.state == ProcState.READY]
    if not servers:
        return {}
    with ThreadPoolExecutor(len(servers)) as pool:
        reads = list(pool.map(lambda p: transfer.read(p.url, TRANSFER_READ_TIMEOUT), servers))
    return transfer.by_direction([(p.role, got) for p, got in zip(servers, reads)])


def _cpu_tiers(plan: ClusterPlan, state: ClusterState, token: str | None) -> dict[str, dict]:
    """Each ready server's CPU KV tier, read from its own /pdserve/tier (engine/tier.py) with the control token."""
    servers = [p for p in plan.processes if p.role in SERVER_ROLES and (rec := state.processes.get(p.name))
               and rec.state == ProcState.READY and tier.has_tier(SimpleNamespace(kv_transfer_config=_kv_config(p)))]
    if not servers:
        return {}
    with ThreadPoolExecutor(len(servers)) as pool:
        reads = list(pool.map(lambda p: read_tier(p.url, token, TRANSFER_READ_TIMEOUT), servers))
    return {p.name: got for p, got in zip(servers, reads)}


def _kv_config(process: ProcessPlan) -> str | None:
    argv = process.argv
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--kv-transfer-config"), None)


def read_tier(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url + tier.PATH, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except Exception as e:      # a status line, never a failed `status`
        return {"error": str(getattr(e, "reason", None) or e)[:200]}


def key_missing(plan: ClusterPlan | None) -> str | None:
    """The name of the variable holding the router's key when the config wants one and it is not exported."""
    name = plan.router_config.get("api_key_env") if plan else None
    return name if name and not api_key_of(plan.router_config) else None


def router_view(plan: ClusterPlan | None, router_url: str) -> dict[str, Any] | None:
    """What the router reports; with replicas, each read on its own port and added up."""
    key = api_key_of(plan.router_config) if plan else None
    replicas = [p for p in plan.processes if p.role == ROUTER] if plan else []
    if len(replicas) > 1:
        return read_routers({p.name: p.url for p in replicas}, key)
    return read_router(router_url, key)
