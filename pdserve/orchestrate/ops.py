"""The library operations, one per command (as `sky.launch()` is what `sky launch` calls): `up`, `down`,
`status`, `restart`, `logs`, `plan`, `doctor`. The CLI modules parse arguments, call their namesake here and
render what it returns; `bench` brings its arms up and down through the same functions. Progress goes out
through the callbacks a caller passes (plain strings, or the cluster state while it starts); nothing here
renders."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, overload

from pdserve.checks import doctor as live_checks
from pdserve.checks.findings import Finding
from pdserve.checks.preflight import machine_findings
from pdserve.errors import NotRunningError, UsageError
from pdserve.export import EXPORTERS, Export
from pdserve.launchers import LauncherKind, launcher_for_handle
from pdserve.launchers.base import Handle
from pdserve.launchers.local import environ_mark
from pdserve.observe import dashboard as grafana
from pdserve.observe.logfiles import follow, last_lines
from pdserve.observe.resources import TreeSampler, TreeUsage, gpu_memory_by_pid
from pdserve.orchestrate import lookup, restarts, start, stop
from pdserve.orchestrate.secrets import require_key
from pdserve.orchestrate.start import StartFailed
from pdserve.orchestrate.stop import StopReport
from pdserve.orchestrate.view import ClusterView, ProcessView, cluster_view
from pdserve.plan.records import ClusterPlan
from pdserve.spec.load import DEFAULT_CONFIG, load_spec
from pdserve.spec.schema import STARTUP_TIMEOUT_S, ClusterSpec
from pdserve.state.folder import ClusterDir, list_clusters, targets_dir
from pdserve.state.records import ClusterState, ProcState

__all__ = ["STARTUP_TIMEOUT_S", "ClusterState", "ProcState", "StartFailed", "StopReport", "UpInterrupted", "UpResult", "PlanResult", "Usage",
           "ClusterView", "ProcessView",
           "up", "stay_attached", "down", "status", "cluster_names", "restart", "logs", "follow_log", "plan",
           "doctor", "export", "EXPORT_TARGETS", "schema", "dashboard", "scrape_config", "stored_plan", "is_running",
           "processes_of"]

Note = Callable[[str], None]
OnState = Callable[[ClusterState | None], None]


def _quiet(*_: Any) -> None:
    pass


@contextlib.contextmanager
def _no_watch() -> Iterator[OnState]:
    yield _quiet


# -- up --------------------------------------------------------------------------------------------

@dataclass
class UpResult:
    name: str
    router_url: str
    stop_timeout: float
    took_s: float = 0.0
    restarted: list[str] = field(default_factory=list)   # a running cluster: the processes its change restarted
    supervisor: subprocess.Popen | None = None            # a start: the supervisor it launched

    @property
    def started(self) -> bool:
        return self.supervisor is not None


class UpInterrupted(KeyboardInterrupt):
    """Ctrl-C while the processes started: everything was stopped."""


def up(config: str | Path | None = None, *, note: Note = _quiet,
       watch: Callable[[], ContextManager[OnState]] = _no_watch,
       on_ready_again: Callable[[str, float], None] = _quiet, apply_to_running: bool = True) -> UpResult:
    """Start the cluster a cluster.yaml describes and return once every process is ready (StartFailed,
    after stopping everything, when one is not; Ctrl-C stops everything too). A supervisor that died while
    its servers kept running is replaced, re-attached to them. A running cluster gets only the processes
    whose plan changed restarted, one at a time (none: a no-op), unless `apply_to_running` is False, when
    it is refused as already running. `watch()` is entered while the processes start; what it yields gets
    each state read."""
    spec, plan, cdir = lookup.plan_from_file(config)
    config_path = Path(config) if config else DEFAULT_CONFIG
    if apply_to_running and lookup.has_supervisor(cdir):
        return _update_running(spec, plan, cdir, config_path, note, on_ready_again)
    if plan.builtin_model:
        note(f"model: built-in {spec.model} at {plan.model_path} (built on first use)")
    adopted = start.prepare(spec, plan, cdir, config_path)
    if adopted:
        note(f"{spec.name}: its supervisor was gone; re-attaching to live {', '.join(adopted)} "
             "after checking their identity")
    started = time.monotonic()
    note(f"starting {spec.name}: {len(plan.processes)} processes; logs in {cdir.logs_dir} "
         f"(`pdserve logs {spec.name} PROCESS`)")
    try:
        with watch() as on_update:
            supervisor = start.supervise_until_up(cdir, bool(adopted), on_update, spec.supervisor.stop_timeout)
    except KeyboardInterrupt:
        raise UpInterrupted() from None
    return UpResult(spec.name, plan.router_url, spec.supervisor.stop_timeout, time.monotonic() - started,
                    supervisor=supervisor)


def _update_running(spec: ClusterSpec, plan: ClusterPlan, cdir: ClusterDir, config_path: Path, note: Note,
                    on_ready_again: Callable[[str, float], None]) -> UpResult:
    """`up` of a running cluster: restart only what the config changed, one process at a time."""
    require_key(spec)
    before = start.apply_changes(plan, cdir, config_path)
    result = UpResult(plan.name, plan.router_url, spec.supervisor.stop_timeout, restarted=list(before))
    if not before:
        note(f"{plan.name} is running and its config is unchanged: nothing to do")
        return result
    note(f"{plan.name}: the config changed for {', '.join(before)}; restarting them one at a time")
    started = time.monotonic()
    restarts.wait_restarted(cdir, before, spec.supervisor.startup_timeout,
                           lambda n: on_ready_again(n, time.monotonic() - started))
    result.took_s = time.monotonic() - started
    return result


def stay_attached(result: UpResult, note: Note = _quiet, poll: float = 0.5) -> None:
    """`up --foreground`: return when the supervisor exits; Ctrl-C stops the cluster (without `down`'s
    checks of what is left)."""
    if result.supervisor is None:
        return
    try:
        while result.supervisor.poll() is None:
            time.sleep(poll)
    except KeyboardInterrupt:
        note("stopping")
        stop.stop_cluster(ClusterDir(result.name), result.stop_timeout)


# -- down ------------------------------------------------------------------------------------------

def down(name: str | None = None, timeout: float | None = None, *, note: Note = _quiet,
         strict: bool = True) -> StopReport | None:
    """Stop a cluster (None: the only one running) and check that nothing of it is left; None when it was
    already stopped. `timeout`: SIGTERM -> SIGKILL per process (None: the config's stop_timeout). Strict,
    anything left (a process, a bound port, GPU memory) is an error naming it; else the report says it."""
    if name is None:
        running = [n for n in list_clusters() if lookup.has_live_processes(ClusterDir(n))]
        if len(running) > 1:
            raise UsageError(f"{len(running)} clusters are running: {', '.join(running)}",
                             hint="name one: `pdserve down NAME`")
        if not running:
            raise NotRunningError("no cluster is running")
        name = running[0]
    cdir = lookup.find_cluster(name)
    if not lookup.has_live_processes(cdir):
        note(f"{name} is already stopped")
        return None
    if timeout is None:
        timeout = lookup.stop_timeout_of(cdir)
    note(f"stopping {name}")
    report = stop.stop_cluster(cdir, timeout)
    if strict:
        report.raise_if_unclean(name)
    note(f"{name} stopped")
    return report


# -- status ----------------------------------------------------------------------------------------

def cluster_names() -> list[str]:
    """Every cluster `up` has seen (its state folder has a plan)."""
    return list_clusters()


@overload
def status(name: str) -> ClusterView: ...
@overload
def status(name: None = None) -> list[ClusterView]: ...


def status(name: str | None = None) -> ClusterView | list[ClusterView]:
    """One cluster as `status NAME` shows it (exit 3 when there is no such cluster), or with no name,
    every known cluster's; `status --json` prints their to_json()."""
    if name is None:
        return [cluster_view(ClusterDir(n)) for n in list_clusters()]
    return cluster_view(lookup.find_cluster(name))


class Usage:
    """CPU, memory and GPU memory per process tree of a cluster's status, sampled on each call (CPU
    percentages cover the time since the previous call)."""

    def __init__(self) -> None:
        self._trees = TreeSampler()
        self.gpus_seen = False

    def sample(self, view: ClusterView) -> dict[str, TreeUsage]:
        gpu_by_pid = gpu_memory_by_pid()
        self.gpus_seen = gpu_by_pid is not None
        state = ClusterDir(view.name).read_state()
        handles = {name: proc.handle for name, proc in state.processes.items()} if state else {}
        return {p.name: self._sample(handles.get(p.name) if p.alive else None, gpu_by_pid)
                for p in view.processes}

    def _sample(self, handle: Handle | None, gpu_by_pid: dict[int, int] | None) -> TreeUsage:
        """The tree as the launchers find it: the leader's group and session, and its marker."""
        if handle is None:
            return self._trees.sample(None)
        return self._trees.sample(handle.pid, gpu_by_pid, handle.start_time, environ_mark(handle.marker))


# -- restart ---------------------------------------------------------------------------------------

def restart(name: str, processes: list[str] | None = None, timeout: float = STARTUP_TIMEOUT_S, *,
            on_requested: Callable[[list[str]], None] = _quiet,
            on_ready_again: Callable[[str, float], None] = _quiet) -> None:
    """Restart some processes of a running cluster (None: all), one at a time in start order, each ready
    before the next; returns when all are ready again (an error after `timeout`)."""
    cdir = lookup.find_cluster(name)
    before = restarts.request_restart(cdir, processes)
    on_requested(list(before))
    started = time.monotonic()
    restarts.wait_restarted(cdir, before, timeout, lambda n: on_ready_again(n, time.monotonic() - started))


def processes_of(name: str, role: str) -> list[str]:
    """The names of a cluster's processes in one role, as its state file lists them."""
    state = ClusterDir(name).read_state()
    return [n for n, p in (state.processes if state else {}).items() if p.role == role]


# -- logs ------------------------------------------------------------------------------------------

def _remote_handles(cdir: ClusterDir) -> dict:
    """Process name -> (launcher, handle) for processes whose log lives on another host."""
    state, plan = cdir.read_state(), lookup.stored_plan(cdir)
    if state is None or plan is None:
        return {}
    return {name: (launcher_for_handle(plan, rec.handle), rec.handle) for name, rec in state.processes.items()
            if rec.handle is not None and rec.handle.launcher is not LauncherKind.LOCAL}


def _log_names(name: str, process: str | None) -> tuple[ClusterDir, dict, list[str]]:
    cdir = lookup.find_cluster(name)
    remote = _remote_handles(cdir)
    available = sorted({p.stem for p in cdir.logs_dir.glob("*.log")} | set(remote))
    if process is not None and process not in available:
        raise UsageError(f"no log for process {process!r} in cluster {name}",
                         hint=f"processes with logs: {', '.join(available) or 'none'}")
    return cdir, remote, [process] if process else available


def logs(name: str, process: str | None = None, lines: int = 40) -> dict[str, list[str]]:
    """Process name -> the last lines of its log (every process's when `process` is None), wherever the
    log lives."""
    cdir, remote, names = _log_names(name, process)
    return {proc: remote[proc][0].read_log(remote[proc][1], lines) if proc in remote
            else last_lines(cdir.log_path(proc), lines) for proc in names}


def follow_log(name: str, process: str | None = None) -> Iterator[str]:
    """New lines of one process's log as they are written (None: the cluster's only log); local logs only."""
    cdir, remote, names = _log_names(name, process)
    if len(names) != 1:
        raise UsageError("--follow needs one PROCESS", hint=f"e.g. `pdserve logs {name} router -f`")
    launcher, handle = remote.get(names[0], (None, None))
    if handle is not None and handle.launcher is LauncherKind.SSH:
        tail = launcher.shell_command(handle.host, ["tail", "-F", handle.log_path])
        raise UsageError(f"{names[0]}'s log is on host {handle.host}: --follow reads local logs only",
                         hint=f"follow it there with: {tail}")
    return follow(cdir.log_path(names[0]))     # a Slurm step's output is forwarded to the local log


# -- plan and doctor -------------------------------------------------------------------------------

@dataclass
class PlanResult:
    spec: ClusterSpec
    plan: ClusterPlan
    state_dir: Path
    findings: list[Finding]

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "fail"]


