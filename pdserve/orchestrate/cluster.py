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
from pathlib import Path
from typing import Any

import psutil

from pdserve.errors import ConfigError, NotRunningError, PdserveError
from pdserve.launchers import local
from pdserve.plan.build import build_plan
from pdserve.plan.records import ClusterPlan
from pdserve.checks.preflight import machine_findings
from pdserve.observe.routerstats import api_key_for, read_router
from pdserve.spec.load import DEFAULT_CONFIG, load_spec
from pdserve.spec.schema import ClusterSpec
from pdserve.state.folder import ClusterDir, models_dir, tail_lines, write_json_atomic

TERMINAL_PHASES = ("running", "failed", "stopped", "degraded")


def plan_from_file(path: str | Path | None) -> tuple[ClusterSpec, ClusterPlan, ClusterDir]:
    spec = load_spec(path or DEFAULT_CONFIG)
    cdir = ClusterDir(spec.name)
    plan = build_plan(spec, python=sys.executable, cluster_dir=cdir.root, models_dir=models_dir())
    return spec, plan, cdir


def supervisor_process(state: dict[str, Any] | None) -> psutil.Process | None:
    sup = (state or {}).get("supervisor") or {}
    return local.same_process(sup.get("pid"), sup.get("create_time"))


def live_processes(cdir: ClusterDir, state: dict[str, Any] | None = None) -> dict[str, bool]:
    """Process name -> whether a process of it is alive (checked by pid + start time, then marker)."""
    state = state if state is not None else cdir.read_state() or {}
    procs = state.get("processes") or {}
    alive = {name: local.same_process(p.get("pid"), p.get("create_time")) is not None for name, p in procs.items()}
    unseen = {procs[name].get("marker", ""): name for name, ok in alive.items() if not ok}
    for marker, found in local.processes_by_marker(unseen).items():
        alive[unseen[marker]] = bool(found)
    return alive


def is_running(cdir: ClusterDir) -> bool:
    state = cdir.read_state()
    return bool(supervisor_process(state)) or any(live_processes(cdir, state).values())


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
    if before.router_config != new.router_config and "router" not in changed:
        changed.append("router")
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
    alive = [name for name, ok in live_processes(cdir, state).items() if ok] if state else []
    if alive:
        changed = changed_processes(cdir.read_plan(), plan)
        if changed:
            raise PdserveError(f"{spec.name} still runs without its supervisor, and the config changed for "
                               f"{', '.join(changed)}", hint=f"`pdserve down {spec.name}` first, then `pdserve up`")
    failed = [f for f in machine_findings(spec, plan, None) if f.level == "fail"]
    if failed:
        raise PdserveError("; ".join(f"{f.check}: {f.message}" for f in failed), hint=failed[0].hint,
                           exit_code=2)
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


def wait_for_phase(cdir: ClusterDir, supervisor: subprocess.Popen, on_update: Callable[[dict], None],
                   poll: float = 0.5) -> dict[str, Any]:
    """Poll state.json until the cluster is up, failed, or the supervisor died. Only a state written by
    this supervisor counts: on re-attach, state.json still says "running" from the one that died."""
    def ours(state: dict[str, Any]) -> bool:
        return (state.get("supervisor") or {}).get("pid") == supervisor.pid

    while True:
        state = cdir.read_state() or {}
        on_update(state)
        if ours(state) and state.get("phase") in TERMINAL_PHASES:
            return state
        if supervisor.poll() is not None:
            state = cdir.read_state() or {}
            if not ours(state) or state.get("phase") not in TERMINAL_PHASES:
                # A dead predecessor's error is not this supervisor's: show this one's log instead.
                own_error = state.get("error") if ours(state) else None
                state["phase"] = "failed"
                state["error"] = own_error or (
                    "the supervisor exited: " + " | ".join(tail_lines(cdir.supervisor_log, 3)))
            return state
        time.sleep(poll)


def failure_details(cdir: ClusterDir, state: dict[str, Any], lines: int = 20) -> tuple[str, list[str]]:
    """The process that failed and the end of its log."""
    for name, proc in (state.get("processes") or {}).items():
        if proc.get("state") == "fatal":
            return name, tail_lines(cdir.log_path(name), lines)
    return "supervisor", tail_lines(cdir.supervisor_log, lines)


RESTART_ORDER = {"prefill": 0, "decode": 1, "router": 2}


