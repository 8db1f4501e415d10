"""What an agentic run (agentic.py) measured, per arm: TTFT by context size, the reuse it achieved against the
reuse the workload allowed, the requests that failed or were slow, and where each turn's KV came from.

Theoretical reuse of a turn: the tokens some cache could have served (an earlier request computed them): the
shared preamble, else the chain's previous sequence (prompt + reply - 1: what D holds), else for a sub-agent's
first turn its parent's sequence at the fork; never the prompt's last token. Achieved: what was not computed,
by source: P's prefix cache (P's own counter over the arm), P's CPU tier (the router's count per turn,
X-PDServe-Tier-Tokens: blocks P loaded back from host memory), D's KV that P pulled (the router's count per
turn, X-PDServe-Pulled-Tokens), and on turns D served alone the sequence it held (its own prefix cache).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdserve.bench.arms import ARMS, REUSE_ARMS
from pdserve.bench.report import SLOW_S, answered, percentile

SOURCES = ("p", "p_tier", "d_pull", "d_alone")     # agentic.kv_source
NO_PULL_ARMS = set(ARMS) - set(REUSE_ARMS)          # bidirectional_kv_xfer off: P never reads D's KV


def context_bucket(tokens: int) -> tuple[int, str]:
    """(upper bound, label) of the power-of-two bucket of a prompt's tokens: 0-1k, 1-2k, 2-4k, ..."""
    upper = 1024
    while tokens >= upper:
        upper *= 2
    return upper, f"{upper // 2 // 1024 if upper > 1024 else 0}-{upper // 1024}k"


def ttft_by_context(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """TTFT p50/p90 (ms) of answered requests per context bucket, smallest first."""
    buckets: dict[tuple[int, str], list[float]] = {}
    for r in answered(rows):
        buckets.setdefault(context_bucket(r["prompt_tokens"]), []).append(1000 * r["ttft_s"])
    return {label: {"requests": len(v), "ttft_p50_ms": percentile(v, 50), "ttft_p90_ms": percentile(v, 90)}
            for (_, label), v in sorted(buckets.items())}


def arm_report(rows: list[dict[str, Any]], totals: dict[str, float]) -> dict[str, Any]:
    """One arm's figures (rows: that arm's; totals: its P counter deltas, agentic.run_arm's)."""
    ok = answered(rows)
    theoretical = sum(r["theoretical_tokens"] for r in ok)
    counted = [r.get("pulled") for r in ok]
    pulled, tier = sum(c or 0 for c in counted), sum(r.get("tier_tokens") or 0 for r in ok)
    if None in counted:
        # No router header (vllm-router): P's counter of the tokens its KV connectors loaded, which are D's in
        # an arm with D->P and its CPU tier's in an arm without.
        loaded = totals.get("tokens_pulled", 0.0)
        pulled, tier = (0, loaded) if ok and ok[0]["arm"] in NO_PULL_ARMS else (loaded, 0)
    tokens = {"p_prefix_cache": totals.get("tokens_prefix_cache", 0.0), "p_cpu_tier": tier, "d_pull": pulled,
              "d_alone": sum(r["reusable_tokens"] for r in ok if r["kv_source"] == "d_alone"),
              "computed_on_p": totals.get("tokens_computed", 0.0)}
    achieved = tokens["p_prefix_cache"] + tokens["p_cpu_tier"] + tokens["d_pull"] + tokens["d_alone"]
    slow = sum(r["latency_s"] > SLOW_S for r in ok)
    sources = Counter(r["kv_source"] for r in ok)
    return {"requests": len(rows), "subagent_requests": sum(bool(r.get("agent")) for r in rows),
            "failed": len(rows) - len(ok), "over_10s": slow, "failed_or_over_10s": len(rows) - len(ok) + slow,
            "ttft_by_context": ttft_by_context(rows),
            "theoretical_reuse_tokens": theoretical, "achieved_reuse_tokens": achieved,
            "achieved_share": achieved / theoretical if theoretical else None,
            "turns_by_kv_source": {s: sources.get(s, 0) for s in SOURCES}, "reuse_tokens_by_source": tokens,
            "preamble_tokens": totals.get("preamble_tokens"),
            "gaps": sum(bool(r.get("gap_s")) for r in rows), "gaps_past_ttl": sum(bool(r.get("past_ttl")) for r in rows),
            "longest_gap_s": max((r.get("gap_s") or 0.0 for r in rows), default=0.0)}


def agentic_report(rows: list[dict[str, Any]], totals: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per arm (results.json's `agentic`)."""
    return {arm: arm_report([r for r in rows if r["arm"] == arm], totals.get(arm) or {})
            for arm in dict.fromkeys(r["arm"] for r in rows)}
