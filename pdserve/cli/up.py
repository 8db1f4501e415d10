"""Validate a cluster.yaml, start prefill, decode and router under a background supervisor, and return
when all answer their health checks. With no file, runs the embedded CPU default (configs/local-cpu.yaml),
building its small random-weight model on first use. If the cluster's supervisor died while its servers
kept running, `up` with the same config re-attaches to them (checking pid, start time and marker) instead
of starting duplicates. `up` of a running cluster restarts only the processes whose plan changed (one at a
time), and is a no-op that says so when nothing changed."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import typer
from rich.live import Live
from rich.table import Table

from pdserve.orchestrate import cluster
from pdserve.spec.load import DEFAULT_CONFIG
from pdserve.state.records import ClusterState, ProcState
from pdserve.ui import console

NAME = "up"
STATE_STYLE = {"ready": "green", "starting": "yellow", "backoff": "yellow", "unhealthy": "red",
               "fatal": "bold red", "stopping": "dim", "stopped": "dim"}


def progress_table(state: ClusterState | None, started: float) -> Table:
    table = Table(title=f"starting {state.cluster if state else ''} ({time.monotonic() - started:.0f}s)",
                  title_justify="left")
    for col in ("process", "state", "pid", "address", "detail"):
        table.add_column(col)
    for name, proc in (state.processes if state else {}).items():
        st = proc.state.value
        table.add_row(name, f"[{STATE_STYLE.get(st, '')}]{st}[/]", str(proc.handle.pid if proc.handle else ""),
                      f"{proc.host}:{proc.port}", proc.message)
    return table


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: the embedded configs/local-cpu.yaml)"),
    foreground: bool = typer.Option(False, "--foreground", "-f",
                                    help="Stay attached; Ctrl-C stops the cluster (like `down`)."),
) -> None:
    spec, plan, cdir = cluster.plan_from_file(config)
    if cluster.has_supervisor(cdir):
        return _update_running(plan, cdir, config)
    if plan.builtin_model:
        console.info(f"model: built-in {spec.model} at {plan.model_path} (built on first use)")
    adopted = cluster.prepare(spec, plan, cdir, Path(config) if config else DEFAULT_CONFIG)
    if adopted:
        console.info(f"{spec.name}: its supervisor was gone; re-attaching to live {', '.join(adopted)} "
                     "after checking their identity")
    started = time.monotonic()
    console.info(f"starting {spec.name}: {len(plan.processes)} processes; logs in {cdir.logs_dir} "
                 f"(`pdserve logs {spec.name} PROCESS`)")
    try:
        with _progress(started) as on_update:
            supervisor = cluster.supervise_until_up(cdir, bool(adopted), on_update, spec.supervisor.stop_timeout)
    except KeyboardInterrupt:
        console.info("interrupted: the cluster was stopped")
        raise typer.Exit(130) from None
    except cluster.StartFailed as failed:
        for line in failed.log_lines:
            console.err.print(f"  {failed.process}| {line}", markup=False, highlight=False)
        raise
    console.info(f"{spec.name} is ready in {time.monotonic() - started:.0f}s")
    console.out.print(plan.router.url + "/v1", highlight=False)
    if foreground:
        try:
            while supervisor.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            console.info("stopping")
            cluster.stop_cluster(cdir, spec.supervisor.stop_timeout)


def _update_running(plan, cdir, config: Path | None) -> None:
    """`up` of a running cluster: restart only what the config changed, one process at a time."""
    before = cluster.apply_changes(plan, cdir, Path(config) if config else DEFAULT_CONFIG)
    if not before:
        console.info(f"{plan.name} is running and its config is unchanged: nothing to do")
    else:
        console.info(f"{plan.name}: the config changed for {', '.join(before)}; restarting them one at a time")
        started = time.monotonic()
        cluster.wait_restarted(cdir, before, plan.supervisor.get("startup_timeout", 900.0),
                               lambda n: console.info(f"{time.monotonic() - started:6.1f}s {n} ready again"))
    console.out.print(plan.router.url + "/v1", highlight=False)


@contextlib.contextmanager
def _progress(started: float):
    """A live table on a terminal, else one line per state change."""
    if not console.is_tty():
        last: dict[str, ProcState] = {}

        def plain(state: ClusterState | None) -> None:
            for name, proc in (state.processes if state else {}).items():
                if last.get(name) != proc.state:
                    last[name] = proc.state
                    console.info(f"{time.monotonic() - started:6.1f}s {name:<10} {proc.state.value}")
        yield plain
        return
    with Live(progress_table(None, started), console=console.err, refresh_per_second=4, transient=False) as live:
        yield lambda s: live.update(progress_table(s, started))
