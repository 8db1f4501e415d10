"""Stop a cluster: router first, then decode, then prefill; SIGTERM to each process group, SIGKILL after
--timeout. Works even when the supervisor was killed (pids and start times come from the state file)."""

from __future__ import annotations

import typer

from pdserve.orchestrate import cluster
from pdserve.cli.completion import cluster_names
from pdserve.errors import NotRunningError, PdserveError
from pdserve.state.folder import ClusterDir, list_clusters
from pdserve.ui import console

NAME = "down"


def command(
    name: str = typer.Argument(None, help="Cluster name (default: the only cluster).",
                               autocompletion=cluster_names),
    timeout: float = typer.Option(20.0, "--timeout", help="Seconds between SIGTERM and SIGKILL per process."),
) -> None:
    if name is None:
        names = list_clusters()
        running = [n for n in names if cluster.is_running(ClusterDir(n))]
        if len(running) > 1:
            raise PdserveError(f"{len(running)} clusters are running: {', '.join(running)}",
                               hint="name one: `pdserve down NAME`", exit_code=2)
        if not running:
            raise NotRunningError("no cluster is running")
        name = running[0]
    cdir = ClusterDir(name)
    if not cdir.exists():
        raise NotRunningError(f"no cluster named {name}", hint="`pdserve status` lists the known clusters")
    if not cluster.is_running(cdir):
        console.info(f"{name} is already stopped")
        return
    console.info(f"stopping {name}")
    cluster.stop_cluster(cdir, timeout)
    console.info(f"{name} stopped")
