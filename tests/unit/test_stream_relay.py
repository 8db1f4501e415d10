"""Relaying D's SSE stream: whole lines, router-only fields removed even when split across reads."""

from __future__ import annotations

import json

from pdserve.router.api.chat import ChoicesCollector as SequenceCollector
from pdserve.router.relay import StreamRelay


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
