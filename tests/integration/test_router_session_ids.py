"""Session ids as agents send them, through the router to fake backends."""

from __future__ import annotations

from pdserve.observe.promtext import parse, total
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


async def test_vllms_session_id_reaches_the_servers_and_names_the_conversation():
    async with deployment() as dep:
        msgs = [{"role": "user", "content": "alpha " * 40}]
        body = {"model": "fake", "messages": msgs, "max_tokens": 4, "session_id": "s-1", "conversation_id": "c-1"}
        status, data = await dep.post(CHAT, body)
        assert status == 200
        for app in (dep.prefill[0], dep.decode[0]):
            sent = app[FAKE].received[-1]["body"]
            assert sent["session_id"] == "s-1" and "conversation_id" not in sent   # vLLM's own field kept
        # The next turn names only vLLM's session_id (conversation_id won before, so it is a new conversation);
        # the turn after repeats it and edits the history, which history detection could not follow.
        msgs = [*msgs, data["choices"][0]["message"], {"role": "user", "content": "beta"}]
        await dep.post(CHAT, {"model": "fake", "messages": msgs, "max_tokens": 4, "session_id": "s-1"})
        msgs[1] = {"role": "assistant", "content": "an edited reply"}
        await dep.post(CHAT, {"model": "fake", "messages": [*msgs, {"role": "user", "content": "gamma"}],
                              "max_tokens": 4, "session_id": "s-1"})
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit") == 1
        assert total(m, "pdserve_router_conversation_identity_total", source="explicit") == 3


async def test_a_coding_agents_session_header_ties_its_turns_together():
    async with deployment() as dep:
        headers = {"X-Claude-Code-Session-Id": "cc-9"}
        msgs = [{"role": "user", "content": "delta " * 40}]
        status, data = await dep.post(CHAT, {"model": "fake", "messages": msgs, "max_tokens": 4}, headers)
        assert status == 200
        msgs = [*msgs, {"role": "assistant", "content": "rewritten by the agent"}, {"role": "user", "content": "go"}]
        await dep.post(CHAT, {"model": "fake", "messages": msgs, "max_tokens": 4}, headers)
        m = parse(await dep.metrics())
        # History detection alone would miss (the reply was rewritten); the header finds D's entry, and the
        # continuation check offers P only the common prefix.
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit") == 1
        assert 0 < dep.prefill[0][FAKE].external_tokens
