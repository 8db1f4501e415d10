"""Show a cluster's logs: one process's (PROCESS, e.g. decode-0, router, supervisor) or the last lines of
every process's. Logs live in $PDSERVE_HOME/clusters/NAME/logs/ and are rotated by size (NAME.log.1, ...).
Exit 3 when there is no such cluster."""

from __future__ import annotations

import sys

import typer

from pdserve.cli.completion import cluster_names
from pdserve.errors import UsageError
from pdserve.launchers import LauncherKind, launcher_for_handle
from pdserve.orchestrate import cluster
from pdserve.observe.logfiles import follow, last_lines
from pdserve.plan.records import ClusterPlan
from pdserve.state.folder import ClusterDir

NAME = "logs"


def command(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    process: str = typer.Argument(None, help="Process name (prefill-0, decode-0, router, supervisor); "
                                             "default: all of them."),
    lines: int = typer.Option(40, "-n", "--lines", help="How many of the last lines to show."),
    follow_: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines (Ctrl-C stops)."),
) -> None:
    cdir = cluster.find_cluster(name)
    remote = _remote_handles(cdir)
    available = sorted({p.stem for p in cdir.logs_dir.glob("*.log")} | set(remote))
    if process is not None and process not in available:
        raise UsageError(f"no log for process {process!r} in cluster {name}",
                          hint=f"processes with logs: {', '.join(available) or 'none'}")
    names = [process] if process else available
    out = sys.stdout
    for proc in names:
        prefix = f"{proc}| " if len(names) > 1 else ""
        got = remote[proc][0].read_log(remote[proc][1], lines) if proc in remote else last_lines(cdir.log_path(proc), lines)
        for line in got:
            out.write(prefix + line + "\n")
    out.flush()
    if follow_:
        if len(names) != 1:
            raise UsageError("--follow needs one PROCESS", hint=f"e.g. `pdserve logs {name} router -f`")
        if names[0] in remote:
            handle = remote[names[0]][1]
            raise UsageError(f"{names[0]}'s log is on host {handle.host}: --follow reads local logs only",
                             hint=f"ssh {handle.host} tail -F {handle.log_path}")
        try:
            for line in follow(cdir.log_path(names[0])):
                out.write(line + "\n")
                out.flush()
        except KeyboardInterrupt:
            pass


def _remote_handles(cdir: ClusterDir) -> dict:
    """Process name -> (launcher, handle) for processes whose log lives on another host."""
    state, plan = cdir.read_state(), cdir.read_plan()
    if state is None or not plan:
        return {}
    cplan = ClusterPlan.from_dict(plan)
    return {name: (launcher_for_handle(cplan, rec.handle), rec.handle) for name, rec in state.processes.items()
            if rec.handle is not None and rec.handle.launcher is not LauncherKind.LOCAL}
