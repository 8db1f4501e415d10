"""What the running router knows, read from its /metrics: turns, reuse outcomes and per-backend health."""

from __future__ import annotations

import json
import os
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

BACKEND_GAUGES = {"pdserve_router_backend_healthy": "healthy", "pdserve_router_backend_breaker_open": "breaker_open",
                  "pdserve_router_backend_in_flight": "in_flight"}


def api_key_for(router_config_path: Path) -> str | None:
    """The key the router wants, from the environment variable its config names (None if unset)."""
    try:
        name = json.loads(router_config_path.read_text()).get("api_key_env")
    except (OSError, ValueError):
        return None
    return os.environ.get(name) if name else None


def read_router(router_url: str, api_key: str | None = None, timeout: float = 2.0) -> dict[str, Any] | None:
    """Reuse counters and backend health from the router; None when it does not answer."""
    req = urllib.request.Request(router_url + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return parse_metrics(resp.read().decode())
    except OSError:
        return None


def parse_metrics(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": 0.0, "reuse_hits": 0.0, "reuse_misses": 0.0, "reuse_tokens_offered": 0.0,
                           "reuse_tokens_pulled": 0.0, "prefill_tokens_local_cached": 0.0,
                           "entries_unavailable": 0.0}
    misses: Counter[str] = Counter()
    backends: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name, labels = s.name, s.labels
            if name == "pdserve_router_turns_total":
                out["turns"] += s.value
            elif name == "pdserve_router_reuse_decisions_total":
                if labels.get("result") == "hit":
                    out["reuse_hits"] += s.value
                else:
                    out["reuse_misses"] += s.value
                    misses[labels.get("reason", "")] += int(s.value)
            elif name == "pdserve_router_reuse_tokens_offered_total":
                out["reuse_tokens_offered"] += s.value
            elif name == "pdserve_router_reuse_tokens_pulled_total":
                out["reuse_tokens_pulled"] += s.value
            elif name == "pdserve_router_prefill_tokens_local_cached_total":
                out["prefill_tokens_local_cached"] += s.value
            elif name == "pdserve_router_reuse_entries_total" and labels.get("outcome") == "unavailable":
                out["entries_unavailable"] += s.value
            elif name in BACKEND_GAUGES:
                backends.setdefault(labels.get("backend", ""), {})[BACKEND_GAUGES[name]] = int(s.value)
    decided = out["reuse_hits"] + out["reuse_misses"]
    out["reuse_hit_rate"] = out["reuse_hits"] / decided if decided else None
    out["misses_by_reason"] = dict(misses)
    out["backends"] = backends
    return out
