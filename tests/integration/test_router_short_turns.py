"""Short turns on D alone against fake backends: the request D gets, what the next long turn's P is offered,
the setting that turns it off, the fallback when D fails, and the counts (real vLLM: tests/e2e)."""

from __future__ import annotations

import pytest

from pdserve.router.front.app import FLOW
from pdserve.router.wire import WANT_TOKENS_KEY
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
LONG = 400    # words (one fake token each): beyond decode_only_max_tokens
SHORT = 5


def chat(content: str, history=None, **kw) -> dict:
    msgs = list(history or []) + [{"role": "user", "content": content}]
    return {"model": "fake", "messages": msgs, "max_tokens": 4, "conversation_id": "c1", **kw}


async def turn(dep, content: str, history: list) -> tuple[dict, str]:
    body = chat(content, history)
    async with dep.session.post(dep.url + CHAT, json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
        plan = resp.headers.get("X-PDServe-Plan", "")
    history[:] = body["messages"] + [data["choices"][0]["message"]]
    return data, plan


async def test_a_short_follow_up_is_served_on_d_alone_and_the_next_long_turn_pulls_what_d_published():
    async with deployment(decode_only=True) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        history: list = []
        _, plan1 = await turn(dep, "alpha " * LONG, history)
        assert plan1 == "prefill_then_decode" and len(p.received) == 1
        data, plan2 = await turn(dep, "yes " * SHORT, history)
        assert plan2 == "decode_only"
        assert len(p.received) == 1                          # no P leg (P's /tokenize for the decision only)
        d_body = d.received[-1]["body"]
        # D keeps and publishes its blocks, and its sequence with them
        assert d_body["kv_transfer_params"] == {"do_remote_prefill": False, WANT_TOKENS_KEY: True}
        assert "return_token_ids" not in d_body and "kv_transfer_params" not in data
        published = d.received[-1]
        _, plan3 = await turn(dep, "tool output " * LONG, history)
        assert plan3 == "prefill_then_decode"
        offered = p.received[-1]["body"]["kv_transfer_params"]
        # P is offered the handle D returned for the D-alone turn: its tokens run past that turn's prompt start.
        assert offered["remote_port"] == 2 and offered["remote_num_tokens"] > len(history[0]["content"].split())
        assert published["body"]["messages"] == history[:3]    # the D-alone turn's own prompt ...
        flow = dep.router[FLOW]
        assert offered["remote_num_tokens"] >= len(p.prompt_ids(CHAT, published["body"])) - 1   # ... all held
        m = await dep.metrics()
        assert 'pdserve_router_turn_plans_total{plan="decode_only"} 1.0' in m
        assert 'pdserve_router_turn_plans_total{plan="prefill_then_decode"} 2.0' in m
        assert 'pdserve_router_turns_total{api="chat",outcome="stored"} 3.0' in m
        assert flow.prefill.costs is not None


async def test_turned_off_every_follow_up_goes_through_p():
    async with deployment(decode_only=False) as dep:
        history: list = []
        await turn(dep, "alpha " * LONG, history)
        _, plan = await turn(dep, "yes " * SHORT, history)
        assert plan == "prefill_then_decode" and len(dep.prefill[0][FAKE].received) == 2


async def test_a_follow_up_with_many_new_tokens_goes_through_p():
    async with deployment(decode_only=True, decode_only_max_tokens=32) as dep:
        history: list = []
        await turn(dep, "alpha " * LONG, history)
        _, plan = await turn(dep, "more " * 40, history)
        assert plan == "prefill_then_decode"


async def test_d_alone_failing_is_served_whole_on_p():
    async with deployment(decode_only=True) as dep:
        history: list = []
        await turn(dep, "alpha " * LONG, history)
        dep.decode[0][FAKE].args.status = 500           # D now answers 500 to everything
        body = chat("yes " * SHORT, history)
        async with dep.session.post(dep.url + CHAT, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["X-PDServe-Plan"] == "degraded"
        assert dep.prefill[0][FAKE].received[-1]["body"].get("kv_transfer_params") is None


async def test_a_held_short_turn_sent_to_p_is_counted_with_the_rules_reason():
    async with deployment(decode_only=True, decode_only_max_tokens=32) as dep:
        history: list = []
        await turn(dep, "alpha " * LONG, history)
        costs = dep.router[FLOW].prefill.costs            # measured: D slow, pulls nearly free
        costs.recompute["prefill-0"], costs.local["decode-0"] = 1e-4, 1.0
        costs.pull[("prefill-0", "decode-0")] = 1e-9
        _, plan = await turn(dep, "yes " * SHORT, history)
        assert plan == "prefill_then_decode"
        _, plan = await turn(dep, "more " * 40, history)   # too many new tokens: not a candidate, not counted
        assert plan == "prefill_then_decode"
        m = await dep.metrics()
        assert 'pdserve_router_decode_only_refused_total{reason="prefill_faster"} 1.0' in m
        assert 'reason="too_long"' not in m


async def test_a_short_follow_up_matched_by_history_goes_to_d_without_tokenizing_on_p():
    async with deployment(decode_only=True) as dep:
        p = dep.prefill[0][FAKE]
        history: list = []
        for content in ("alpha " * LONG, "yes " * SHORT):
            body = {"model": "fake", "messages": history + [{"role": "user", "content": content}], "max_tokens": 4}
            async with dep.session.post(dep.url + CHAT, json=body) as resp:   # no conversation id: by history
                assert resp.status == 200
                plan = resp.headers["X-PDServe-Plan"]
                history[:] = body["messages"] + [(await resp.json())["choices"][0]["message"]]
        assert plan == "decode_only" and p.tokenized == 0 and len(p.received) == 1
        # Under an explicit id the history may have been edited: the follow-up is tokenized and checked.
        explicit: list = []
        await turn(dep, "alpha " * LONG, explicit)
        _, plan = await turn(dep, "yes " * SHORT, explicit)
        assert plan == "decode_only" and p.tokenized == 1
        # Found by its prompt alone (the client rewrote the reply): what D holds is checked on P's tokens too.
        history = [{"role": "user", "content": "gamma " * LONG}]
        async with dep.session.post(dep.url + CHAT, json={"model": "fake", "messages": history, "max_tokens": 4}) as r:
            assert r.status == 200
        history += [{"role": "assistant", "content": "rewritten"}, {"role": "user", "content": "yes " * SHORT}]
        async with dep.session.post(dep.url + CHAT, json={"model": "fake", "messages": history, "max_tokens": 4}) as r:
            assert r.status == 200
        assert p.tokenized == 2


@pytest.mark.parametrize("named", [True, False], ids=["conversation-id", "history"])
async def test_a_follow_up_too_long_for_d_alone_is_checked_by_ps_engine_without_tokenize(named):
    """Issue 33: P's /tokenize of the whole prompt was the largest part of a long "on" turn the router
    controls. A follow-up with more new words than decode_only_max_tokens can never be D's alone, so the
    router needs no count: it offers D's sequence and P's engine cuts the offer to the common prefix."""
    async with deployment(decode_only=True) as dep:
        p = dep.prefill[0][FAKE]
        history: list = []
        for content in ("alpha " * LONG, "beta " * LONG, "yes " * SHORT):
            body = {"model": "fake", "messages": history + [{"role": "user", "content": content}], "max_tokens": 4,
                    **({"conversation_id": "c9"} if named else {})}
            async with dep.session.post(dep.url + CHAT, json=body) as resp:
                assert resp.status == 200
                plan, pulled = resp.headers["X-PDServe-Plan"], int(resp.headers.get("X-PDServe-Pulled-Tokens", 0))
                history[:] = body["messages"] + [(await resp.json())["choices"][0]["message"]]
            if content.startswith("beta"):
                # turn 1's prompt, the common prefix P's engine found (D's generated ids re-tokenize differently)
                assert (plan, p.tokenized) == ("prefill_then_decode", 0) and pulled >= LONG, (plan, pulled)
        # a short follow-up is still counted (on P's tokens under an id, by its bytes by history)
        assert plan == "decode_only" and p.tokenized == (1 if named else 0)
        m = await dep.metrics()
        assert 'reason="trimmed",result="hit"} 1.0' in m or 'reason="continuation",result="hit"} 1.0' in m, m


async def test_a_follow_up_of_few_long_words_is_counted_alone_then_checked_by_ps_engine():
    """Few words but many tokens (a long identifier, a base64 blob, a log line): the words cannot rule D
    alone out, nor its bytes rule it in; P counts the new text alone (a small /tokenize, not the history's)
    and, past the limit, checks the offer in its engine."""
    async with deployment(decode_only=True) as dep:
        p = dep.prefill[0][FAKE]
        history: list = []
        await turn(dep, "alpha " * LONG, history)
        blob = " ".join(f"{i:04d}" + "x" * 60 for i in range(60))   # 60 words, 8 fake tokens each
        _, plan = await turn(dep, blob, history)
        assert plan == "prefill_then_decode"
        assert p.tokenized == 1 and len(p.tokenize_bodies[-1]["prompt"]) == len(blob)   # the new text alone
        assert p.external_tokens >= LONG


TOOLS = [{"type": "function", "function": {"name": "run", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {}}}}]


async def test_new_text_the_bound_cannot_see_sends_the_turn_to_the_checked_path():
    """Issue 35 item 6: new text before a fabricated assistant message, or in tools / documents /
    chat_template_kwargs, is not a short turn to serve on D unchecked: P tokenizes it and the count sends it P
    then D (documents, which /tokenize does not take, changed: of unknown length); the same tools as the turn D
    holds keep the unchecked path."""
    async with deployment(decode_only=True) as dep:
        p = dep.prefill[0][FAKE]
        history: list = []

        async def send(messages: list, **fields) -> str:
            body = {"model": "fake", "messages": messages, "max_tokens": 4, "tools": TOOLS, **fields}
            async with dep.session.post(dep.url + CHAT, json=body) as resp:   # no conversation id: by history
                assert resp.status == 200
                history[:] = messages + [(await resp.json())["choices"][0]["message"]]
                return resp.headers["X-PDServe-Plan"]

        await send([{"role": "user", "content": "alpha " * LONG}])
        assert await send(history + [{"role": "user", "content": "yes"}]) == "decode_only" and p.tokenized == 0
        hidden = "hidden " * 2000
        plan = await send(history + [{"role": "user", "content": hidden}, {"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "yes"}])
        # 2,000 new words are more tokens than D alone takes: P's engine checks the offer, no /tokenize
        assert (plan, p.tokenized) == ("prefill_then_decode", 0)
        for i, fields in enumerate(({"tools": TOOLS + [{"type": "function", "function": {"name": hidden}}]},
                                    {"documents": [{"text": hidden}]},
                                    {"chat_template_kwargs": {"system": hidden}})):
            plan = await send(history + [{"role": "user", "content": "yes"}], **fields)
            assert (plan, p.tokenized) == ("prefill_then_decode", 1 + i)   # checked first (documents: unseen)
        await send(history + [{"role": "user", "content": "yes"}])     # the tools changed back: checked once more
        assert await send(history + [{"role": "user", "content": "yes"}]) == "decode_only" and p.tokenized == 4
