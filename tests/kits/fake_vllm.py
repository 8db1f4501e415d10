"""A small stand-in for a vLLM OpenAI server with NixlConnector, for router and supervisor edge cases that
real vLLM can't be made to produce on demand (failed KV reads, mid-stream death, slow answers).

It mimics the request shapes of vLLM's P/D flow: P answers `max_tokens: 1` requests carrying
`do_remote_decode` with its own block handles; D answers with generated text and, for bidirectional
transfer, handles to its finished blocks. Tokens: one per whitespace-separated word (ids from a stable
hash); generated tokens are ids >= 50000 whose text re-tokenizes differently, as real replies often do.

As D it also holds each finished turn's blocks (--held-ttl seconds, on the perf_counter clock its handles
export) and answers pdserve's held-KV control routes (GET /pdserve/held, POST /pdserve/held/release and /renew,
as pdserve/engine/held.py does); its /metrics shows a KV capacity (--kv-capacity tokens). As P, a read of D's
blocks is declined within --read-margin seconds of the deadline it is handed (vLLM's P with policy fail), and
otherwise frees them on D (P's read notification); a read of blocks D no longer holds is counted on D
(`stale_reads`: the hazard a router must never cause).

Run: python -m tests.kits.fake_vllm --port 8100 [--fail-reads] [--stream-kv-params] [--die-mid-stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
import zlib

import aiohttp
from aiohttp import web

from pdserve.engine.patches import cut_offer
from pdserve.router.wire import CHECKED_KEY, CONTROL_TOKEN_ENV, LOCAL_KEY, PROMPT_IDS_KEY, PULLED_KEY, WANT_PROMPT_IDS_KEY
from pdserve.router.wire import TOKENS_KEY, WANT_TOKENS_KEY
try:
    from tests.kits import fake_context, fake_tier, hostile
    from tests.kits.fake_agent_wire import AgentWire
except ModuleNotFoundError:      # run as a script (python tests/kits/fake_vllm.py): its folder is on the path
    import fake_context  # type: ignore[no-redef]
    import fake_tier  # type: ignore[no-redef]
    import hostile  # type: ignore[no-redef]
    from fake_agent_wire import AgentWire  # type: ignore[no-redef]

BLOCK = 16
KV_BYTES_PER_TOKEN = 147456    # an 8B-class model in bf16 (36 layers x 8 KV heads x 128 x 2 x 2 bytes ~ 144 KiB)
FAKE = web.AppKey("fake", object)
LONG_WORD = 24     # longer words split into 8-character pieces, as a BPE vocabulary splits a rare long word


def tokenize_text(text: str) -> list[int]:
    pieces = [w[i:i + 8] if len(w) > LONG_WORD else w for w in text.split()
              for i in (range(0, len(w), 8) if len(w) > LONG_WORD else (0,))]
    return [zlib.crc32(p.encode()) % 40000 for p in pieces]


def chat_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    parts = [f"<{m.get('role')}> {m.get('content') or ''} </s>" for m in messages]
    return " ".join(parts) + (" <assistant>" if add_generation_prompt else "")


class FakeVLLM:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine_id = uuid.uuid4().hex
        self.received: list[dict] = []      # every completion body, for tests to inspect
        self.external_tokens = 0            # like vllm:prompt_tokens_by_source{source="external_kv_transfer"}
        self.healthy = True
        self.leaked_counts = 0              # requests that arrived with P's pulled/local counts
        self.prompts_from_ids = 0           # D legs served from P's forwarded prompt ids (vLLM's #48145)
        self.wrong_prompt_ids = 0           # ... whose ids were not this server's own tokenization
        self.cancelled = 0                  # streams cut off by the other side (client went away)
        self.computed_tokens = 0            # like ...{source="local_compute"}
        self.in_flight = self.max_in_flight = 0
        self.tokenized = 0                  # /tokenize calls
        self.tokenize_bodies: list[dict] = []
        self.xfer_bytes = self.xfer_seconds = 0.0   # like vllm:nixl_bytes_transferred / nixl_xfer_time_seconds
        self.xfer_count = 0
        # As D: turns held for P's read, by remote_request_id: {"deadline", "tokens", "blocks"} (perf_counter)
        self.held: dict[str, dict] = {}
        self.releases: list[tuple[str, float]] = []    # (request id, grace) of every release call's ids
        self.renewals: list[tuple[str, float]] = []    # (request id, ttl)
        self.stale_reads = 0                            # P read blocks this D no longer held
        self.max_held_tokens = 0                        # the most held at once (whole blocks)
        self.stalled = 0                                # requests that waited for room (--stall-when-full)
        self.manners = hostile.Manners(args)            # what vLLM never sends (hostile.py)

    def held_tokens(self) -> int:
        self.expire_held()
        return sum(h["blocks"] * BLOCK for h in self.held.values())

    def expire_held(self) -> None:
        now = time.perf_counter()
        for rid in [rid for rid, h in self.held.items() if now >= h["deadline"]]:
            del self.held[rid]

    def hold(self, rid: str, tokens: int, blocks: int) -> float:
        deadline = time.perf_counter() + self.args.held_ttl
        self.held[rid] = {"deadline": deadline, "tokens": tokens, "blocks": blocks}
        self.max_held_tokens = max(self.max_held_tokens, self.held_tokens())
        return deadline

    async def wait_for_room(self, tokens: int) -> None:
        """Like vLLM's scheduler with held blocks filling the KV cache: the request waits for room."""
        if not self.args.stall_when_full:
            return
        started, waited = time.monotonic(), False
        while self.held_tokens() + tokens > self.args.kv_capacity and time.monotonic() - started < 60:
            waited = True
            await asyncio.sleep(0.02)
        self.stalled += waited

    async def read_from_d(self, request: web.Request, kv: dict) -> web.Response | None:
        """P's read of D's blocks: declined near the deadline it is handed; otherwise D frees them."""
        deadline = kv.get("remote_blocks_expiry_time")
        if isinstance(deadline, int | float) and time.perf_counter() + self.args.read_margin >= deadline:
            return web.json_response({"error": {"message": "Declining expired remote read", "type":
                                                "InternalServerError", "param": None, "code": 500}}, status=500)
        url = kv.get("fake_d_url")
        if url:
            async with aiohttp.ClientSession() as s, s.post(url + "/fake/read",
                                                            json={"request_id": kv.get("remote_request_id")}) as r:
                await r.read()
        return None

    async def read_endpoint(self, request: web.Request) -> web.Response:
        rid = (await request.json()).get("request_id")
        self.expire_held()
        if self.held.pop(rid, None) is None:
            self.stale_reads += 1
        return web.json_response({})

    async def held_list(self, request: web.Request) -> web.Response:
        if self.args.no_held_control:
            raise web.HTTPNotFound()
        if not held_authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        self.expire_held()
        now = time.perf_counter()
        held = [{"request_id": rid, "deadline": h["deadline"], "remaining_s": h["deadline"] - now,
                 "blocks": h["blocks"], "tokens": h["tokens"]} for rid, h in self.held.items()]
        return web.json_response({"now": now, "clock": "perf_counter", "engine_id": self.engine_id,
                                  "count": len(held), "blocks": sum(h["blocks"] for h in held), "held": held})

    async def held_change(self, request: web.Request) -> web.Response:
        if self.args.no_held_control:
            raise web.HTTPNotFound()
        if self.args.held_status != 200:
            return web.json_response({"error": {"message": "fake"}}, status=self.args.held_status)
        if not held_authorized(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        release = request.path.endswith("/release")
        seconds = float(body.get("grace", 5.0) if release else body["ttl"])
        self.expire_held()
        now = time.perf_counter()
        results = {}
        for rid in body["request_ids"]:
            h = self.held.get(rid)
            if h is None:
                results[rid] = {"status": "unknown"}
                continue
            if release:
                self.releases.append((rid, seconds))
                h["deadline"] = min(h["deadline"], now + seconds)
                if seconds == 0:
                    del self.held[rid]      # freed at the engine's next step
            else:
                self.renewals.append((rid, seconds))
                h["deadline"] = max(h["deadline"], now + seconds)
            results[rid] = {"status": "released" if release else "renewed", "deadline": h["deadline"],
                            "blocks": h["blocks"], "tokens": h["tokens"]}
        return web.json_response({"now": now, "clock": "perf_counter", "engine_id": self.engine_id,
                                  "results": results})

    def read_kv(self, tokens: int) -> None:
        """Account one NIXL read of `tokens` tokens' KV at --xfer-gbps."""
        moved = tokens * KV_BYTES_PER_TOKEN
        self.xfer_bytes += moved
        self.xfer_seconds += moved / (self.args.xfer_gbps * 1e9)
        self.xfer_count += 1

    def prompt_ids(self, route: str, body: dict) -> list[int]:
        if "messages" in body:
            # As a chat template does, the tools and the like go into the prompt (before the messages).
            rendered = " ".join(json.dumps(body[f]) for f in hostile.RENDERED if f in body)
            return tokenize_text(rendered + " " + chat_text(body["messages"], body.get("add_generation_prompt", True)))
        p = body.get("prompt")
        return p if isinstance(p, list) else tokenize_text(str(p))

    def content_fault(self, raw: bytes, body: dict) -> str | None:
        """What a backend build that crashes on some content would say (a 500 InternalServerError, not a 400):
        a lone surrogate, a body over --max-body bytes, or a body holding the --fail-on text."""
        if self.args.fail_on_surrogate:
            try:
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError as err:
                return str(err)
        if self.args.max_body and len(raw) > self.args.max_body:
            return "request too large"
        if self.args.fail_on and self.args.fail_on in raw.decode(errors="replace"):
            return "EngineCore encountered an issue"
        return None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        if self.args.record:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.received.append({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()},
                                  "body": body, "peer": peer[1] if peer else None})
        fault = self.content_fault(raw, body)
        if fault:
            return web.json_response({"error": {"message": fault, "type": "InternalServerError", "param": None,
                                                "code": 500}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._complete(request, body)
        finally:
            self.in_flight -= 1

    async def _complete(self, request: web.Request, body: dict) -> web.StreamResponse:
        if self.args.delay:
            await asyncio.sleep(self.args.delay)
        if self.args.drop_connection:
            # What a client sees of a server killed mid-request: the connection closes, no answer.
            request.transport.abort()
            raise asyncio.CancelledError
        if self.manners.any:
            self.manners.before(request)
            if self.args.endless_body or self.args.huge_body or (self.args.endless_events and body.get("stream")):
                return await self.manners.endless(request, body)
        if self.args.status != 200 and self.args.plain_error:   # e.g. a proxy's or a crashed server's page
            return web.Response(status=self.args.status, text="Internal Server Error")
        if self.args.status != 200:
            kind = self.args.error_type or ("BadRequestError" if self.args.status < 500 else "InternalServerError")
            return web.json_response({"error": {"message": "fake failure", "type": kind,
                                                "param": None, "code": self.args.status}}, status=self.args.status)
        kv = body.get("kv_transfer_params") or {}
        prompt = self.prompt_ids(request.path, body)
        refused = fake_context.refusal(request.path, body, len(prompt), self.args.max_model_len)
        if refused is not None:
            return refused          # vLLM's validation: nothing computed, nothing read
        pulled = 0
        checked = cut_offer(kv, prompt, BLOCK)    # pdserve's entry patch: an engine-checked offer is cut here
        if kv.get("remote_block_ids") and kv.get("do_remote_decode") and fake_tier.reads(self.args, kv, prompt):
            if self.args.fail_reads:
                return web.json_response({"error": {"message": "Internal server error", "type": "InternalServerError",
                                                    "param": None, "code": 500}}, status=500)
            declined = await self.read_from_d(request, kv)   # P pulling D's blocks
            if declined is not None:
                return declined
            pulled = min(int(kv.get("remote_num_tokens", 0)), len(prompt) - 1)
            self.external_tokens += pulled
            self.read_kv(pulled)
        tier = fake_tier.tier_tokens(self.args, kv, prompt, pulled)   # P's CPU tier (fake_tier.py)
        if any(k in kv for k in (PULLED_KEY, LOCAL_KEY, fake_tier.TIER_KEY)):
            self.leaked_counts += 1   # the router must strip P's counts before D
        forwarded = kv.pop(PROMPT_IDS_KEY, None) if not kv.get("do_remote_decode") else None
        if forwarded is not None:     # vLLM's chat path: the engine gets these instead of the rendered prompt
            self.prompts_from_ids += 1
            self.wrong_prompt_ids += forwarded != prompt
        if kv.get("do_remote_prefill") and kv.get("remote_block_ids") and not self.args.no_kv_in:
            self.external_tokens += len(prompt)   # D reads P's blocks for the whole prompt
            self.read_kv(len(prompt))
        if kv.get("do_remote_decode"):   # prefill cost: pull what was offered, compute the rest
            self.computed_tokens += len(prompt) - pulled - tier
            await asyncio.sleep(self.args.pull_delay * pulled + self.args.compute_delay * (len(prompt) - pulled))
        n = fake_context.output_tokens(body, len(prompt), self.args.max_model_len, 8)
        if kv and not kv.get("do_remote_decode") and self.args.bidirectional:
            await self.wait_for_room(len(prompt) + n)
        generated = [50000 + i for i in range(n)]
        text = " ".join(f"w{i}" for i in range(n))
        if self.args.echo and n:     # in the first word: as many words as tokens
            text = hostile.echo_prefix(body, prompt).replace(" ", "_") + "|" + text
        params = None
        if kv.get("do_remote_decode"):           # prefill leg: hand out P's blocks for D
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_request_id": uuid.uuid4().hex, "remote_block_ids": [list(range(len(prompt) // BLOCK + 1))],
                      "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1,
                      "remote_prefill_cached_tokens": pulled,
                      # what pdserve.engine.entry's connector patch adds on a real P
                      PULLED_KEY: pulled, LOCAL_KEY: 0, fake_tier.TIER_KEY: tier,
                      **({CHECKED_KEY: checked} if checked is not None else {})}
            if kv.get(WANT_PROMPT_IDS_KEY) is True:
                params[PROMPT_IDS_KEY] = prompt
            if self.args.echo:
                params["fake_prompt_sum"] = hostile.prompt_sum(prompt)
        elif kv and self.args.bidirectional:
            # Decode leg, or a request served on D alone ({"do_remote_prefill": false}): as vLLM's pull
            # scheduler, any kv_transfer_params without do_remote_decode make D hand out its finished blocks.
            total = len(prompt) + n - 1
            # as vLLM's engine names it: the caller's X-Request-Id with a random suffix
            rid = f"cmpl-{request.headers.get('X-Request-Id', 'none')}-{uuid.uuid4().hex[:8]}"
            blocks = total // BLOCK + 1
            params = {"do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": self.engine_id,
                      "remote_request_id": rid, "remote_block_ids": [list(range(blocks))],
                      "remote_host": "127.0.0.1", "remote_port": 2, "remote_num_tokens": total,
                      "remote_blocks_expiry_time": self.hold(rid, total, blocks), "transfer_mode": "pull",
                      "tp_size": 1, "fake_d_url": f"http://{request.host}",   # and the entry's patch, when asked:
                      **({TOKENS_KEY: prompt + generated} if kv.get(WANT_TOKENS_KEY) is True else {})}
        chat = "messages" in body
        ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            usage = ({"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
                     if (body.get("stream_options") or {}).get("include_usage") else None)
            return await self.stream(request, chat, text.split(), generated, prompt, params, ids, usage)
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        resp = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "model": body.get("model"),
                "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                              "total_tokens": len(prompt) + n}}
        if ids:
            choice["token_ids"] = generated
            if chat:
                resp["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        if params and not self.args.no_kv_params:
            resp["kv_transfer_params"] = params
        await asyncio.sleep(self.args.answer_delay)     # finished (and held) but not yet sent
        if self.manners.any:
            return await self.manners.whole(request, resp)
        return web.json_response(resp)

    async def stream(self, request, chat, words, generated, prompt, params, ids, usage=None) -> web.StreamResponse:
        if self.args.plain_stream:     # a broken server: plain text where SSE was asked for
            return web.Response(text=" ".join(words), content_type="text/plain")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            await self._stream_words(request, out, chat, words, generated, prompt, params, ids, usage)
        except (asyncio.CancelledError, ConnectionResetError):
            if not self.args.die_mid_stream:
                self.cancelled += 1
            raise
        return out

    async def _stream_words(self, request, out, chat, words, generated, prompt, params, ids, usage) -> None:
        for i, word in enumerate(words):
            if self.args.die_mid_stream and i == 2:
                request.transport.close()   # like a decode server killed mid-generation
                raise ConnectionResetError("fake death")
            choice = {"index": 0, "delta": {"content": word + " "}} if chat else {"index": 0, "text": word + " "}
            event = {"id": "cmpl-fake", "choices": [choice]}
            if ids:
                choice["token_ids"] = [generated[i]]
                if i == 0:
                    (event if chat else choice)["prompt_token_ids"] = prompt
            if i == len(words) - 1 and params and self.args.stream_kv_params:
                event["kv_transfer_params"] = params   # vLLM >= 0.33 puts them in the final chunk
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if self.args.bad_sse and i == 1:   # a line the router cannot parse, and no [DONE]
                await out.write(b'data: {"kv_transfer_params": 1, "choices": 5, "token_ids": "x"}\n\n')
                await out.write_eof()
                return
            await asyncio.sleep(self.args.token_delay)
        if usage:       # like vLLM with stream_options.include_usage: a last chunk with no choices
            await out.write(b"data: " + json.dumps({"id": "cmpl-fake", "choices": [], "usage": usage}).encode() + b"\n\n")
        await asyncio.sleep(self.args.done_delay)
        await out.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.args.tail_delay)   # vLLM's body ends a moment after [DONE], not with it
        await out.write_eof()

    async def tokenize(self, request: web.Request) -> web.Response:
        self.tokenized += 1
        body = await request.json()
        self.tokenize_bodies.append(body)
        tokens = self.prompt_ids("", body)
        return web.json_response({"tokens": tokens, "count": len(tokens),
                                  "max_model_len": self.args.max_model_len or 8192})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(fake_context.models("fake", self.args.max_model_len))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=(
            f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",'
            f'num_gpu_blocks="{self.args.kv_capacity // BLOCK}"}} 1.0\n'
            f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="external_kv_transfer"}} '
            f"{float(self.external_tokens)}\n"
            f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="m",source="local_compute"}} '
            f"{float(self.computed_tokens)}\n"
            f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {self.xfer_bytes}\n'
            f'vllm:nixl_xfer_time_seconds_sum{{engine="0"}} {self.xfer_seconds}\n'
            f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {float(self.xfer_count)}\n'
            f"fake_tokenize_requests_total {float(self.tokenized)}\n"))

    async def received_endpoint(self, request: web.Request) -> web.Response:
        return web.json_response(self.received)

    async def set_endpoint(self, request: web.Request) -> web.Response:
        """Change behaviour at run time, e.g. {"pull_delay": 0.01} or {"status": 500}."""
        for name, value in (await request.json()).items():
            setattr(self.args, name, value)
        return web.json_response(vars(self.args))