def plan(config: str | Path | None = None) -> PlanResult:
    """The exact processes `up` would start, checked against this machine (and its hosts); starts nothing."""
    spec, cplan, cdir = lookup.plan_from_file(config)
    findings = machine_findings(spec, cplan, None if lookup.has_supervisor(cdir) else lookup.busy_ports(cplan))
    return PlanResult(spec, cplan, cdir.root, findings)


def doctor(config: str | Path | None = None, min_gbps: float | None = None) -> list[Finding]:
    """The machine checks, and when the cluster runs, the live ones: its router answers, a canary moves KV
    from prefill to decode and back at least min_gbps fast (default: the plan's floor), each server's NIXL
    rate over its life (a warning below it)."""
    spec, cplan, cdir = lookup.plan_from_file(config)
    running = lookup.has_live_processes(cdir)
    findings = machine_findings(spec, cplan, None if running else lookup.busy_ports(cplan))
    if running:
        findings += live_checks.live_findings(cplan, min_gbps)
    else:
        findings.append(Finding("ok", "cluster", f"{spec.name} is not running: live checks skipped"))
    return findings


# -- export ----------------------------------------------------------------------------------------

EXPORT_TARGETS = tuple(EXPORTERS)


def export(target: str, config: str | Path | None = None, **options: Any) -> Export:
    """The cluster a cluster.yaml describes, as objects for another place to run it (pdserve/export/): the
    servers' argv and env are the plan's, host-specific values replaced. Starts nothing, reads no state."""
    if target not in EXPORTERS:
        raise UsageError(f"unknown export target {target!r}", hint=f"one of {', '.join(EXPORTERS)}")
    return EXPORTERS[target](load_spec(config or DEFAULT_CONFIG), **options)


def schema() -> dict[str, Any]:
    """The JSON Schema of cluster.yaml, generated from the config models."""
    return ClusterSpec.model_json_schema()


# -- dashboard and scrape-config -------------------------------------------------------------------

def dashboard() -> dict[str, Any]:
    """The Grafana dashboard pdserve ships (JSON to import: Dashboards > New > Import)."""
    return grafana.dashboard()


def scrape_config(interval: str = "15s") -> str:
    """A Prometheus config that scrapes every cluster through the target files its supervisor writes
    ($PDSERVE_HOME/prometheus/<cluster>.json)."""
    return grafana.scrape_config(targets_dir(), interval)


# -- what bench reads of a cluster -----------------------------------------------------------------

def stored_plan(name: str) -> ClusterPlan | None:
    """The plan a cluster was started with (None when it has none)."""
    return lookup.stored_plan(ClusterDir(name))


def is_running(name: str) -> bool:
    """The supervisor or any process of the cluster is alive."""
    return lookup.has_live_processes(ClusterDir(name))
