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

from pdserve.orchestrate import ops
from pdserve.ui import console
from pdserve.ui.units import address

NAME = "up"
STATE_STYLE = {"ready": "green", "starting": "yellow", "backoff": "yellow", "unhealthy": "red",
               "fatal": "bold red", "stopping": "dim", "stopped": "dim"}


def progress_table(state: ops.ClusterState | None, started: float) -> Table:
    table = Table(title=f"starting {state.cluster if state else ''} ({time.monotonic() - started:.0f}s)",
                  title_justify="left")
    for col in ("process", "state", "pid", "address", "detail"):
        table.add_column(col)
    for name, proc in (state.processes if state else {}).items():
        st = proc.state.value
        table.add_row(name, f"[{STATE_STYLE.get(st, '')}]{st}[/]", str(proc.handle.pid if proc.handle else ""),
                      address(proc.host, proc.port), proc.message)
    return table


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: the embedded configs/local-cpu.yaml)"),
    foreground: bool = typer.Option(False, "--foreground", "-f",
                                    help="Stay attached; Ctrl-C stops the cluster (like `down`)."),
) -> None:
    try:
        result = ops.up(config, note=console.info, watch=_progress,
                        on_ready_again=lambda n, took: console.info(f"{took:6.1f}s {n} ready again"))
    except ops.UpInterrupted:
        console.info("interrupted: the cluster was stopped")
        raise typer.Exit(130) from None
    except ops.StartFailed as failed:
        for line in failed.log_lines:
            console.err.print(f"  {failed.process}| {line}", markup=False, highlight=False)
        raise
    if result.started:
        console.info(f"{result.name} is ready in {result.took_s:.0f}s")
    console.out.print(result.router_url + "/v1", highlight=False)
    if foreground:
        ops.stay_attached(result, note=console.info)


@contextlib.contextmanager
def _progress():
    """A live table on a terminal, else one line per state change."""
    started = time.monotonic()
    if not console.is_tty():
        last: dict[str, ops.ProcState] = {}

        def plain(state: ops.ClusterState | None) -> None:
            for name, proc in (state.processes if state else {}).items():
                if last.get(name) != proc.state:
                    last[name] = proc.state
                    console.info(f"{time.monotonic() - started:6.1f}s {name:<10} {proc.state.value}")
        yield plain
        return
    with Live(progress_table(None, started), console=console.err, refresh_per_second=4, transient=False) as live:
        yield lambda s: live.update(progress_table(s, started))
