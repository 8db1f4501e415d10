"""Restart one process of a running cluster (PROCESS, e.g. decode-0), or all of them one at a time:
prefill replicas, then decode, then the router, each ready before the next, so roles with several
replicas keep serving. Returns when they answer their health checks again. Exit 3 when the cluster has
no running supervisor."""

from __future__ import annotations

import time

import typer

from pdserve.orchestrate import cluster
from pdserve.cli.completion import cluster_names
from pdserve.errors import NotRunningError
from pdserve.state.folder import ClusterDir
from pdserve.ui import console

NAME = "restart"


def command(
    name: str = typer.Argument(..., help="Cluster name.", autocompletion=cluster_names),
    process: str = typer.Argument(None, help="Process to restart (default: all, one at a time)."),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds to wait for them to be ready again."),
) -> None:
    cdir = cluster.find_cluster(name)
    before = cluster.request_restart(cdir, [process] if process else None)
    console.info(f"restarting {', '.join(before)}")
    started = time.monotonic()
    cluster.wait_restarted(cdir, before, timeout,
                           lambda n: console.info(f"{time.monotonic() - started:6.1f}s {n} ready again"))
