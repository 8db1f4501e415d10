"""Restart one process of a running cluster (PROCESS, e.g. decode-0), or all of them one at a time:
prefill replicas, then decode, then the router, each ready before the next, so roles with several
replicas keep serving. Returns when they answer their health checks again. Exit 3 when the cluster has
no running supervisor."""

from __future__ import annotations

import typer

from pdserve.cli.completion import cluster_names
from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "restart"


def command(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    process: str = typer.Argument(None, help="Process to restart (default: all, one at a time)."),
    timeout: float = typer.Option(ops.STARTUP_TIMEOUT_S, "--timeout",
                                  help="Seconds to wait for them to be ready again."),
) -> None:
    ops.restart(name, [process] if process else None, timeout,
                on_requested=lambda names: console.info(f"restarting {', '.join(names)}"),
                on_ready_again=lambda n, took: console.info(f"{took:6.1f}s {n} ready again"))
