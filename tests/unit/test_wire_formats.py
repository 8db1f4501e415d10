"""The wire formats (router/api/): each one's bodies for P and D, where D's handles and token ids are in its
answers and streams (taken out before the client), the reply as the client sends it back, and its errors."""

from __future__ import annotations

import json

import pytest

from pdserve.router import api
from pdserve.router.api.inputs import BadInput
from pdserve.router.api.messages import MessagesFormat
from pdserve.router.api.responses import ResponsesFormat
from pdserve.router.identity import history_keys, reply_key
from pdserve.router.legs.relay import StreamRelay
from pdserve.router.wire import TOKENS_KEY, WANT_PROMPT_IDS_KEY, WANT_TOKENS_KEY
from tests.kits.wire_samples import D_PARAMS, OUTPUT, R_STREAM, STREAM, event

MESSAGES, RESPONSES = MessagesFormat(), ResponsesFormat()


def relay(fmt, stream: bytes, size: int, keep_lines: bool = True):
    collector = fmt.collector()
    r = StreamRelay(collector, keep_lines)
    out, done_at = b"", None
    for i in range(0, len(stream), size):
        out += r.feed(stream[i:i + size])
        if r.done and done_at is None:
            done_at = i + size
    out += r.close()
    r.finish()
    return out, collector, r, done_at


def test_registry_serves_each_route_once():
    assert set(api.ROUTES) == {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
    assert api.for_path("/v1/messages/count_tokens").api == "messages"
    assert api.for_path("/nowhere").api == "chat"      # the router's own errors: OpenAI's shape


# -- Anthropic Messages ---------------------------------------------------------------------------
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls", "timeout": 5}}
ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
          "content": [{"type": "text", "text": "Let me look."}, TOOL_USE],
          "usage": {"input_tokens": 7, "output_tokens": 3}, "kv_transfer_params": D_PARAMS}
REQUEST = {"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "You are terse."}],
           "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
           "messages": [{"role": "user", "content": "list files"}]}
# The next turn as Claude Code sends it: the reply resent (with thinking and cache_control), a tool result.
NEXT = {**REQUEST, "messages": REQUEST["messages"] + [
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                      {"type": "text", "text": "Let me look.", "cache_control": {"type": "ephemeral"}},
                                      {**TOOL_USE, "input": {"timeout": 5, "command": "ls"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]}]}


def test_messages_whole_answer_loses_handles_and_gives_sequence_and_reply():
    collector, answer = MESSAGES.collector(), json.loads(json.dumps(ANSWER))
    assert collector.scrub(answer)
    assert "kv_transfer_params" not in answer and answer["content"][1]["input"] == TOOL_USE["input"]
    assert collector.kv_params == {"remote_block_ids": [[3, 4]], "remote_num_tokens": 9}
    assert collector.sequence == list(range(10))
    stored = reply_key("t", MESSAGES.history(REQUEST), collector.reply_items())
    assert history_keys("t", MESSAGES.history(NEXT))[0] == stored


@pytest.mark.parametrize("size", [1, 13, 64, len(STREAM)])
def test_messages_stream_ends_at_message_stop_data_and_loses_handles(size):
    out, collector, r, done_at = relay(MESSAGES, STREAM, size)
    assert b"kv_transfer_params" not in out and b"token_ids" not in out
    assert out.count(b"event: ") == 9 and r.done
    assert done_at is not None and done_at >= STREAM.rindex(b"data:") + 1   # the handles' line, not the event line
    assert collector.kv_params["remote_block_ids"] == [[3, 4]] and collector.sequence == list(range(10))
    stored = reply_key("t", MESSAGES.history(REQUEST), collector.reply_items())
    assert history_keys("t", MESSAGES.history(NEXT))[0] == stored


def test_messages_text_inside_content_is_no_end_marker():
    fake_end = event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta":
                                             {"type": "text_delta", "text": "\nevent: message_stop\ndata: x"}})
    _, _, r, _ = relay(MESSAGES, fake_end, 5)
    assert not r.done