def held_authorized(request: web.Request) -> bool:
    """As pdserve/engine/held_http.py: the cluster's control token when the server has one, else its API key."""
    key = os.environ.get(CONTROL_TOKEN_ENV) or os.environ.get("VLLM_API_KEY")
    return not key or request.headers.get("Authorization") == f"Bearer {key}"


@web.middleware
async def vllm_api_key(request: web.Request, handler):
    """Like vLLM with VLLM_API_KEY set: /v1 paths want the bearer key."""
    key = os.environ.get("VLLM_API_KEY")
    if key and request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def build_app(args: argparse.Namespace) -> web.Application:
    fake = FakeVLLM(args)
    app = web.Application(middlewares=[vllm_api_key], client_max_size=64 * 1024 * 1024)
    app[FAKE] = fake
    app.router.add_post("/v1/chat/completions", fake.completions)
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_post("/tokenize", fake.tokenize)
    AgentWire(fake).add_routes(app)   # /v1/messages (+ count_tokens, render), /v1/responses (+ render)
    app.router.add_get("/health", fake.health)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_get("/fake/received", fake.received_endpoint)
    app.router.add_post("/fake/set", fake.set_endpoint)
    app.router.add_post("/fake/read", fake.read_endpoint)
    app.router.add_get("/pdserve/held", fake.held_list)
    app.router.add_post("/pdserve/held/release", fake.held_change)
    app.router.add_post("/pdserve/held/renew", fake.held_change)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--fail-reads", action="store_true", help="500 when asked to pull D's blocks")
    p.add_argument("--no-bidirectional", dest="bidirectional", action="store_false")
    p.add_argument("--stream-kv-params", action="store_true", help="kv_transfer_params in the last chunk")
    p.add_argument("--die-mid-stream", action="store_true")
    p.add_argument("--drop-connection", action="store_true", help="close the connection without an answer")
    p.add_argument("--error-type", default="", help="error.type of --status answers (default by status)")
    p.add_argument("--plain-stream", action="store_true", help="answer streamed requests with text/plain")
    p.add_argument("--bad-sse", action="store_true", help="a malformed SSE line mid-stream, then no [DONE]")
    p.add_argument("--no-record", dest="record", action="store_false", help="keep no request bodies (benchmarks)")
    p.add_argument("--no-kv-in", action="store_true", help="as decode, never count P's blocks as read (broken NIXL)")
    p.add_argument("--plain-error", action="store_true", help="--status answers as text/plain, not JSON")
    p.add_argument("--no-kv-params", action="store_true", help="answer without kv_transfer_params (no NIXL)")
    p.add_argument("--fail-on-surrogate", action="store_true", help="500 for a lone surrogate in the body")
    p.add_argument("--fail-on", default="", help="500 for a body holding this text")
    p.add_argument("--max-body", type=int, default=0, help="500 for a body over this many bytes")
    p.add_argument("--status", type=int, default=200, help="answer every completion with this status")
    p.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--xfer-gbps", type=float, default=100.0, help="GB/s its NIXL reads report")
    p.add_argument("--done-delay", type=float, default=0.0, help="seconds between the last chunk and [DONE]")
    p.add_argument("--answer-delay", type=float, default=0.0, help="seconds between a whole answer's end and "
                   "its sending")
    p.add_argument("--tail-delay", type=float, default=0.0, help="seconds between [DONE] and the body's end")
    p.add_argument("--compute-delay", type=float, default=0.0, help="prefill seconds per computed token")
    p.add_argument("--pull-delay", type=float, default=0.0, help="prefill seconds per token pulled from D")
    p.add_argument("--startup-delay", type=float, default=0.0, help="seconds before listening")
    p.add_argument("--max-model-len", type=int, default=0, help="refuse and cap as vLLM 0.32 does (0: no limit)")
    p.add_argument("--kv-capacity", type=int, default=1_000_000, help="KV tokens its /metrics says it has")
    p.add_argument("--held-ttl", type=float, default=480.0, help="as D: seconds a finished turn is held")
    p.add_argument("--read-margin", type=float, default=5.0, help="as P: decline a read this close to its deadline")
    p.add_argument("--stall-when-full", action="store_true", help="as D: a request waits while held blocks fill "
                   "--kv-capacity (vLLM's scheduler)")
    p.add_argument("--no-held-control", action="store_true", help="no /pdserve/held routes (404)")
    p.add_argument("--held-status", type=int, default=200, help="answer release/renew with this status")
    p.add_argument("--exit-after", type=float, default=0.0, help="exit(3) this many seconds after start")
    hostile.add_flags(p)
    fake_tier.add_flags(p)
    p.add_argument("--spawn-child", action="store_true", help="start a long-lived child, like vLLM's EngineCore")
    p.add_argument("--child-without-marker", action="store_true", help="the child's environment is empty")
    args, _ = p.parse_known_args(argv)   # ignore vLLM's own flags when started by pdserve
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    time.sleep(args.startup_delay)
    if args.exit_after:
        threading.Timer(args.exit_after, os._exit, (3,)).start()
    if args.spawn_child:
        # Like vLLM's retitled EngineCore: an empty environment (no marker), and it outlives its parent.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                         env={} if args.child_without_marker else None)
    web.run_app(build_app(args), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
