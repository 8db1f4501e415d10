"""Relaying D's SSE stream: whole lines, router-only fields removed even when split across reads."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.router import api
from pdserve.router.api.chat import ChoicesCollector as SequenceCollector
from pdserve.router.legs.relay import StreamRelay
from tests.kits import wire_samples as wire


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


STREAM = (sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [5]}], "prompt_token_ids": [1, 2]})
          + sse({"choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [6]}]})
          + sse({"choices": [{"index": 0, "delta": {}}], "kv_transfer_params": {"remote_block_ids": [[1]]}})
          + b"data: [DONE]\n\n")


def relay_in_pieces(size: int, keep_lines: bool = True) -> tuple[bytes, SequenceCollector, StreamRelay]:
    collector = SequenceCollector(keep_for_client=False)
    relay = StreamRelay(collector, keep_lines)
    out = b"".join(relay.feed(STREAM[i:i + size]) for i in range(0, len(STREAM), size)) + relay.close()
    relay.finish()
    return out, collector, relay


def test_fields_are_removed_whatever_the_read_sizes():
    for size in (1, 7, 50, len(STREAM)):
        out, collector, _ = relay_in_pieces(size)
        assert b"token_ids" not in out and b"kv_transfer_params" not in out
        assert out.count(b"data: ") == 4 and out.endswith(b"data: [DONE]\n\n")
        assert collector.sequence == [1, 2, 5, 6]
        assert collector.kv_params == {"remote_block_ids": [[1]]}
        assert collector.reply["content"] == "Hello"      # rebuilt once, in order


def test_plain_lines_pass_untouched_and_reply_is_skipped_without_blocks():
    plain = sse({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    collector = SequenceCollector(keep_for_client=False)
    relay = StreamRelay(collector, keep_lines=True)
    assert relay.feed(plain) == plain
    relay.finish()
    assert collector.kv_params is None and collector.reply["content"] == ""   # nothing to remember


# -- what the relay costs, and that no chunking changes a byte (issue 31) ----------------------------------
def chat_stream(n: int, token_ids: bool = False, word: str = "t\u00e9") -> bytes:
    """A chat stream as vLLM writes it (compact JSON): a role chunk, n tokens (one a tool call's), D's handles
    in a last chunk, [DONE]."""
    def chunk(choice: dict, **top) -> bytes:
        return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [choice], **top},
                                      separators=(",", ":")).encode() + b"\n\n"
    ids = {"token_ids": [7]} if token_ids else {}
    out = chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, **ids}, prompt_token_ids=[1, 2])
    for i in range(n):
        out += chunk({"index": 0, "delta": {"content": f"{word}{i} \"q\"\n"}, **ids})
    out += chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]},
                  **ids})
    return out + b'data: {"choices":[],"kv_transfer_params":{"remote_block_ids":[[1]]}}\n\ndata: [DONE]\n\n'


def by_lines(fmt, stream: bytes) -> tuple[bytes, list]:
    """The client's bytes and the stored reply as the relay made them before issue 31's change: every line
    scrubbed on its own, the reply rebuilt event by event."""
    from pdserve.router.api.base import sse_event
    from pdserve.router.api.base import Collector
    collector = fmt.collector()
    out = b"".join(Collector.scrub_sse_line(collector, line, False) for line in stream.splitlines(keepends=True))
    collector.reset_reply()
    for line in stream.split(b"\n"):
        event = sse_event(line) if line.startswith(b"data: {") else None
        if event is not None:
            collector.collect_event(event)
    return out, collector.reply_items()


def test_a_block_of_many_events_parses_only_the_lines_with_router_fields_and_the_reply_once(monkeypatch):
    """A fast D's stream often arrives in a few large reads: each line of a read used to be parsed when any
    line of it carried D's handles, and the reply was rebuilt with one parse an event (5 ms of router CPU a
    128-token stream, docs/router.md). Now: the lines with router fields, and the reply in one parse."""
    import pdserve.router.api.base as base
    stream, calls = chat_stream(128), []
    real = json.loads
    monkeypatch.setattr(base.json, "loads", lambda s, *a, **k: calls.append(1) or real(s, *a, **k))
    fast = base.fastjson.loads          # the reply's one parse (router/fastjson.py)
    monkeypatch.setattr(base.fastjson, "loads", lambda s: calls.append(1) or fast(s))
    collector = SequenceCollector(keep_for_client=False)
    relay = StreamRelay(collector, keep_lines=True)
    out = relay.feed(stream) + relay.close()
    relay.finish()
    assert len(calls) == 3 and relay.done         # the prompt ids' line, the handles' line, the reply
    monkeypatch.undo()
    assert (out, collector.reply_items()) == by_lines(api.for_path("/v1/chat/completions"), stream)
    assert collector.reply["content"].endswith("t\u00e9127 \"q\"\n") and collector.reply["tool_calls"]


STREAMS = {"/v1/chat/completions": chat_stream(40), "/v1/messages": wire.STREAM, "/v1/responses": wire.R_STREAM,
           "/v1/chat/completions ids": chat_stream(40, token_ids=True, word="t"),    # vLLM's, token ids cut as bytes
           "/v1/chat/completions ids, not ASCII": chat_stream(40, token_ids=True)}


@pytest.mark.parametrize("route", list(STREAMS))
@pytest.mark.parametrize("chunking", ["1", "2", "3", "7", "64", "whole", "events", "random"])
def test_any_chunking_gives_the_client_the_same_bytes_and_stores_the_same_reply(route, chunking):
    fmt, stream = api.for_path(route.split()[0]), STREAMS[route]
    if chunking == "whole":
        pieces = [stream]
    elif chunking == "events":
        pieces = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    elif chunking == "random":
        rng, pieces, at = random.Random(31), [], 0
        while at < len(stream):
            step = rng.choice([1, 2, 5, 40, 300])
            pieces.append(stream[at:at + step])
            at += step
    else:
        pieces = [stream[i:i + int(chunking)] for i in range(0, len(stream), int(chunking))]
    assert b"".join(pieces) == stream
    collector = fmt.collector()
    relay = StreamRelay(collector, keep_lines=True)
    out = b"".join(relay.feed(p) for p in pieces) + relay.close()
    relay.finish()
    want_out, want_reply = by_lines(fmt, stream)
    assert out == want_out and b"kv_transfer_params" not in out and b"token_ids" not in out
    assert collector.reply_items() == want_reply and collector.kv_params is not None
    if "ids" in route:
        assert collector.sequence == [1, 2] + [7] * 42


def test_a_bad_line_leaves_out_that_line_only_from_the_reply():
    stream = (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\ndata: {not json}\n\n'
              b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
              b'data: {"choices":[{"index":0,"delta":{"content":"c"}}]},{"x":1}\n\n'
              b'data: {"choices":[],"kv_transfer_params":{"remote_block_ids":[[1]]}}\n\ndata: [DONE]\n\n')
    collector = SequenceCollector(keep_for_client=False)
    relay = StreamRelay(collector, keep_lines=True)
    relay.feed(stream)
    relay.finish()
    assert collector.reply["content"] == "ab"


ODD_EVENTS = {
    "/v1/chat/completions": [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"content": "X"}}]},
        {"choices": [{"index": 1, "delta": {"content": "Y"}}]},
        {"choices": [{"delta": {"content": "b"}}]},
        {"choices": [{"index": 0, "delta": {"content": None}}]},
        {"choices": [{"index": 0, "delta": {"content": "c", "tool_calls": [{"function": {"name": "f"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "message": None, "delta": {"content": "d"}}]},
        {"choices": "not a list"}, {"choices": []}, {"usage": {}},
        {"choices": [{"index": 0, "text": "e"}]}],
    "/v1/messages": [
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lost"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "A"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "b"}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": 5}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "c"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "new "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "d"}},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "name": "f"}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
        {"type": "content_block_delta", "index": True, "delta": {"type": "text_delta", "text": "t"}}],
}


@pytest.mark.parametrize("route", list(ODD_EVENTS))
def test_the_formats_fast_reply_paths_collect_what_collect_event_does(route):
    fmt = api.for_path(route)
    fast, slow = fmt.collector(), fmt.collector()
    fast.collect_events(ODD_EVENTS[route])
    for event in ODD_EVENTS[route]:
        slow.collect_event(event)
    assert fast.reply_items() == slow.reply_items()


def vllm_chunk(choice: dict, **top) -> bytes:
    return b"data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                   "choices": [choice], **top}, separators=(",", ":")).encode() + b"\n"


TOKEN_LINES = [   # what vLLM sends with return_token_ids, and lines like it that must be parsed
    vllm_chunk({"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None, "token_ids": [5]}),
    vllm_chunk({"index": 0, "delta": {"content": "q\"\\/\n\t\u0001\u007f, \": x"}, "logprobs": None,
                "finish_reason": None, "token_ids": [6, 7]}),
    vllm_chunk({"index": 0, "delta": {}, "finish_reason": "length", "stop_reason": None, "token_ids": []}),
    vllm_chunk({"index": 0, "delta": {"content": "\u00e9"}, "token_ids": [8]}),          # not ASCII: parsed
    vllm_chunk({"index": 0, "delta": {"content": "x"}, "logprobs": {"content": [{"logprob": -1e-05}]},
                "token_ids": [9]}),
    vllm_chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
                "token_ids": [10]}),
    vllm_chunk({"index": 1, "delta": {"content": "b"}, "token_ids": [11]}),               # not choice 0
    vllm_chunk({"index": 0, "delta": {"content": "c"}, "token_ids": [12]}, prompt_token_ids=[1, 2]),
    vllm_chunk({"index": 0, "delta": {"content": "d"}, "token_ids": [13]}, usage={"prompt_tokens": 2}),
    vllm_chunk({"index": 0, "delta": {"content": "e"}, "token_ids": [14]})[:-1] + b"\r\n",
    b'data: {"choices": [{"index": 0, "delta": {"content": "f"}, "token_ids": [15]}]}\n',   # not compact
    b'data:{"choices":[{"index":0,"delta":{"content":"g"},"token_ids":[16]}]}\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"h"},"token_ids":[17]}],"token_ids":[1]}\n',
]


@pytest.mark.parametrize("keep", [False, True])
def test_a_chunk_cut_as_bytes_gives_the_client_what_parsing_it_gave(keep):
    """vLLM's token chunks (return_token_ids, asked for on every tracked chat turn) lose their token ids without
    a parse; the bytes and the ids collected are those of the parse (the collector's base scrub_sse_line)."""
    from pdserve.router.api.base import Collector
    fast, slow = SequenceCollector(keep_for_client=keep), SequenceCollector(keep_for_client=keep)
    for line in TOKEN_LINES:
        assert fast.scrub_sse_line(line, collect_reply=False) == Collector.scrub_sse_line(slow, line, False), line
    assert fast.generated == slow.generated == [5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]   # not choice 1's
    assert fast.prompt == slow.prompt == [1, 2]


def test_lines_ended_by_a_lone_cr_still_lose_the_handles():
    """SSE ends a line at CR, LF or CRLF: a D that ends its lines with CR alone still never hands its handles on."""
    stream = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\r\rdata: {"choices":[],' \
             b'"kv_transfer_params":{"remote_block_ids":[[1]]}}\r\rdata: [DONE]\r\r'
    for size in (1, 9, len(stream)):
        collector = SequenceCollector(keep_for_client=False)
        relay = StreamRelay(collector, keep_lines=True)
        out = b"".join(relay.feed(stream[i:i + size]) for i in range(0, len(stream), size)) + relay.close()
        assert b"kv_transfer_params" not in out and collector.kv_params == {"remote_block_ids": [[1]]}


@pytest.mark.parametrize("keep", [False, True])
def test_a_block_cut_as_bytes_gives_the_client_what_parsing_each_line_gave(keep):
    import re
    from pdserve.router.api.base import Collector
    marked = re.compile(b"kv_transfer_params|token_ids").search
    from pdserve.router.api.chat import _plain
    for lines in (TOKEN_LINES, [line for line in TOKEN_LINES if _plain(line)]):     # parsed; cut as bytes
        block = b"".join(lines) + b'data: {"choices":[],"kv_transfer_params":{"a":1}}\n\ndata: [DONE]\n\n'
        fast, slow = SequenceCollector(keep_for_client=keep), SequenceCollector(keep_for_client=keep)
        want = b"".join(Collector.scrub_sse_line(slow, line, False) for line in block.splitlines(keepends=True))
        assert fast.scrub_block(block, marked) == want
        assert fast.generated == slow.generated and fast.kv_params == slow.kv_params == {"a": 1}


@pytest.mark.parametrize("keep", [False, True])
def test_a_run_of_vllm_token_chunks_is_cut_at_once_and_an_odd_line_sends_its_run_line_by_line(keep, monkeypatch):
    import re
    from pdserve.router.api.base import Collector
    marked = re.compile(b"kv_transfer_params|token_ids").search
    token = [vllm_chunk({"index": 0, "delta": {"content": f"w{i} \\\" "}, "logprobs": None, "finish_reason": None,
                         "token_ids": [i, i + 1] if i % 3 else [i]}) + b"\n" for i in range(30)]
    handles = b'data: {"choices":[{"index":0,"delta":{},"token_ids":[99]}],"kv_transfer_params":{"a":1}}\n\n'
    odd = vllm_chunk({"index": 0, "delta": {"content": "x"}, "token_ids": [5]})[:-1] + b' \n\n'   # a space: parsed
    head = vllm_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None}, prompt_token_ids=[1, 2]) + b"\n"
    for block, at_once in ((head + b"".join(token[:20]) + handles + b"".join(token[20:]) + b"data: [DONE]\n\n", True),
                           (b"".join(token[:10]) + odd + b"".join(token[10:]), False)):
        fast, slow = SequenceCollector(keep_for_client=keep), SequenceCollector(keep_for_client=keep)
        want = b"".join(Collector.scrub_sse_line(slow, line, False) for line in block.splitlines(keepends=True))
        if at_once:
            monkeypatch.setattr(fast, "_cut", None)          # not one line by line
        assert fast.scrub_block(block, marked) == want
        assert fast.generated == slow.generated and fast.kv_params == slow.kv_params and fast.prompt == slow.prompt
        monkeypatch.undo()


