"""A fake vLLM server's bad manners (fake_vllm.py's flags), for the router under a broken or hostile neighbour
(issue 35): what a backend, or a proxy in front of it, may send that vLLM itself does not.

- --interim: an interim `100 Continue` and `103 Early Hints` before every answer (RFC 9110 15.2 allows any number).
- --stray-answer: after every whole answer, the previous one once more, unsolicited (a proxy that replays, a
  backend that answers twice); --stray-delay seconds after the answer (0: in the same write).
- --request-id-headers: X-Request-Id echoed on every answer, as vLLM's --enable-request-id-headers does.
- --echo: the reply begins with the last message's text, and with MISMATCH when the P handles a decode request
  carries were made for another prompt (P's handles carry the prompt's checksum here): what a client checks to
  see whether it got its own answer.
- --endless-body: an answer that never ends (chunked JSON, or for a stream one SSE line that never ends).
- --huge-body N: a valid JSON answer of N bytes (its reply text that long), with its Content-Length.
- --endless-events: a stream of valid events that never ends (a generation without end).
- --huge-ids N: the answer's prompt_token_ids (when asked for) N ids long.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any

from aiohttp import web

# What the fake's chat "template" renders into the prompt besides the messages (fake_vllm.prompt_ids).
RENDERED = ("tools", "documents", "chat_template_kwargs")
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
CHUNK = 1 << 16


def add_flags(p) -> None:
    p.add_argument("--interim", action="store_true", help="100 Continue and 103 Early Hints before every answer")
    p.add_argument("--stray-answer", action="store_true", help="after every whole answer, the previous one again")
    p.add_argument("--stray-delay", type=float, default=0.0, help="seconds after the answer (0: the same write)")
    p.add_argument("--request-id-headers", action="store_true", help="echo X-Request-Id (vLLM's flag of that name)")
    p.add_argument("--echo", action="store_true", help="the reply begins with the last message's text")
    p.add_argument("--endless-body", action="store_true", help="an answer that never ends")
    p.add_argument("--huge-body", type=int, default=0, help="a valid JSON answer of this many bytes")
    p.add_argument("--endless-events", action="store_true", help="a stream of valid events that never ends")
    p.add_argument("--huge-ids", type=int, default=0, help="prompt_token_ids this many ids long")


def prompt_sum(prompt: list[int]) -> int:
    return zlib.crc32(json.dumps(prompt).encode())


def echo_prefix(body: dict[str, Any], prompt: list[int]) -> str:
    """The reply's first words under --echo: the last message's text, MISMATCH if P's handles are another's."""
    kv = body.get("kv_transfer_params") or {}
    mismatch = "fake_prompt_sum" in kv and kv["fake_prompt_sum"] != prompt_sum(prompt)
    messages = body.get("messages") or [{}]
    last = messages[-1].get("content") if isinstance(messages[-1], dict) else ""
    return ("MISMATCH " if mismatch else "") + (last if isinstance(last, str) else str(body.get("prompt", "")))


class Manners:
    def __init__(self, args):
        self.args = args
        self.last: bytes | None = None      # the previous whole answer, as sent

    @property
    def any(self) -> bool:
        a = self.args
        return (a.interim or a.stray_answer or a.request_id_headers or a.endless_body or bool(a.huge_body)
                or a.endless_events or bool(a.huge_ids))

    def headers(self, request: web.Request) -> dict[str, str]:
        rid = request.headers.get("X-Request-Id")
        return {"X-Request-Id": rid} if rid and self.args.request_id_headers else {}

    def before(self, request: web.Request) -> None:
        if self.args.interim and request.transport is not None:
            request.transport.write(INTERIM)

    async def whole(self, request: web.Request, resp: dict[str, Any]) -> web.StreamResponse:
        """A whole JSON answer, then (--stray-answer) the previous one again."""
        if self.args.huge_ids and "prompt_token_ids" in resp:
            resp["prompt_token_ids"] = [1000 + i % 30000 for i in range(self.args.huge_ids)]
        payload = json.dumps(resp).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(payload)), **self.headers(request)}
        raw = (b"HTTP/1.1 200 OK\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"
               + payload)
        out = web.StreamResponse(headers=headers)
        await out.prepare(request)
        await out.write(payload)
        await out.write_eof()
        stray, self.last = self.last, raw
        if self.args.stray_answer and stray is not None and request.transport is not None:
            if self.args.stray_delay:
                await asyncio.sleep(self.args.stray_delay)
            if request.transport is not None and not request.transport.is_closing():
                request.transport.write(stray)
        return out

    async def endless(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """--endless-body and --huge-body: written as fast as the router reads."""
        stream = bool(body.get("stream"))
        if self.args.huge_body and not stream:
            head = b'{"id": "cmpl-fake", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": ' \
                   b'"length", "message": {"role": "assistant", "content": "'
            tail = b'"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}'
            out = web.StreamResponse(headers={"Content-Type": "application/json", **self.headers(request)})
            out.content_length = self.args.huge_body
            await out.prepare(request)
            await out.write(head)
            left = self.args.huge_body - len(head) - len(tail)
            try:
                while left > 0:
                    n = min(CHUNK, left)
                    await out.write(b"x" * n)
                    left -= n
                await out.write(tail)
                await out.write_eof()
            except ConnectionError:     # the router gave up on it
                pass
            return out
        if self.args.endless_events and stream:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self.headers(request)})
            await out.prepare(request)
            event = b'data: {"id": "cmpl-fake", "choices": [{"index": 0, "delta": {"content": "w "}, "token_ids": [7]}]}\n\n'
            try:
                while True:
                    await out.write(event * 64)
            except ConnectionError:
                return out
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json",
                                          **self.headers(request)})
        out.enable_chunked_encoding()
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"index": 0, "delta": {"content": "' if stream else b"[")
        piece = b"x" * CHUNK if stream else b"1," * (CHUNK // 2)
        try:
            while True:
                await out.write(piece)
        except ConnectionError:         # the router gave up on it
            return out
