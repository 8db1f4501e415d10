"""`up`: from a plan to a supervised cluster (prepare the state folder, start the supervisor, wait until it
runs), or the changes of a new plan applied to a running one (only the processes whose plan changed restart)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.checks.preflight import machine_findings
from pdserve.errors import EXIT_BAD_INPUT, PdserveError
from pdserve.observe.logfiles import last_lines, root_cause
from pdserve.orchestrate.lookup import busy_ports, live_processes, supervisor_process
from pdserve.orchestrate.restarts import request_restart
from pdserve.orchestrate.secrets import require_key, secret_env, stale_secrets
from pdserve.orchestrate.stop import stop_cluster
from pdserve.plan.records import ClusterPlan
from pdserve.plan.routers import MEMORY_STORE, SECRET_FILE
from pdserve.roles import ROUTER
from pdserve.spec.schema import ClusterSpec
from pdserve.state.folder import ClusterDir, models_dir, write_json_atomic
from pdserve.state.records import ClusterState, Phase, ProcState
from pdserve.state.secret import ensure_secret


def write_plan_files(plan: ClusterPlan, cdir: ClusterDir, config_path: Path | None) -> None:
    """What the plan's processes read, before one starts: the cluster.yaml kept, plan.json, a shared store's
    secret (the managed Redis includes it, routers namespace the cluster's keys by it: state/secret.py) and
    router.json."""
    if config_path:
        shutil.copyfile(config_path, cdir.spec_path)
    write_json_atomic(cdir.plan_path, plan.to_dict())
    if plan.router_config.get("store", MEMORY_STORE) != MEMORY_STORE:
        ensure_secret(cdir.root / SECRET_FILE)
    write_json_atomic(Path(plan.router_config_path), plan.router_config)


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
    require_key(spec)
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
    write_plan_files(plan, cdir, config_path)
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


def apply_changes(plan: ClusterPlan, cdir: ClusterDir, config_path: Path | None) -> dict[str, int]:
    """`up` of a running cluster: restart only the processes whose plan changed (none: a no-op)."""
    stored = cdir.read_plan()
    old = ClusterPlan.from_dict(stored)
    if [p.name for p in old.processes] != [p.name for p in plan.processes]:
        raise PdserveError(f"{plan.name} is running with other processes than this config describes "
                           "(replicas changed)", hint=f"`pdserve down {plan.name}` then `pdserve up`")
    changed = changed_processes(stored, plan)
    changed += [n for n in stale_secrets(plan, cdir.read_state()) if n not in changed]
    if not changed:
        return {}
    moved = {p.name for p in plan.processes
             if (p.port, p.side_channel_ports) != (old.by_name(p.name).port, old.by_name(p.name).side_channel_ports)}
    busy = busy_ports(plan, skip={p.name for p in plan.processes} - moved)
    if busy:
        raise PdserveError(f"ports already in use: {', '.join(busy)}", hint="change the ports in the config")
    write_plan_files(plan, cdir, config_path)
    return request_restart(cdir, changed, reload=True, env=secret_env(plan))