def test_messages_bodies_for_each_leg():
    p_body = MESSAGES.prefill_body({**REQUEST, "stream": True}, None, "pdserve-ab")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    # P returns its prompt ids for D, whose vLLM takes them on its chat path (which /v1/messages goes through)
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            WANT_PROMPT_IDS_KEY: True}
    d_body = MESSAGES.decode_body(REQUEST, {"remote_block_ids": [1]}, True, "pdserve-ab")
    assert d_body["kv_transfer_params"] == {"remote_block_ids": [1], WANT_TOKENS_KEY: True}
    assert "return_token_ids" not in d_body and d_body["max_tokens"] == 64
    assert WANT_TOKENS_KEY not in MESSAGES.decode_body(REQUEST, {"x": 1}, False, "r")["kv_transfer_params"]


def test_chat_asks_d_for_its_sequence_beside_its_handles_not_with_return_token_ids():
    """vLLM's return_token_ids put the prompt's ids in D's first chunk (on the way to the first token) and a
    token id in every chunk; the entry's patch returns the sequence once, with D's handles."""
    chat, completions = api.for_path("/v1/chat/completions"), api.for_path("/v1/completions")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    d_body = chat.decode_body(body, {"remote_block_ids": [1]}, True, "r")
    assert d_body["kv_transfer_params"] == {"remote_block_ids": [1], WANT_TOKENS_KEY: True}
    assert "return_token_ids" not in d_body
    # no handles to ask beside (a degraded turn): vLLM's own ids, as before
    assert chat.decode_body(body, None, True, "r")["return_token_ids"] is True
    # completions: each prompt of a request is its own engine request, so vLLM's per-choice ids
    d_body = completions.decode_body({"model": "m", "prompt": "hi"}, {"remote_block_ids": [1]}, True, "r")
    assert d_body["return_token_ids"] is True and WANT_TOKENS_KEY not in d_body["kv_transfer_params"]


def test_messages_errors_in_anthropics_shape():
    assert MESSAGES.client_error({"error": {"message": "no server", "type": "server_error", "code": 503}}, 503) == \
        {"type": "error", "error": {"type": "overloaded_error", "message": "no server"}}
    vllm_own = {"type": "error", "error": {"type": "BadRequestError", "message": "bad"}}
    assert MESSAGES.client_error(vllm_own, 400) is vllm_own
    broken = MESSAGES.stream_error("decode-0 failed")
    assert broken.startswith(b"event: error\ndata: ") and json.loads(broken.split(b"data: ")[1])["type"] == "error"


def test_messages_history_and_fingerprint_tell_side_calls_apart():
    side = {"model": "haiku", "max_tokens": 8, "system": "Write a 5-word title", "messages": [
        {"role": "user", "content": "list files"}]}
    assert MESSAGES.fingerprint(side) != MESSAGES.fingerprint(REQUEST)
    assert MESSAGES.fingerprint(NEXT) == MESSAGES.fingerprint(REQUEST)   # the main chain keeps its key


@pytest.mark.parametrize("body, param", [({}, "messages"), ({"messages": "hi"}, "messages"),
                                         ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages"),
                                         ({"messages": [], "max_tokens": "9"}, "max_tokens"),
                                         ({"messages": [], "system": 3}, "system")])
def test_messages_bad_bodies(body, param):
    with pytest.raises(BadInput) as bad:
        MESSAGES.validate(body)
    assert bad.value.status == 400 and bad.value.param == param


