"""Orchestration: from a cluster.yaml to a supervised deployment and back. No rendering here."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pdserve.errors import EXIT_BAD_INPUT, ConfigError, NotRunningError, PdserveError, UsageError
from pdserve.launchers import close_connections, launcher_for_handle
from pdserve.launchers.base import HostUnreachable
from pdserve.launchers.local import same_process
from pdserve.launchers.stop import stop_tree
from pdserve.plan.build import build_plan
from pdserve.plan.records import ClusterPlan
from pdserve.plan.routers import MEMORY_STORE, SECRET_FILE
from pdserve.roles import ROLE_ORDER, ROUTER, SERVER_ROLES
from pdserve.checks.preflight import machine_findings
from pdserve.observe import transfer
from pdserve.observe.promtext import api_key_of
from pdserve.observe.routerstats import read_router, read_routers
from pdserve.spec.load import DEFAULT_CONFIG, load_spec
from pdserve.spec.schema import ClusterSpec
from pdserve.observe.logfiles import last_lines, root_cause
from pdserve.observe.resources import GpuLeft, gpus_still_holding, process_gpus
from pdserve.state.folder import ClusterDir, models_dir, write_json_atomic
from pdserve.state.records import ClusterState, Phase, ProcState
from pdserve.state.secret import ensure_secret



def plan_from_file(path: str | Path | None) -> tuple[ClusterSpec, ClusterPlan, ClusterDir]:
    spec = load_spec(path or DEFAULT_CONFIG)
    cdir = ClusterDir(spec.name)
    plan = build_plan(spec, python=sys.executable, cluster_dir=cdir.root, models_dir=models_dir(),
                      memory_gib=psutil.virtual_memory().total / 2**30)
    return spec, plan, cdir


def ensure_store_secret(plan: ClusterPlan, cdir: ClusterDir) -> None:
    """A shared store's secret, before a process reads it: the managed Redis includes it, routers namespace the
    cluster's keys by it (state/secret.py)."""
    if plan.router_config.get("store", MEMORY_STORE) != MEMORY_STORE:
        ensure_secret(cdir.root / SECRET_FILE)


def find_cluster(name: str) -> ClusterDir:
    """The state folder of a cluster `pdserve up` has seen, or exit 3 saying there is none."""
    cdir = ClusterDir(name)
    if not cdir.exists():
        raise NotRunningError(f"no cluster named {name}", hint="`pdserve status` lists the known clusters")
    return cdir


def supervisor_process(state: ClusterState | None) -> psutil.Process | None:
    sup = state.supervisor if state else None
    return same_process(sup.pid, sup.start_time) if sup else None


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


def stored_plan(cdir: ClusterDir) -> ClusterPlan | None:
    data = cdir.read_plan()
    return ClusterPlan.from_dict(data) if data else None


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


def changed_processes(old: dict[str, Any] | None, new: ClusterPlan) -> list[str]:
    """Processes whose plan differs between a stored plan and a new one (argv, env, router config)."""
    if not old:
        return [p.name for p in new.processes]
    before = ClusterPlan.from_dict(old)
    names = {p.name for p in before.processes}
    changed = [p.name for p in new.processes
               if p.name not in names or before.by_name(p.name).fingerprint() != p.fingerprint()]
    if before.router_config != new.router_config:    # every router replica reads it
        changed += [p.name for p in new.processes if p.role == ROUTER and p.name not in changed]
    return changed + sorted(names - {p.name for p in new.processes})


def prepare(spec: ClusterSpec, plan: ClusterPlan, cdir: ClusterDir, config_path: Path | None) -> list[str]:
    """Everything `up` does before a process starts: refuse duplicates, build the model, write files.

    Returns the live processes to adopt: when the supervisor died but servers still run, `up` re-attaches
    to them (same plan only) instead of starting duplicates."""
    key_env = spec.router.api_key_env
    if key_env and not os.environ.get(key_env):
        raise ConfigError(f"router.api_key_env: environment variable {key_env} is not set or empty",
                          hint=f"export {key_env}=<key> before `pdserve up`")
    state = cdir.read_state()
    if supervisor_process(state) is not None:
        raise PdserveError(f"cluster {spec.name} is already running",
                           hint=f"`pdserve status {spec.name}` to see it, `pdserve down {spec.name}` to stop it")
    alive = [name for name, ok in live_processes(cdir, state).items() if ok]
    if alive:
        changed = changed_processes(cdir.read_plan(), plan)
        if changed:
            raise PdserveError(f"{spec.name} still runs without its supervisor, and the config changed for "
                               f"{', '.join(changed)}", hint=f"`pdserve down {spec.name}` first, then `pdserve up`")
    failed = [f for f in machine_findings(spec, plan, None) if f.level == "fail"]
    if failed:
        raise PdserveError("; ".join(f"{f.check}: {f.message}" for f in failed), hint=failed[0].hint,
                           exit_code=EXIT_BAD_INPUT)
    busy = busy_ports(plan, skip=set(alive))
    if busy:
        raise PdserveError(f"ports already in use: {', '.join(busy)}",
                           hint="stop what uses them or change the ports in the config")
    if plan.builtin_model:
        from pdserve.engine.models import ensure_model
        ensure_model(plan.builtin_model, models_dir())
    cdir.root.mkdir(parents=True, exist_ok=True)
    cdir.logs_dir.mkdir(exist_ok=True)
    if config_path:
        shutil.copyfile(config_path, cdir.spec_path)
    write_json_atomic(cdir.plan_path, plan.to_dict())
    ensure_store_secret(plan, cdir)
    write_json_atomic(Path(plan.router_config_path), plan.router_config)
    if not alive:
        cdir.state_path.unlink(missing_ok=True)
    return alive