def request_restart(cdir: ClusterDir, names: list[str] | None, reload: bool = False) -> dict[str, int]:
    """Ask the running supervisor to restart some processes (None: all), one at a time in a safe order
    (prefill replicas, then decode, then the router); with `reload`, from the plan now on disk. Returns
    each one's restart count before the request."""
    state = cdir.read_state() or {}
    if supervisor_process(state) is None:
        raise NotRunningError(f"cluster {cdir.name} has no running supervisor",
                              hint=f"`pdserve up` re-attaches to live processes; `pdserve status {cdir.name}`")
    procs = state.get("processes") or {}
    unknown = [n for n in names or [] if n not in procs]
    if unknown:
        raise ConfigError(f"no process {unknown[0]!r} in cluster {cdir.name}", hint=f"processes: {', '.join(procs)}")
    order = sorted(names if names is not None else procs, key=lambda n: RESTART_ORDER.get(procs[n].get("role"), 9))
    write_json_atomic(cdir.requests_dir / f"{time.time_ns()}.json", {"restart": order, "reload": reload})
    return {n: int(procs[n].get("restarts") or 0) for n in order}


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
    write_json_atomic(Path(plan.router_config_path), plan.router_config)
    return request_restart(cdir, changed, reload=True)


def wait_restarted(cdir: ClusterDir, before: dict[str, int], timeout: float,
                   on_ready: Callable[[str], None]) -> None:
    """Until each process has restarted and is ready again; a fatal one or the timeout is an error."""
    deadline = time.monotonic() + timeout
    pending = dict(before)
    while pending:
        procs = (cdir.read_state() or {}).get("processes") or {}
        for name in list(pending):
            p = procs.get(name) or {}
            if int(p.get("restarts") or 0) <= pending[name]:
                continue                          # the supervisor has not restarted it yet
            if p.get("state") == "ready":
                del pending[name]
                on_ready(name)
            elif p.get("state") == "fatal":
                raise PdserveError(f"{name} did not come back: {p.get('message')}",
                                   hint=f"`pdserve logs {cdir.name} {name}`")
        if pending and time.monotonic() > deadline:
            raise PdserveError(f"not ready again after {timeout:g}s: {', '.join(pending)}",
                               hint=f"`pdserve status {cdir.name}`")
        time.sleep(0.25)


def stop_cluster(cdir: ClusterDir, timeout: float = 20.0) -> list[str]:
    """Stop everything: the supervisor (which stops its processes in order), then any survivor, in the
    same order (router, decode, prefill). Works when the supervisor is gone; never kills a recycled pid."""
    state = cdir.read_state() or {}
    sup = supervisor_process(state)
    if sup is not None:
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(timeout=timeout * 3 + 10)
        except psutil.TimeoutExpired:
            sup.kill()
    state = cdir.read_state() or state
    plan_data = cdir.read_plan()
    order = [p.name for p in ClusterPlan.from_dict(plan_data).stop_order()] if plan_data else []
    procs = state.get("processes") or {}
    killed = []
    for name in sorted(procs, key=lambda n: order.index(n) if n in order else len(order)):
        proc = procs[name]
        if local.stop(proc.get("pid"), proc.get("create_time"), proc.get("marker", ""), timeout):
            killed.append(name)
        proc.update(state="stopped", pid=None)
    if state:
        state["phase"] = "stopped" if state.get("phase") != "failed" else "failed"
        cdir.write_state(state)
    return killed


def cluster_status(cdir: ClusterDir) -> dict[str, Any]:
    state = cdir.read_state() or {}
    alive = live_processes(cdir, state)
    sup_alive = supervisor_process(state) is not None
    now = time.time()
    processes = []
    for name, proc in (state.get("processes") or {}).items():
        row = {"name": name, **{k: proc.get(k) for k in ("role", "state", "pid", "host", "port", "restarts",
                                                           "message")}}
        # Without a supervisor nobody updates state.json: a dead process is simply stopped.
        if not alive.get(name) and not sup_alive and row["state"] not in ("fatal", "backoff"):
            row["state"] = "stopped"
        started = proc.get("started_at")
        row["uptime_s"] = round(now - started, 1) if started and alive.get(name) else None
        row["alive"] = alive.get(name, False)
        processes.append(row)
    running = sup_alive or any(alive.values())
    router_url = state.get("router_url")
    return {
        "name": cdir.name, "phase": state.get("phase") if running else "stopped", "running": running,
        "supervisor_alive": sup_alive, "error": state.get("error"), "router_url": router_url,
        "processes": processes,
        "router": read_router(router_url, api_key_for(cdir.root / "router.json")) if running and router_url else None,
        "state_dir": str(cdir.root),
    }
