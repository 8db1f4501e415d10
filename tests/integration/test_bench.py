"""`pdserve bench` end to end against fake vLLM servers: arms, outputs, and consistent numbers."""

from __future__ import annotations

import csv
import json

from tests.kits.cli_runner import all_markers, pdserve, write_config


def test_bench_two_arms_writes_every_output(tmp_path, home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path, _ = write_config(tmp_path, "fb")
    out = tmp_path / "out"
    res = pdserve("bench", str(path), "--arms", "on,off", "--conversations", "2", "--turns", "3",
                  "--max-tokens", "4", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    for name in ("results.json", "results.csv", "ttft_vs_prompt.png", "prefill_split.png", "on.yaml", "off.yaml"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    rows = data["requests"]
    assert len(rows) == 12 and len(list(csv.DictReader(open(out / "results.csv")))) == 12
    on = [r for r in rows if r["arm"] == "on"]
    off = [r for r in rows if r["arm"] == "off"]
    assert all(r["tokens_pulled"] == 0 for r in off) and all(r["tokens_pulled"] == 0 for r in on if r["turn"] == 1)
    assert all(r["tokens_pulled"] > 0 for r in on if r["turn"] > 1)
    for r in rows:     # every prompt token is either computed by P or pulled from D
        assert r["tokens_computed"] + r["tokens_pulled"] == r["prompt_tokens"], r
        assert 0 < r["ttft_s"] <= r["latency_s"] and r["prefill_s"] is not None
        assert r["prefill_s"] + r["decode_s"] <= r["latency_s"]       # the router's legs fit in the client's
    assert 0 < data["pulled_share_on"] <= 1 and data["summary"] and data["host"]["cores"] >= 1
    assert 0 <= data["outside_legs_p50_ms"] < 1000 and "outside the P and D legs" in res.stdout
    assert "TTFT by prompt length" in res.stdout and "pulled/reusable (on)" in res.stdout
    assert all_markers(home, "fb-on") == [] and all_markers(home, "fb-off") == []
    bad = pdserve("bench", str(path), "--arms", "sideways")
    assert bad.returncode == 2 and "unknown arm sideways" in bad.stderr


def test_bench_restarts_prefill_mid_run_and_counts_across_the_reset(tmp_path, home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path, _ = write_config(tmp_path, "fr")
    out = tmp_path / "out"
    res = pdserve("bench", str(path), "--arms", "on,prefix-cache", "--conversations", "2", "--turns", "3",
                  "--max-tokens", "4", "--restart-prefill-after-turn", "2", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    assert data["restart_prefill_after_turn"] == 2 and set(data["prefill_restart_s"]) == {"on", "prefix-cache"}
    assert "prefill-0 restarted in" in res.stderr and "right after the prefill restart" in res.stdout
    rows = data["requests"]
    assert {r["turn"] for r in rows if r["after_pause"]} == {3} and len(rows) == 12
    for arm in ("on", "prefix-cache"):
        mine = [r for r in rows if r["arm"] == arm]
        totals = data["arm_totals"][arm]
        # The restarted P counts from zero: the arm's totals add both sides of the restart.
        assert totals["tokens_computed"] + totals["tokens_prefix_cache"] + totals["tokens_pulled"] == \
            sum(r["prompt_tokens"] for r in mine)
    after = data["after_prefill_restart"]
    assert after["on"]["requests"] == 2 and after["on"]["tokens_pulled"] > 0    # D still held the turns
    assert after["prefix-cache"]["tokens_pulled"] == 0
    bad = pdserve("bench", str(path), "--turns", "3", "--restart-prefill-after-turn", "3")
    assert bad.returncode == 2 and "leaves no turn after the restart" in bad.stderr


def test_bench_agentic_workload_reports_reuse_by_source(tmp_path, home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    path, _ = write_config(tmp_path, "fa")
    out = tmp_path / "out"
    res = pdserve("bench", str(path), "--arms", "on", "--workload", "agentic", "--conversations", "2", "--turns", "3",
                  "--max-agents", "2", "--agent-turns", "2", "--scale", "0.01", "--time-scale", "0.001",
                  "--turn-scale", "2", "--max-context", "100000", "--max-tokens", "4", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    rows = data["requests"]
    a = data["agentic"]["on"]
    assert len(rows) == a["requests"] == data["requests_per_arm"] == 14 and a["subagent_requests"] == 8
    assert a["failed"] == 0 and a["theoretical_reuse_tokens"] > 0 and 0 < a["achieved_share"] <= 1
    assert a["turns_by_kv_source"]["d_pull"] > 0 and a["preamble_tokens"] > 0
    # each row names the router's outcome for it (X-PDServe-Reuse) and its decision time (Server-Timing)
    assert all(r["reuse"].startswith("hit/") for r in rows if r["kv_source"] == "d_pull")
    assert {r["reuse"] for r in rows if r["turn"] == 1 and not r["agent"]} == {"first/no_entry"}
    assert all(r["decide_s"] is None or 0 <= r["decide_s"] < r["ttft_s"] for r in rows)
    assert any(r["decide_s"] is not None for r in rows if r["turn"] > 1)
    assert data["agentic_workload"]["agent_turns"] == 2
    assert (data["agentic_workload"]["turn_scale"], data["agentic_workload"]["max_context"]) == (2.0, 100000)
    assert "Agentic sessions per arm" in res.stdout and "achieved / theoretical reuse" in res.stdout
    assert "p / p_tier / d_pull / d_alone" in res.stdout and a["reuse_tokens_by_source"]["p_cpu_tier"] == 0
    # the settings results.json records, as a workload file, run the same workload again
    again = tmp_path / "agentic.json"
    again.write_text(json.dumps({"filetype": "agentic", **data["agentic_workload"]}))
    res = pdserve("bench", str(path), "--arms", "on", "--workload", str(again), "--max-tokens", "4",
                  "--out", str(tmp_path / "again"), timeout=300)
    assert res.returncode == 0, res.stderr
    rerun = json.loads((tmp_path / "again" / "results.json").read_text())
    assert [(r["conversation"], r["turn"], r["prompt_tokens"]) for r in rerun["requests"]] == \
           [(r["conversation"], r["turn"], r["prompt_tokens"]) for r in rows]
    again.write_text(json.dumps({"filetype": "agentic", "sesions": 2}))
    bad = pdserve("bench", str(path), "--workload", str(again))
    assert bad.returncode == 2 and "unknown agentic setting 'sesions'" in bad.stderr
    small = pdserve("bench", str(path), "--workload", "agentic", "--scale", "0.01", "--max-context", "100")
    assert small.returncode == 2 and "--max-context: max_context 100 leaves session 0 no turn" in small.stderr
