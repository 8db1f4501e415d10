"""The cluster's Prometheus scrape targets, for file-based service discovery (`file_sd_configs`): the router
and every server with its cluster, process, role and host labels. ClusterDir.write_state rewrites the file
with every change of state.json, so it follows restarts, processes on other hosts, and `down` (no targets).
docs/operations.md has the scrape config that reads it."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pdserve.state.records import ClusterState, Phase

# Phases with nothing to scrape: the cluster's targets leave Prometheus.
GONE = (Phase.STOPPED, Phase.FAILED)


def scrape_targets(state: ClusterState) -> list[dict[str, Any]]:
    """One target group per process, in the file_sd format: {"targets": ["host:port"], "labels": {...}}.
    A process that is down (restarting, given up) stays listed: Prometheus' `up` is then 0, the health
    the dashboard shows."""
    if state.phase in GONE:
        return []
    out = []
    for name, proc in state.processes.items():
        url = urlsplit(proc.url or "")
        if not url.netloc or url.scheme not in ("http", "https"):
            continue            # no address kept (an older pdserve), or no HTTP /metrics (Redis, the MPS daemon)
        address = url.netloc
        out.append({"targets": [address], "labels": {"cluster": state.cluster, "process": name,
                                                      "role": proc.role, "host": proc.host_name or "local"}})
    return out
