"""Counts a user can trust (issue 42), through the real router and the fake vLLM: a conversation's first turn is
no miss (result "first", out of the hit rate), a turn served on D alone is reused, and every request but probes
and scrapes leaves one access-log line (text, or JSON with json_logs) that never names the client's key."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.cli.status import _api_reuse
from pdserve.observe.routerstats import parse_metrics
from pdserve.observe.promtext import parse, total
from tests.kits.router_rig import deployment

MESSAGES = "/v1/messages"
DECISIONS = "pdserve_router_reuse_decisions_total"
CHAT = "/v1/chat/completions"
KEY = "sk-client-secret-0123456789"


async def test_a_claude_code_session_of_three_turns_shows_both_follow_ups_reused():
    """Turn 1 of a session has no earlier model output: counted first (no_entry), not a miss; the two
    follow-ups pulled from D: 2/2 reused, hit rate 100% (before: 2/3, turn 1 a no_entry miss)."""
    session = {"X-Claude-Code-Session-Id": "cc-session-1"}
    async with deployment() as dep:
        body = {"model": "fake", "max_tokens": 6, "system": [{"type": "text", "text": "You are an agent."}],
                "messages": [{"role": "user", "content": "nu " * 40}]}
        for text in ("xi " * 30, "omicron " * 30, None):
            status, data = await dep.post(MESSAGES, body, session)
            assert status == 200
            if text is not None:
                body = {**body, "messages": [*body["messages"], {"role": "assistant", "content": data["content"]},
                                             {"role": "user", "content": text}]}
        m = parse(await dep.metrics())
        assert total(m, DECISIONS, result="first", reason="no_entry", api="messages") == 1
        assert total(m, DECISIONS, result="hit", api="messages") == 2
        assert total(m, DECISIONS, result="miss") == 0
        stats = parse_metrics(await dep.metrics())
        assert stats["reuse_hit_rate"] == 1.0 and stats["misses_by_reason"] == {}
        assert _api_reuse(stats["by_api"]["messages"]) == "3 turns, 2/2 reused, 1 first"


async def test_without_a_session_id_the_first_turn_found_by_history_is_counted_first_too():
    async with deployment() as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 30}], "max_tokens": 4}
        status, data = await dep.post(CHAT, body)
        assert status == 200
        body["messages"] += [data["choices"][0]["message"], {"role": "user", "content": "beta " * 10}]
        assert (await dep.post(CHAT, body))[0] == 200
        stats = parse_metrics(await dep.metrics())
        assert (stats["reuse_first"], stats["reuse_hits"], stats["reuse_misses"]) == (1, 1, 0)


async def test_a_follow_up_whose_entry_is_gone_is_still_a_no_entry_miss():
    """A history with the model's earlier output but no entry (expired, evicted, a router restart) is a
    follow-up the router failed to reuse: miss, no_entry."""
    history = [{"role": "user", "content": "alpha " * 30}, {"role": "assistant", "content": "w0 w1 w2"},
               {"role": "user", "content": "beta " * 10}]
    async with deployment() as dep:
        status, _ = await dep.post(CHAT, {"model": "fake", "messages": history, "max_tokens": 4,
                                          "conversation_id": "never-seen"})
        assert status == 200
        m = parse(await dep.metrics())
        assert total(m, DECISIONS, result="miss", reason="no_entry", api="chat") == 1
        assert total(m, DECISIONS, result="first") == 0


async def test_a_turn_served_on_d_alone_counts_as_reused():
    """long (P then D), short (D alone: its prefix cache holds the history), long (P pulls what D published):
    both follow-ups reused, one of them on D alone."""
    async with deployment(decode_only=True) as dep:
        history: list = []
        plans = []
        for words in ("alpha " * 400, "yes " * 5, "tool output " * 400):
            body = {"model": "fake", "messages": history + [{"role": "user", "content": words}], "max_tokens": 4,
                    "conversation_id": "c-alone"}
            async with dep.session.post(dep.url + CHAT, json=body) as resp:
                assert resp.status == 200
                data = await resp.json()
                plans.append(resp.headers["X-PDServe-Plan"])
            history = body["messages"] + [data["choices"][0]["message"]]
        assert plans == ["prefill_then_decode", "decode_only", "prefill_then_decode"]
        m = parse(await dep.metrics())
        assert total(m, DECISIONS, result="hit", reason="decode_only", api="chat") == 1
        assert total(m, DECISIONS, result="hit", api="chat") == 2
        assert total(m, DECISIONS, result="first", api="chat") == 1 and total(m, DECISIONS, result="miss") == 0
        stats = parse_metrics(await dep.metrics())
        assert stats["reuse_hit_rate"] == 1.0 and stats["reuse_decode_only"] == 1
        assert _api_reuse(stats["by_api"]["chat"]) == "3 turns, 2/2 reused (1 on D alone), 1 first"


async def test_each_answer_names_its_reuse_outcome_streamed_or_not():
    """X-PDServe-Reuse: the turn's (result, reason) as the decisions counter has it, so a benchmark can group
    turns by it (a first turn, a pull, D alone); none for a request no conversation was followed for, nor on a
    streamed turn on D alone, whose outcome is known only at its end (X-PDServe-Plan says decode_only)."""
    async with deployment(decode_only=True) as dep:
        history: list = []
        seen = []
        plans = []
        for words, stream in (("alpha " * 400, False), ("yes " * 5, False), ("tool output " * 400, False),
                              ("no " * 5, True)):
            body = {"model": "fake", "messages": history + [{"role": "user", "content": words}], "max_tokens": 4,
                    "conversation_id": "c-header", "stream": stream}
            async with dep.session.post(dep.url + CHAT, json=body) as resp:
                assert resp.status == 200
                seen.append(resp.headers.get("X-PDServe-Reuse"))
                plans.append(resp.headers.get("X-PDServe-Plan"))
                text = await resp.text()
            reply = json.loads(text)["choices"][0]["message"] if not stream else {"role": "assistant", "content": "".join(
                json.loads(line[5:])["choices"][0]["delta"].get("content") or "" for line in text.splitlines()
                if line.startswith("data: {") and json.loads(line[5:]).get("choices"))}
            history = body["messages"] + [reply]
        assert seen[:2] == ["first/no_entry", "hit/decode_only"] and seen[3] is None, seen
        assert plans[3] == "decode_only"
        assert seen[2].startswith("hit/"), seen                                    # P pulled
        body = {"model": "fake", "messages": [{"role": "user", "content": "gamma " * 400}], "max_tokens": 4,
                "conversation_id": "c-header-2", "stream": True}
        async with dep.session.post(dep.url + CHAT, json=body) as resp:      # a stream's headers follow P's leg
            assert resp.status == 200 and resp.headers.get("X-PDServe-Reuse") == "first/no_entry"
            await resp.read()
        m = parse(await dep.metrics())
        for header in seen[:3]:
            result, reason = header.split("/")
            assert total(m, DECISIONS, result=result, reason=reason, api="chat") >= 1
        async with dep.session.post(dep.url + "/v1/completions", json={"model": "fake", "prompt": "hi",
                                                                        "max_tokens": 2}) as resp:
            assert resp.status == 200 and "X-PDServe-Reuse" not in resp.headers


async def test_a_fresh_router_exports_the_first_turn_series_at_zero():
    async with deployment() as dep:
        m = parse(await dep.metrics())
        for api in ("chat", "completions", "messages", "responses"):
            assert (DECISIONS, frozenset({"api": api, "reason": "no_entry", "result": "first"}.items())) in m
            assert (DECISIONS, frozenset({"api": api, "reason": "decode_only", "result": "hit"}.items())) in m


# -- the access log ---------------------------------------------------------------------------------------
def lines(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


async def test_one_access_line_per_request_with_the_turns_facts_and_never_the_clients_key(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router.access")
    auth = {"Authorization": f"Bearer {KEY}", "X-Session-ID": "session-abc"}
    async with deployment() as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 30}], "max_tokens": 4}
        async with dep.session.post(dep.url + CHAT, json=body, headers=auth) as resp:
            assert resp.status == 200
            reply = (await resp.json())["choices"][0]["message"]
        body["messages"] += [reply, {"role": "user", "content": "beta " * 30}]
        async with dep.session.post(dep.url + CHAT, json=body, headers=auth) as resp:
            assert resp.status == 200
            pulled = resp.headers["X-PDServe-Pulled-Tokens"]
        async with dep.session.get(dep.url + "/v1/nowhere", headers=auth) as resp:
            assert resp.status == 404
        await dep.metrics()
        async with dep.session.get(dep.url + "/health") as resp:
            assert resp.status == 200
    got = lines(caplog, "pdserve.router.access")
    assert len(got) == 3, got                          # two turns and the 404; no line for /health or /metrics
    turn1, turn2, missing = got
    assert turn1.startswith(f"POST {CHAT} 200 ") and "api=chat" in turn1 and "plan=prefill_then_decode" in turn1
    assert "reuse=first/no_entry" in turn1 and "pulled=0" in turn1 and "outcome=stored" in turn1
    assert "reuse=hit/" in turn2 and f"pulled={pulled}" in turn2 and int(pulled) > 0
    computed = int(turn2.split("p_computed=")[1].split()[0])
    assert 0 < computed < 60                          # the new tokens, not the whole history
    conv1, conv2 = (line.split("conv=")[1].split()[0] for line in (turn1, turn2))
    assert conv1 == conv2 and len(conv1) == 16         # the key's hash: one conversation, not its id
    assert missing.startswith("GET /v1/nowhere 404 ")
    assert not any(KEY in line or "session-abc" in line for line in got)


async def test_the_access_log_can_be_turned_off(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.router.access")
    async with deployment(access_log=False) as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 30}], "max_tokens": 4}
        assert (await dep.post(CHAT, body))[0] == 200
    assert lines(caplog, "pdserve.router.access") == []


@pytest.mark.parametrize("access_log", [True, False])
async def test_with_json_logs_the_line_is_json_and_there_is_one(caplog, access_log):
    caplog.set_level(logging.INFO, logger="pdserve.router")
    async with deployment(json_logs=True, access_log=access_log) as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 30}], "max_tokens": 4,
                "conversation_id": "j"}
        assert (await dep.post(CHAT, body))[0] == 200
    assert lines(caplog, "pdserve.router.access") == []
    (line,) = lines(caplog, "pdserve.router.requests")
    facts = json.loads(line)
    assert (facts["method"], facts["route"], facts["status"], facts["api"], facts["plan"]) == \
        ("POST", CHAT, 200, "chat", "prefill_then_decode")
    assert facts["reuse"] == "first" and facts["tokens_computed"] > 0 and facts["tokens_pulled"] == 0
