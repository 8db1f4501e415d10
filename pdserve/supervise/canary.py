"""The canary: one small request through the router that must move KV from P to D.

Ports answering is not enough: a NIXL path that cannot transfer (wrong side-channel host, UCX fallen back
or broken, a stale agent after a restart) still answers /health. The canary compares the decode servers'
own `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` before and after one request.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

from pdserve.observe.promtext import api_key_of, auth_headers, has, scrape, total
from pdserve.plan.records import ClusterPlan

BY_SOURCE = "vllm:prompt_tokens_by_source_total"

# Long enough to fill at least one KV block on every backend (CPU blocks are 128 tokens).
CANARY_TEXT = "pdserve canary: " + " ".join(f"check {i}" for i in range(160))


def canary_text() -> str:
    """Fresh text each time, varied from its first token: D's prefix cache held a repeated canary, so D
    read only the last 2 tokens from P and the check proved almost nothing."""
    return f"{uuid.uuid4().hex} {CANARY_TEXT}"


def external_tokens(url: str) -> float | None:
    """Tokens this server loaded from another server's KV (None when it exports no such metric)."""
    samples = scrape(url)
    if samples is None or not has(samples, BY_SOURCE):
        return None
    return total(samples, BY_SOURCE, source="external_kv_transfer")


def run_canary(router_url: str, decode_urls: list[str], model: str, api_key: str | None = None,
               timeout: float = 120.0) -> tuple[bool, str]:
    """(passed, what happened)."""
    before = [external_tokens(u) for u in decode_urls]
    headers = {"Content-Type": "application/json",
               **auth_headers(api_key)}
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": canary_text()}]})
    req = urllib.request.Request(router_url + "/v1/chat/completions", data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as err:
        return False, f"canary request failed: HTTP {err.code} {err.read()[:300].decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as err:
        return False, f"canary request failed: {err}"
    after = [external_tokens(u) for u in decode_urls]
    moved = sum((a or 0) - (b or 0) for a, b in zip(after, before))
    if moved > 0:
        return True, f"canary moved {moved:.0f} tokens of KV from prefill to decode"
    if all(a is None for a in after):
        return False, "decode servers export no vllm:prompt_tokens_by_source_total metric; cannot verify KV transfer"
    return False, "canary answered but no KV reached a decode server (check NIXL: side-channel host/ports, UCX)"


def plan_canary(plan: ClusterPlan) -> tuple[bool, str]:
    """The canary through a planned cluster's router, checked on its decode servers."""
    cfg = plan.router_config
    decode = [p.url for p in plan.processes if p.role == "decode"]
    return run_canary(plan.router.url, decode, cfg.get("model", ""), api_key_of(cfg),
                      timeout=min(float(cfg.get("request_timeout", 120.0)), 120.0))
