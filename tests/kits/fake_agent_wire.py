"""The fake vLLM's Anthropic Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`) endpoints, as
vLLM 0.32 serves them with pdserve's entry (pdserve/engine/patches.py), on the fake's own prompt and KV logic.

vLLM translates both to a chat request inside the server; so does this module: the body becomes chat messages
(system / instructions first; text blocks and parts as their text, other blocks and items as compact JSON,
thinking and reasoning left out, as templates mostly drop them), the fake's chat path computes it (P's and D's
handles, pulls, held blocks, faults, delays: everything `FakeVLLM._complete` does), and the answer is reshaped:

- Messages, whole: `content` blocks, `usage.input_tokens`, top-level `kv_transfer_params`. Streamed: named
  events message_start, content_block_start / _delta / _stop, message_delta, message_stop, no `[DONE]`; D's
  handles on message_stop's data (the entry's patch; vLLM's own converter drops them).
- Responses, whole: `output` items and `kv_transfer_params`; `max_output_tokens` caps the output; the id is the
  body's `request_id`. Streamed: response.created and response.in_progress (each carrying
  `"kv_transfer_params": null`, as vLLM's do), the output item and part events, response.output_text.delta per
  token, then response.completed whose `response` carries the handles.
- D's token ids: when the request's kv_transfer_params ask (pdserve_return_token_ids), D's returned params get
  its prompt + generated ids (pdserve_token_ids), as the entry's connector patch adds them (fake_vllm's D leg).
- `/v1/messages/count_tokens` ({"input_tokens"}), `/v1/messages/render` and `/v1/responses/render`
  ({"token_ids"}: vLLM's with --enable-scale-out).

The stream options of the chat path apply: --die-mid-stream (the connection closes after two deltas),
--token-delay, --done-delay (before the closing events), --tail-delay (after them), --plain-stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

try:
    from tests.kits import fake_context
except ModuleNotFoundError:      # run as a script: its folder is on the path
    import fake_context  # type: ignore[no-redef]

SKIPPED = ("thinking", "redacted_thinking", "reasoning")
TEXT_PARTS = ("text", "input_text", "output_text")


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _text(content: Any) -> str:
    """A message's content (a string, or blocks / parts) as the text the fake's template puts in the prompt."""
    if isinstance(content, str) or content is None:
        return content or ""
    parts = []
    for block in content if isinstance(content, list) else [content]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in TEXT_PARTS:
            parts.append(str(block.get("text", "")))
        elif kind not in SKIPPED:
            parts.append(_compact({k: v for k, v in block.items() if k != "cache_control"}
                                  if isinstance(block, dict) else block))
    return " ".join(parts)


def messages_chat(body: dict) -> list[dict]:
    """An Anthropic request's conversation as the fake's chat messages (system first)."""
    out = [{"role": "system", "content": _text(body["system"])}] if body.get("system") else []
    return out + [{"role": m.get("role"), "content": _text(m.get("content"))}
                  for m in body.get("messages") or [] if isinstance(m, dict)]


def responses_chat(body: dict) -> list[dict]:
    """A Responses request's instructions and input items as the fake's chat messages."""
    out = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    for item in items if isinstance(items, list) else []:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": _compact([item.get("name"), item.get("arguments")])})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": _text(item.get("output"))})
        elif kind is not None and kind not in SKIPPED:
            out.append({"role": str(kind), "content": _compact(item)})
    return out


def sse(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _no_none(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if v is not None}


class AgentWire:
    """The two endpoints on one FakeVLLM (`fake`): its args, counters and chat path."""

    def __init__(self, fake: Any):
        self.fake = fake

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/messages/render", self.render)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/responses/render", self.render)

    # -- the chat path underneath -----------------------------------------------------------------
    async def _read(self, request: web.Request) -> tuple[bytes, dict]:
        raw = await request.read()
        body = json.loads(raw)
        if self.fake.args.record:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.fake.received.append({"path": request.path, "body": body, "peer": peer[1] if peer else None,
                                       "headers": {k.lower(): v for k, v in request.headers.items()}})
        return raw, body

    def _chat(self, request: web.Request, body: dict) -> list[dict]:
        return messages_chat(body) if request.path.startswith("/v1/messages") else responses_chat(body)

    async def _generate(self, request: web.Request, raw: bytes, body: dict, cap: Any
                        ) -> tuple[web.Response | None, dict]:
        """The fake's chat path on the translated request: (an error answer, or None) and what it computed:
        prompt and generated ids, text, D's (or P's) handles."""
        fake = self.fake
        fault = fake.content_fault(raw, body)
        if fault:
            return web.json_response({"error": {"message": fault, "type": "InternalServerError", "param": None,
                                                "code": 500}}, status=500), {}
        kv = body.get("kv_transfer_params") or {}
        chat = {"model": body.get("model"), "messages": self._chat(request, body), "max_tokens": cap,
                "stream": False, "return_token_ids": True, **({"kv_transfer_params": kv} if kv else {})}
        fake.in_flight += 1
        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        try:
            resp = await fake._complete(request, chat)
        finally:
            fake.in_flight -= 1
        if resp.status != 200:
            return resp, {}
        data = json.loads(resp.body)
        choice = data["choices"][0]
        # the params carry D's sequence when asked: fake_vllm's D leg adds it as the entry's connector patch does
        return None, {"prompt": data["prompt_token_ids"], "generated": choice["token_ids"],
                      "text": choice["message"]["content"], "params": data.get("kv_transfer_params")}

    async def _stream(self, request: web.Request, head: list[bytes], deltas: list[bytes],
                      tail: list[bytes]) -> web.StreamResponse:
        args = self.fake.args
        if args.plain_stream:
            return web.Response(text="not an event stream", content_type="text/plain")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            await out.write(b"".join(head))
            for i, event in enumerate(deltas):
                if args.die_mid_stream and i == 2:
                    request.transport.close()   # like a decode server killed mid-generation
                    raise ConnectionResetError("fake death")
                await out.write(event)
                await asyncio.sleep(args.token_delay)
            await asyncio.sleep(args.done_delay)
            await out.write(b"".join(tail))
            await asyncio.sleep(args.tail_delay)
            await out.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            if not args.die_mid_stream:
                self.fake.cancelled += 1
            raise
        return out

    # -- Anthropic Messages -----------------------------------------------------------------------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        raw, body = await self._read(request)
        error = fake_context.thinking_refusal(body)
        if error is None:
            error, got = await self._generate(request, raw, body, body.get("max_tokens"))
        if error is not None:
            return _anthropic_error(error)
        params = got["params"] if not self.fake.args.no_kv_params else None
        n, prompt = len(got["generated"]), len(got["prompt"])
        mid = f"msg_{uuid.uuid4().hex}"
        if not body.get("stream"):
            return web.json_response(_no_none({
                "id": mid, "type": "message", "role": "assistant", "model": body.get("model"),
                "content": [{"type": "text", "text": got["text"]}], "stop_reason": "max_tokens",
                "usage": {"input_tokens": prompt, "output_tokens": n}, "kv_transfer_params": params}))
        head = [sse("message_start", {"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "content": [], "model": body.get("model"),
                    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt, "output_tokens": 0}}}),
                sse("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}})]
        deltas = [sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": word + " "}})
                  for word in got["text"].split()]
        tail = [sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                                         "stop_sequence": None},
                                      "usage": {"input_tokens": prompt, "output_tokens": n}}),
                sse("message_stop", _no_none({"type": "message_stop", "kv_transfer_params": params}))]
        return await self._stream(request, head, deltas, tail)

    async def count_tokens(self, request: web.Request) -> web.Response:
        _, body = await self._read(request)
        if self.fake.args.status != 200:
            return _anthropic_error(web.json_response({"error": {"message": "fake failure", "type":
                                                                 "InternalServerError"}}, status=self.fake.args.status))
        n = len(self.fake.prompt_ids("", {"messages": messages_chat(body)}))
        return web.json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    async def render(self, request: web.Request) -> web.Response:
        """vLLM's /v1/{messages,responses}/render (with --enable-scale-out): the prompt's token ids."""
        self.fake.tokenized += 1
        body = await request.json()
        ids = self.fake.prompt_ids("", {"messages": self._chat(request, body)})
        return web.json_response({"request_id": body.get("request_id") or uuid.uuid4().hex, "token_ids": ids,
                                  "model": body.get("model"), "sampling_params": {}})

    # -- OpenAI Responses -------------------------------------------------------------------------
    async def responses(self, request: web.Request) -> web.StreamResponse:
        raw, body = await self._read(request)
        error, got = await self._generate(request, raw, body, body.get("max_output_tokens"))
        if error is not None:
            return error                     # vLLM's Responses errors are OpenAI-shaped
        params = got["params"] if not self.fake.args.no_kv_params else None
        n, prompt = len(got["generated"]), len(got["prompt"])
        rid = body.get("request_id") or f"resp_{uuid.uuid4().hex}"
        item_id = f"msg_{uuid.uuid4().hex}"
        part = {"type": "output_text", "text": got["text"], "annotations": [], "logprobs": None}
        item = {"id": item_id, "type": "message", "role": "assistant", "status": "completed", "content": [part]}
        usage = {"input_tokens": prompt, "output_tokens": n, "total_tokens": prompt + n,
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}

        def response(status: str, output: list, with_usage: dict | None, kv: dict | None) -> dict:
            return {"id": rid, "object": "response", "created_at": int(time.time()), "model": body.get("model"),
                    "status": status, "output": output, "usage": with_usage, "instructions": body.get("instructions"),
                    "incomplete_details": None, "metadata": None, "parallel_tool_calls": True, "temperature": 1.0,
                    "tool_choice": "auto", "tools": body.get("tools") or [], "top_p": 1.0, "background": False,
                    "max_output_tokens": n, "previous_response_id": None, "service_tier": "auto",
                    "truncation": "disabled", "kv_transfer_params": kv}

        if not body.get("stream"):
            return web.json_response(response("completed", [item], usage, params))
        seq = iter(range(1 << 30))

        def ev(name: str, **data: Any) -> bytes:
            return sse(name, {"type": name, "sequence_number": next(seq), **data})

        started = response("in_progress", [], None, None)
        head = [ev("response.created", response=started), ev("response.in_progress", response=started),
                ev("response.output_item.added", output_index=0,
                   item={**item, "status": "in_progress", "content": []}),
                ev("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                   part={**part, "text": ""})]
        deltas = [ev("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                     delta=word + " ", logprobs=[]) for word in got["text"].split()]
        text = "".join(word + " " for word in got["text"].split())
        done_part = {**part, "text": text}
        done_item = {**item, "content": [done_part]}
        tail = [ev("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                   logprobs=[]),
                ev("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=done_part),
                ev("response.output_item.done", output_index=0, item=done_item),
                ev("response.completed", response=response("completed", [done_item], usage, params))]
        return await self._stream(request, head, deltas, tail)


def _anthropic_error(resp: web.Response) -> web.Response:
    """vLLM's Anthropic router answers its errors as {"type": "error", "error": {"type", "message"}}."""
    try:
        err = json.loads(resp.body).get("error")
    except (TypeError, ValueError, AttributeError):
        return resp                          # --plain-error: a proxy's text page, as it is
    if not isinstance(err, dict):
        return resp
    return web.json_response({"type": "error", "error": {"type": str(err.get("type", "error")),
                                                         "message": str(err.get("message", ""))}},
                             status=resp.status)
