"""Reading the router's /metrics text in tests."""

from __future__ import annotations

import re

from pdserve.observe.promtext import parse


def sample(metrics: str, name: str) -> float:
    """The value of one sample, `name` written as in the exposition (`n{a="x",b="y"}`); 0 when absent."""
    metric, _, label_text = name.partition("{")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
    return sum(v for (n, ls), v in parse(metrics).items() if n == metric and dict(ls) == labels)


def reuse_hits(metrics: str) -> float:
    """Reuse hits, summed over every label set (api, reason)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("pdserve_router_reuse_decisions_total{") and 'result="hit"' in line)