def test_what_a_stream_keeps_is_charged_and_a_full_budget_keeps_nothing():
    """Issue 45: each stream's kept lines and ids were bounded, their sum not (6 concurrent 31 MB streams
    took the router from 44 to 542 MB). Kept bytes are charged to the router's budget; when it is full the
    stream is relayed whole but not remembered, and gives back what it had taken."""
    from pdserve.router.buffers import BufferBudget
    budget = BufferBudget(10 * len(STREAM))
    charge = budget.charge()
    collector = SequenceCollector(keep_for_client=False)
    relay = StreamRelay(collector, True, charge=charge)
    out = relay.feed(STREAM) + relay.close()
    assert not relay.overflow and budget.held == len(STREAM) and collector.sequence == [1, 2, 5, 6]
    charge.close()
    assert budget.held == 0

    other = budget.charge()
    assert other.take(10 * len(STREAM) - 60)            # another request holds nearly all of it
    charge = budget.charge()
    collector = SequenceCollector(keep_for_client=False)
    relay = StreamRelay(collector, True, charge=charge)
    pieces = [relay.feed(STREAM[i:i + 40]) for i in range(0, len(STREAM), 40)]
    assert b"".join(pieces) + relay.close() == out       # relayed all the same
    assert relay.overflow and charge.held == 0 and len(collector.generated) <= 1
    assert budget.held == 10 * len(STREAM) - 60
