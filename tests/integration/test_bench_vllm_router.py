"""`pdserve bench --arms affinity,vllm-router` against fake vLLM servers: vllm-router is started on the
arm's servers, carries the workload, is recorded in results.json and is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from pdserve.bench import vrouter
from tests.kits.cli_runner import FAKE_SERVER, all_markers, pdserve, write_config

pytestmark = pytest.mark.skipif(vrouter.executable() is None, reason="vllm-router not installed (bench extra)")


def test_bench_runs_vllm_router_and_affinity_arms_and_stops_vllm_router(tmp_path, home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    path, _ = write_config(tmp_path, "vr")
    out = tmp_path / "out"
    res = pdserve("bench", str(path), "--arms", "affinity,vllm-router", "--conversations", "2", "--turns", "3",
                  "--max-tokens", "4", "--verbatim-replies", "--out", str(out), timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    info = data["vllm_router"]
    assert info["version"] == vrouter.version()
    assert {"--vllm-pd-disaggregation", "cache_aware", "nixl"} <= set(info["argv"])
    port = info["argv"][info["argv"].index("--port") + 1]
    rows = [r for r in data["requests"] if r["arm"] == "vllm-router"]
    assert len(rows) == 6
    for r in rows:        # streamed through vllm-router: usage came back, first token before the end
        assert r["prompt_tokens"] > 0 and r["completion_tokens"] == 4 and 0 < r["ttft_s"] <= r["latency_s"]
        assert r["tokens_computed"] == r["prompt_tokens"]   # each request's P leg ran on the arm's P
    assert data["verbatim_replies"] and data["verbatim_token_ids"]
    assert "prefill_policy: affinity" in (out / "affinity.yaml").read_text()
    assert "--enable-prefix-caching" in (out / "vllm-router.yaml").read_text()
    assert "vllm-router/on" not in res.stdout and "P computed" in res.stdout
    assert not [p for p in psutil.process_iter(["cmdline"])
                if "vllm-router" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]
    assert all_markers(home, "vr-affinity") == [] and all_markers(home, "vr-vllm-router") == []



@pytest.fixture
def fake_backends(tmp_path):
    """One fake prefill and one fake decode server (vllm-router is ready only once its workers answer)."""
    procs, urls = [], []
    for _ in range(2):
        port = vrouter._free_port()
        procs.append(subprocess.Popen([sys.executable, FAKE_SERVER, "--model", "fake-model", "--host", "127.0.0.1",
                                       "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            for _ in range(200):
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.05)
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_vllm_routers_run_side_by_side(tmp_path, fake_backends):
    """Each gets its own metrics port: with vllm-router's default (29000) the second one could not start while
    the first ran (two bench runs at once, or anything else on 29000)."""
    prefill, decode = fake_backends
    with vrouter.running([prefill], [decode], tmp_path / "a.log") as first, \
            vrouter.running([prefill], [decode], tmp_path / "b.log") as second:
        assert first.url != second.url
        ports = {r.argv[r.argv.index("--prometheus-port") + 1] for r in (first, second)}
        assert len(ports) == 2 and "29000" not in ports