# -- OpenAI Responses -----------------------------------------------------------------------------
R_REQUEST = {"model": "m", "instructions": "You are Codex.", "store": False, "stream": True,
             "tools": [{"type": "function", "name": "shell", "parameters": {}}],
             "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]}]}
R_NEXT = {**R_REQUEST, "input": R_REQUEST["input"] + [
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running it."}]},
    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd":["ls"]}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]}


@pytest.mark.parametrize("size", [1, 17, len(R_STREAM)])
def test_responses_stream_ends_at_completed_and_loses_handles(size):
    out, collector, r, _ = relay(RESPONSES, R_STREAM, size)
    assert r.done and b"kv_transfer_params" not in out and TOKENS_KEY.encode() not in out   # the null one too
    assert collector.kv_params["remote_num_tokens"] == 9 and collector.sequence == list(range(10))
    stored = reply_key("t", RESPONSES.history(R_REQUEST), collector.reply_items())
    assert history_keys("t", RESPONSES.history(R_NEXT))[0] == stored


def test_responses_whole_answer():
    collector, answer = RESPONSES.collector(), {"id": "resp_1", "output": OUTPUT, "kv_transfer_params": D_PARAMS,
                                               "usage": {"input_tokens": 12}}
    assert collector.scrub(answer) and "kv_transfer_params" not in answer
    assert RESPONSES.prompt_tokens(answer) == 12
    stored = reply_key("t", RESPONSES.history(R_REQUEST), collector.reply_items())
    assert history_keys("t", RESPONSES.history(R_NEXT))[0] == stored


def test_responses_bodies_for_each_leg():
    p_body = RESPONSES.prefill_body({**R_REQUEST, "store": True, "request_id": "client-chosen"}, None, "pdserve-ab")
    assert p_body["max_output_tokens"] == 1 and p_body["stream"] is False and p_body["store"] is False
    assert "max_tokens" not in p_body and p_body["request_id"] == "resp_ab-p"
    d_body = RESPONSES.decode_body({**R_REQUEST, "request_id": "client-chosen"}, {"a": 1}, True, "pdserve-ab")
    assert d_body["request_id"] == "resp_ab" and d_body["kv_transfer_params"] == {"a": 1, WANT_TOKENS_KEY: True}
    assert RESPONSES.whole_body({**R_REQUEST, "store": True}, "pdserve-ab")["store"] is False


def test_responses_refuses_what_needs_a_stored_response():
    message, param = RESPONSES.refuse({**R_REQUEST, "previous_response_id": "resp_0"})
    assert param == "previous_response_id" and "input" in message
    assert RESPONSES.refuse({**R_REQUEST, "background": True})[1] == "background"
    assert RESPONSES.refuse(R_REQUEST) is None


def test_responses_string_input_is_one_user_message():
    assert RESPONSES.history({"input": "hi", "instructions": "sys"}) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    with pytest.raises(BadInput):
        RESPONSES.validate({"input": 5})


def compact(name: str, data: dict) -> bytes:
    """An event as vLLM writes it (pydantic's compact JSON)."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def test_responses_null_params_are_cut_as_bytes_and_the_reply_is_the_final_events_output():
    started = {"id": "resp_1", "output": [], "kv_transfer_params": None, "metadata": {"k": "v"}}
    stream = (compact("response.created", {"type": "response.created", "response": started})
              + compact("response.in_progress", {"type": "response.in_progress", "response": started})
              + compact("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Running it."})
              + compact("response.completed", {"type": "response.completed", "response": {
                  "id": "resp_1", "output": OUTPUT, "kv_transfer_params": {**D_PARAMS, TOKENS_KEY: list(range(10))}}}))
    collector = RESPONSES.collector()
    r = StreamRelay(collector, keep_lines=True)
    assert not r.keep_lines                       # the reply is in response.completed: no line kept
    out = r.feed(stream) + r.close()
    r.finish()
    assert r.done and b"kv_transfer_params" not in out and TOKENS_KEY.encode() not in out
    first = json.loads(out.split(b"\n")[1][6:])
    assert first == {"type": "response.created", "response": {"id": "resp_1", "output": [], "metadata": {"k": "v"}}}
    assert collector.kv_params["remote_num_tokens"] == 9 and collector.sequence == list(range(10))
    stored = reply_key("t", RESPONSES.history(R_REQUEST), collector.reply_items())
    assert history_keys("t", RESPONSES.history(R_NEXT))[0] == stored


def test_a_null_params_line_with_token_ids_or_a_second_mention_is_parsed():
    line = b'data: {"kv_transfer_params":{"a":1},"x":{"y":1,"kv_transfer_params":null}}\n'
    collector = RESPONSES.collector()
    assert json.loads(collector.scrub_sse_line(line)[6:]) == {"x": {"y": 1, "kv_transfer_params": None}}
    assert collector.kv_params == {"a": 1}


def test_fingerprints_take_odd_tool_names_and_tell_system_prompts_apart():
    tools = [{"name": 3}, {"name": "Bash"}, "not a tool"]
    base = {"model": "m", "messages": [], "tools": tools, "system": [{"type": "text", "text": "main"}]}
    assert MESSAGES.fingerprint(base) == MESSAGES.fingerprint({**base, "system": "main"})
    assert MESSAGES.fingerprint(base) != MESSAGES.fingerprint({**base, "system": "title"})
    assert RESPONSES.fingerprint({"model": "m", "tools": tools}) != RESPONSES.fingerprint({"model": "m"})
