"""Reading Prometheus text exposition (vLLM's and the router's /metrics)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header the router (and vLLM with VLLM_API_KEY) wants for a key; none without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def api_key_of(router_config: dict[str, Any]) -> str | None:
    """The key a router wants, from the environment variable its config names (None if unset)."""
    name = router_config.get("api_key_env")
    return os.environ.get(name) if name else None


def scrape(url: str, timeout: float = 10.0, api_key: str | None = None) -> Samples | None:
    """The samples on `url`/metrics; None when the server does not answer."""
    try:
        req = urllib.request.Request(url + "/metrics", headers=auth_headers(api_key))
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return parse(resp.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def has(samples: Samples, name: str) -> bool:
    return any(n == name for n, _ in samples)
