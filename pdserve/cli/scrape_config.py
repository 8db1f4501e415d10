"""Print a Prometheus config (YAML) that scrapes every pdserve cluster through the target files the
supervisors keep current ($PDSERVE_HOME/prometheus/<cluster>.json: router and servers, labels cluster,
process, role, host)."""

from __future__ import annotations

import typer

from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "scrape-config"


def command(interval: str = typer.Option("15s", "--interval", help="scrape_interval (a Prometheus duration)")) -> None:
    console.print_text(ops.scrape_config(interval))
