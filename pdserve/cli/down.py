"""Stop a cluster: router first, then decode, then prefill; SIGTERM to each process's whole tree (its session,
its group, whatever carries its marker), SIGKILL after --timeout. Works even when the supervisor was killed
(pids and start times come from the state file). Then checks that no process of the cluster is alive and
no port of its plan is bound and that the servers' GPUs hold no more than 1 GiB each (nvidia-smi, where
there is one), and fails (exit 1) naming what is left."""

from __future__ import annotations

import typer

from pdserve.cli.completion import cluster_names
from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "down"


def command(
    name: str = typer.Argument(None, help="Cluster name (default: the only cluster).",
                               autocompletion=cluster_names),
    timeout: float = typer.Option(None, "--timeout", help="Seconds between SIGTERM and SIGKILL per process "
                                                         "(default: the config's supervisor.stop_timeout)."),
) -> None:
    ops.down(name, timeout, note=console.info)
