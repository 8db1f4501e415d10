"""D is handed P's prompt token ids (issue 44): on chat and /v1/messages the router asks P for them and passes
them on with P's handles, so D skips rendering and tokenizing the conversation again; never on the formats
whose D path does not take them, never to the client, never from the client."""

from __future__ import annotations

import pytest

from pdserve.router.wire import PROMPT_IDS_KEY, WANT_PROMPT_IDS_KEY
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT, MESSAGES, RESPONSES, COMPLETIONS = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"
RECORD = (["--record"],)


def _chat_turns(history: list, text: str) -> dict:
    return {"model": "fake", "messages": [*history, {"role": "user", "content": text}], "max_tokens": 4,
            "conversation_id": "ids"}


def _kv_sent(fake, key: str) -> list:
    return [r["body"].get("kv_transfer_params", {}).get(key) for r in fake.received]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_chat_turns_hand_d_the_ids_p_tokenized(stream):
    async with deployment(prefill_args=RECORD, decode_args=RECORD) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        history: list = []
        for turn in range(3):
            body = _chat_turns(history, f"turn {turn} " + "word " * 40)
            if stream:
                status, lines = await dep.stream(CHAT, body)
                assert status == 200 and not any(b"prompt_token_ids" in line for line in lines)
                reply = "w0 w1 w2 w3"
            else:
                status, data = await dep.post(CHAT, body)
                assert status == 200 and "prompt_token_ids" not in str(data)     # nothing of it to the client
                reply = data["choices"][0]["message"]["content"]
            history = [*body["messages"], {"role": "assistant", "content": reply}]
        # Every P leg asked, every D leg got P's ids, and they are what D itself would have tokenized.
        assert _kv_sent(p, WANT_PROMPT_IDS_KEY) == [True] * 3
        assert (d.prompts_from_ids, d.wrong_prompt_ids) == (3, 0)
        assert _kv_sent(p, PROMPT_IDS_KEY) == [None] * 3


async def test_messages_hand_d_the_ids_too_but_responses_and_completions_do_not():
    async with deployment(prefill_args=RECORD, decode_args=RECORD) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        status, _ = await dep.post(MESSAGES, {"model": "fake", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi " * 30}]})
        assert status == 200 and (d.prompts_from_ids, d.wrong_prompt_ids) == (1, 0)
        status, _ = await dep.post(COMPLETIONS, {"model": "fake", "prompt": "a b c " * 30, "max_tokens": 4})
        assert status == 200
        status, _ = await dep.post(RESPONSES, {"model": "fake", "max_output_tokens": 4, "store": False,
                                               "input": "hello " * 30})
        assert status == 200
        # vLLM's D reads the ids on its chat path only (which /v1/messages goes through): no point in asking
        # P to send 36k ids for a D that would carry them into its sampling metadata unread.
        assert _kv_sent(p, WANT_PROMPT_IDS_KEY) == [True, None, None]
        assert d.prompts_from_ids == 1


async def test_a_clients_prompt_ids_never_reach_d():
    """A client cannot make D generate from ids of its choosing (another prompt than its messages)."""
    async with deployment(prefill_args=RECORD, decode_args=RECORD) as dep:
        d = dep.decode[0][FAKE]
        body = {**_chat_turns([], "hello " * 30), "kv_transfer_params": {PROMPT_IDS_KEY: [1, 2, 3]},
                "vllm_xargs": {"kv_transfer_params": {PROMPT_IDS_KEY: [1, 2, 3]}}}
        status, _ = await dep.post(CHAT, body)
        assert status == 200
        assert (d.prompts_from_ids, d.wrong_prompt_ids) == (1, 0)    # P's own ids, not the client's
