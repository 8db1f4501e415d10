"""Print the Grafana dashboard pdserve ships (JSON): TTFT, reuse hits and misses, tokens pulled vs computed,
KV transfer GB/s per direction, server health, load, breakers, restarts and degraded mode, from the
router's and vLLM's metrics. Import it in Grafana with a Prometheus data source that runs `pdserve scrape-config`."""

from __future__ import annotations

from pdserve.orchestrate import ops
from pdserve.ui import console

NAME = "dashboard"


def command() -> None:
    console.print_json(ops.dashboard())