def start_supervisor(cdir: ClusterDir, adopt: bool = False) -> subprocess.Popen:
    """The supervisor runs in its own session so it outlives this command (and a closed terminal)."""
    with open(cdir.supervisor_log, "ab") as logf:
        return subprocess.Popen([sys.executable, "-m", "pdserve.supervise", str(cdir.root),
                                 *(["--adopt"] if adopt else [])],
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


def wait_for_phase(cdir: ClusterDir, supervisor: subprocess.Popen, on_update: Callable[[ClusterState | None], None],
                   poll: float = 0.5) -> ClusterState:
    """Poll state.json until the cluster is up, failed, or the supervisor died. Only a state written by
    this supervisor counts: on re-attach, state.json still says "running" from the one that died."""
    def ours(state: ClusterState | None) -> bool:
        return bool(state and state.supervisor and state.supervisor.pid == supervisor.pid)

    while True:
        state = cdir.read_state()
        on_update(state)
        if ours(state) and state.phase.settled:
            return state
        if supervisor.poll() is not None:
            state = cdir.read_state()
            if ours(state) and state.phase.settled:
                return state
            # A dead predecessor's error is not this supervisor's: show this one's log instead.
            own_error = state.error if ours(state) else None
            failed = state if ours(state) else ClusterState(cdir.name, Phase.FAILED, "")
            failed.phase = Phase.FAILED
            failed.error = own_error or ("the supervisor exited: " + " | ".join(last_lines(cdir.supervisor_log, 3)))
            return failed
        time.sleep(poll)


class StartFailed(PdserveError):
    """`up` failed; `process` and `log_lines` say where (shown before the error line)."""

    def __init__(self, message: str, hint: str, process: str, log_lines: list[str]):
        super().__init__(message, hint)
        self.process, self.log_lines = process, log_lines


def supervise_until_up(cdir: ClusterDir, adopt: bool, on_update: Callable[[ClusterState | None], None],
                       stop_timeout: float) -> subprocess.Popen:
    """Start the supervisor and wait until the cluster runs; on failure stop everything and raise
    StartFailed with the failed process's log (Ctrl-C stops everything too)."""
    supervisor = start_supervisor(cdir, adopt=adopt)
    try:
        state = wait_for_phase(cdir, supervisor, on_update)
    except KeyboardInterrupt:
        stop_cluster(cdir, stop_timeout)
        raise
    if state.phase != Phase.RUNNING:
        name, lines = failure_details(cdir, state)
        stop_cluster(cdir, stop_timeout)
        cause = root_cause(last_lines(cdir.log_path(name), 400)) if name != "supervisor" else None
        raise StartFailed(f"{cdir.name} failed to start: {state.error or 'unknown reason'}"
                          + (f"; root cause: {cause}" if cause else ""),
                          f"full log: {cdir.log_path(name) if name != 'supervisor' else cdir.supervisor_log}",
                          name, lines)
    return supervisor


def failure_details(cdir: ClusterDir, state: ClusterState, lines: int = 20) -> tuple[str, list[str]]:
    """The process that failed and the end of its log."""
    for name, proc in state.processes.items():
        if proc.state == ProcState.FATAL:
            return name, last_lines(cdir.log_path(name), lines)
    return "supervisor", last_lines(cdir.supervisor_log, lines)


def request_restart(cdir: ClusterDir, names: list[str] | None, reload: bool = False) -> dict[str, int]:
    """Ask the running supervisor to restart some processes (None: all), one at a time in start order
    (prefill replicas, then decode, then the router); with `reload`, from the plan now on disk. Returns
    each one's restart count before the request."""
    state = cdir.read_state()
    if supervisor_process(state) is None:
        raise NotRunningError(f"cluster {cdir.name} has no running supervisor",
                              hint=f"`pdserve up` re-attaches to live processes; `pdserve status {cdir.name}`")
    procs = state.processes
    unknown = [n for n in names or [] if n not in procs]
    if unknown:
        raise UsageError(f"no process {unknown[0]!r} in cluster {cdir.name}", hint=f"processes: {', '.join(procs)}")
    order = sorted(names if names is not None else procs, key=lambda n: ROLE_ORDER.get(procs[n].role, 9))
    write_json_atomic(cdir.requests_dir / f"{time.time_ns()}.json", {"restart": order, "reload": reload})
    return {n: procs[n].restarts for n in order}


def has_supervisor(cdir: ClusterDir) -> bool:
    return supervisor_process(cdir.read_state()) is not None


def apply_changes(plan: ClusterPlan, cdir: ClusterDir, config_path: Path | None) -> dict[str, int]:
    """`up` of a running cluster: restart only the processes whose plan changed (none: a no-op)."""
    stored = cdir.read_plan()
    old = ClusterPlan.from_dict(stored)
    if [p.name for p in old.processes] != [p.name for p in plan.processes]:
        raise PdserveError(f"{plan.name} is running with other processes than this config describes "
                           "(replicas changed)", hint=f"`pdserve down {plan.name}` then `pdserve up`")
    changed = changed_processes(stored, plan)
    if not changed:
        return {}
    moved = {p.name for p in plan.processes
             if (p.port, p.side_channel_ports) != (old.by_name(p.name).port, old.by_name(p.name).side_channel_ports)}
    busy = busy_ports(plan, skip={p.name for p in plan.processes} - moved)
    if busy:
        raise PdserveError(f"ports already in use: {', '.join(busy)}", hint="change the ports in the config")
    if config_path:
        shutil.copyfile(config_path, cdir.spec_path)
    write_json_atomic(cdir.plan_path, plan.to_dict())
    ensure_store_secret(plan, cdir)
    write_json_atomic(Path(plan.router_config_path), plan.router_config)
    return request_restart(cdir, changed, reload=True)


def wait_restarted(cdir: ClusterDir, before: dict[str, int], timeout: float,
                   on_ready: Callable[[str], None]) -> None:
    """Until each process has restarted and is ready again; a fatal one or the timeout is an error."""
    deadline = time.monotonic() + timeout
    pending = dict(before)
    while pending:
        state = cdir.read_state()
        procs = state.processes if state else {}
        for name in list(pending):
            p = procs.get(name)
            if p is None or p.restarts <= pending[name]:
                continue                          # the supervisor has not restarted it yet
            if p.state == ProcState.READY:
                del pending[name]
                on_ready(name)
            elif p.state == ProcState.FATAL:
                raise PdserveError(f"{name} did not come back: {p.message}",
                                   hint=f"`pdserve logs {cdir.name} {name}`")
        if pending and time.monotonic() > deadline:
            raise PdserveError(f"not ready again after {timeout:g}s: {', '.join(pending)}",
                               hint=f"`pdserve status {cdir.name}`")
        time.sleep(0.25)


def stop_cluster(cdir: ClusterDir, timeout: float) -> StopReport:
    """Stop everything: the supervisor (which stops its processes in order, with this timeout), then any
    survivor, in the same order (router, decode, prefill), its whole tree each; then check that nothing
    of the cluster is left. Works when the supervisor is gone; never signals a recycled pid."""
    state = cdir.read_state()
    sup = supervisor_process(state)
    if sup is not None:
        write_json_atomic(cdir.requests_dir / f"{time.time_ns()}.json", {"stop_timeout": timeout})
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(timeout=timeout * (len(state.processes) + 1) + 15)
        except psutil.TimeoutExpired:
            sup.kill()
        state = cdir.read_state() or state
    if state is None:
        return StopReport([], [], [])
    plan = stored_plan(cdir)
    order = [p.name for p in plan.stop_order()] if plan else []
    killed = []
    for name in sorted(state.processes, key=lambda n: order.index(n) if n in order else len(order)):
        rec = state.processes[name]
        try:
            if rec.handle is not None and stop_tree(launcher_for_handle(plan, rec.handle), rec.handle, timeout):
                killed.append(name)
        except HostUnreachable as err:      # reported below as left: `down` again once the host is back
            rec.message = f"{err.message}: may still run there"
    left = [name for name, alive in live_processes(cdir, state).items() if alive]
    busy = busy_ports(plan) if plan else []
    if plan:
        close_connections(plan)      # last: the checks above used them
    for name, rec in state.processes.items():
        if name not in left:
            rec.state, rec.handle = ProcState.STOPPED, None
    if state.phase != Phase.FAILED:
        state.phase = Phase.STOPPED
    cdir.write_state(state)
    return StopReport(killed, left, busy, gpu_memory_left(plan) if plan else [])


DOWN_GPU_SETTLE_S = 15.0   # before `down` reports a GPU still holding memory (gpus_still_holding says why)


def gpu_memory_left(plan: ClusterPlan, settle_s: float = DOWN_GPU_SETTLE_S, run=None,
                    sleep: Callable[[float], None] = time.sleep) -> list[GpuLeft]:
    """GPUs of the plan's servers on this machine (their CUDA_VISIBLE_DEVICES; nvidia-smi here sees no other
    host's) that still hold memory once settle_s has passed; [] when nothing is over the threshold or
    nvidia-smi is absent."""
    devices = sorted({d for p in plan.processes if not plan.is_remote(p)
                      for d in process_gpus(p.env.get("CUDA_VISIBLE_DEVICES"))})
    if not devices:
        return []
    return gpus_still_holding(devices, settle_s, run=run, sleep=sleep) or []


@dataclass
class StopReport:
    killed: list[str]       # processes that were still alive without a supervisor and had to be stopped here
    left: list[str]         # processes with something of their tree still alive after the stop
    busy_ports: list[str]   # the plan's ports still bound afterwards
    gpu_left: list[GpuLeft] = field(default_factory=list)   # the servers' GPUs still holding memory

    @property
    def clean(self) -> bool:
        return not self.left and not self.busy_ports and not self.gpu_left

    def raise_if_unclean(self, name: str) -> None:
        """`down`'s verdict: an error naming what is left of cluster `name`."""
        if self.left or self.busy_ports:
            raise PdserveError(f"{name} did not stop cleanly: "
                               + "; ".join([f"{p} still has live processes" for p in self.left] +
                                           [f"{b} still bound" for b in self.busy_ports] +
                                           [g.describe() for g in self.gpu_left]),
                               hint=f"`pdserve down {name}` again; `pdserve status {name}` shows what is left")
        if self.gpu_left:
            # Every process of the cluster is gone, yet its GPUs are not free: another program's, or memory
            # that a dead server's peer imported over CUDA IPC (freed only when that holder exits).
            raise PdserveError(f"{name} stopped, but " + "; ".join(g.describe() for g in self.gpu_left),
                               hint="`nvidia-smi` shows who holds it; memory that no process lists is held by a "
                                    "process that imported it over CUDA IPC or by a leftover engine: stop it "
                                    "before the next `pdserve up`")


def cluster_status(cdir: ClusterDir) -> dict[str, Any]:
    """The cluster as `status` shows it (its --json shape)."""
    state = cdir.read_state() or ClusterState(cdir.name, Phase.STOPPED, "")
    plan = stored_plan(cdir)
    alive = live_processes(cdir, state)
    sup_alive = supervisor_process(state) is not None
    now = time.time()
    processes = []
    for name, proc in state.processes.items():
        row = {"name": name, "role": proc.role, "state": proc.state.value,
               "pid": proc.handle.pid if proc.handle else None, "host": proc.host, "port": proc.port,
               "restarts": proc.restarts, "message": proc.message}
        # Without a supervisor nobody updates state.json: a dead process is simply stopped.
        if not alive.get(name) and not sup_alive and proc.state not in (ProcState.FATAL, ProcState.BACKOFF):
            row["state"] = ProcState.STOPPED.value
        row["uptime_s"] = round(now - proc.started_at, 1) if proc.started_at and alive.get(name) else None
        row["alive"] = alive.get(name, False)
        processes.append(row)
    running = sup_alive or any(alive.values())
    router_url = state.router_url or None
    return {
        "name": cdir.name, "phase": state.phase.value if running else "stopped", "running": running,
        "supervisor_alive": sup_alive, "error": state.error, "router_url": router_url,
        "processes": processes,
        "router": router_view(plan, router_url) if running and router_url else None,
        "transfers": _transfers(plan, state) if running and plan else None,
        "state_dir": str(cdir.root),
        "scrape_targets": str(cdir.targets_path),
    }


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


def router_view(plan: ClusterPlan | None, router_url: str) -> dict[str, Any] | None:
    """What the router reports; with replicas, each read on its own port and added up."""
    key = api_key_of(plan.router_config) if plan else None
    replicas = [p for p in plan.processes if p.role == ROUTER] if plan else []
    if len(replicas) > 1:
        return read_routers({p.name: p.url for p in replicas}, key)
    return read_router(router_url, key)


def stop_timeout_of(cdir: ClusterDir) -> float:
    """The stored plan's SIGTERM -> SIGKILL window (the spec's default when there is no plan)."""
    from pdserve.spec.schema import SupervisorSpec
    plan = stored_plan(cdir)
    return SupervisorSpec.model_validate(plan.supervisor if plan else {}).stop_timeout
