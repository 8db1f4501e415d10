"""Stop a cluster: router first, then decode, then prefill; SIGTERM to each process's whole tree (its session,
its group, whatever carries its marker), SIGKILL after --timeout. Works even when the supervisor was killed
(pids and start times come from the state file). Then checks that no process of the cluster is alive and
no port of its plan is bound, and fails (exit 1) naming what is left."""

from __future__ import annotations

import typer

from pdserve.orchestrate import cluster
from pdserve.cli.completion import cluster_names
from pdserve.errors import NotRunningError, PdserveError, UsageError
from pdserve.state.folder import ClusterDir, list_clusters
from pdserve.ui import console

NAME = "down"


def command(
    name: str = typer.Argument(None, help="Cluster name (default: the only cluster).",
                               autocompletion=cluster_names),
    timeout: float = typer.Option(None, "--timeout", help="Seconds between SIGTERM and SIGKILL per process "
                                                         "(default: the config's supervisor.stop_timeout)."),
) -> None:
    if name is None:
        names = list_clusters()
        running = [n for n in names if cluster.has_live_processes(ClusterDir(n))]
        if len(running) > 1:
            raise UsageError(f"{len(running)} clusters are running: {', '.join(running)}",
                             hint="name one: `pdserve down NAME`")
        if not running:
            raise NotRunningError("no cluster is running")
        name = running[0]
    cdir = cluster.find_cluster(name)
    if not cluster.has_live_processes(cdir):
        console.info(f"{name} is already stopped")
        return
    if timeout is None:
        timeout = cluster.stop_timeout_of(cdir)
    console.info(f"stopping {name}")
    report = cluster.stop_cluster(cdir, timeout)
    if not report.clean:
        raise PdserveError(f"{name} did not stop cleanly: "
                           + "; ".join([f"{p} still has live processes" for p in report.left] +
                                       [f"{b} still bound" for b in report.busy_ports]),
                           hint=f"`pdserve down {name}` again; `pdserve status {name}` shows what is left")
    console.info(f"{name} stopped")
