"""Stop a cluster: router first, then decode, then prefill; SIGTERM to each process's whole tree (its session,
its group, whatever carries its marker), SIGKILL after --timeout. Works even when the supervisor was killed
(pids and start times come from the state file). Then checks that no process of the cluster is alive and
no port of its plan is bound and that the servers' GPUs hold no more than 1 GiB each (nvidia-smi, where
there is one), and fails (exit 1) naming what is left."""

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
    if report.left or report.busy_ports:
        raise PdserveError(f"{name} did not stop cleanly: "
                           + "; ".join([f"{p} still has live processes" for p in report.left] +
                                       [f"{b} still bound" for b in report.busy_ports] +
                                       [g.describe() for g in report.gpu_left]),
                           hint=f"`pdserve down {name}` again; `pdserve status {name}` shows what is left")
    if report.gpu_left:
        # Every process of the cluster is gone, yet its GPUs are not free: another program's, or memory
        # that a dead server's peer imported over CUDA IPC (freed only when that holder exits).
        raise PdserveError(f"{name} stopped, but " + "; ".join(g.describe() for g in report.gpu_left),
                           hint="`nvidia-smi` shows who holds it; memory that no process lists is held by a "
                                "process that imported it over CUDA IPC or by a leftover engine: stop it "
                                "before the next `pdserve up`")
    console.info(f"{name} stopped")
