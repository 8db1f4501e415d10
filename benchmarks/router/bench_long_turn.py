#!/usr/bin/env python3
"""What the router adds to one long streamed chat turn (issue 44 item 2: "router: relay and HTTP" was 31 ms of
the H200's 252 ms 36k-token "on" turn), against fake P and D servers that answer at once in vLLM's shapes, with
everything the router asks of them at that length: P's prompt ids (PROMPT_IDS_KEY, N ids) in its params, D's
sequence beside its handles at the end of its answer (WANT_TOKENS_KEY, as pdserve's entry adds it; when a client
asks for return_token_ids, vLLM's own: the prompt's ids in the first chunk and each token's in its chunk).

Per conversation: turn 1 (a chat of ~N tokens: --messages messages of --tokens / --messages tokens' worth of
text each), stored by the router; then turn 2 = turn 1 + the reply + one user message, which the router finds
by its history and offers D's blocks for (D's whole sequence under EXPECT_KEY). Timed: turn 2, from the request
sent to the first content chunk read, through the router, and "direct" (this script sending the same two legs
itself, bodies of the same size); one request at a time, conversations alternated with direct. Printed: p50s and
the router's added ms, the router's own Server-Timing legs and its CPU ms a turn (psutil).

    .venv/bin/python benchmarks/router/bench_long_turn.py [--api chat|messages] [--tokens 36864] [--messages 40]
        [--turns 20]

The router runs on core 0, this script and the fake servers on core 1 (as bench_router.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router import free_port_pair, load_core, spawn, start_arm, wait_up  # noqa: E402
from bench_router_backends import fake_vllm_app, serve_on_two_ports  # noqa: E402

from pdserve.router.wire import (CHECKED_KEY, EXPECT_KEY, LOCAL_KEY, PROMPT_IDS_KEY, PULLED_KEY,  # noqa: E402
                                 TOKENS_KEY, WANT_PROMPT_IDS_KEY, WANT_TOKENS_KEY)

WORDS_PER_TOKEN = 0.75        # the fake's count: one token a 4/3 words, as English text runs
REPLY_TOKENS = 16
JSON = {"Content-Type": "application/json"}
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


def text(tokens: int, seed: int) -> str:
    return " ".join(f"w{(seed * 7919 + i) % 5003}" for i in range(int(tokens * WORDS_PER_TOKEN)))


def history(tokens: int, messages: int, seed: int) -> list[dict]:
    each = tokens // messages
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text(each, seed * 1000 + i)}
            for i in range(messages - 1)] + [{"role": "user", "content": text(each, seed * 1000 + messages)}]


def count(body: dict) -> int:
    return sum(len(m["content"].split()) for m in body["messages"]) * 4 // 3


# ---------------------------------------------------------------------------------------------------------
# The fake servers: P answers its leg with its params (and its prompt ids when asked), D streams REPLY_TOKENS
# tokens (with return_token_ids' ids when asked) and its handles at the end (with its sequence when asked).

def serve_fakes(port: int) -> None:
    from aiohttp import web

    def sse(obj: dict, event: str | None = None) -> bytes:
        return (f"event: {event}\n".encode() if event else b"") + b"data: " + \
            json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def p_params(request: web.Request, kv: dict, n: int, ids: list[int]) -> dict:
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
                  "remote_request_id": request.headers.get("X-Request-Id", "r"), "remote_block_ids": [[1, 2]],
                  "remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": n}
        if kv.get(WANT_PROMPT_IDS_KEY):
            params[PROMPT_IDS_KEY] = ids
        # As P with pdserve's connector patch: its counts on every answer (so the router offers D's blocks
        # with D's sequence for P's engine to check), an offer read whole.
        offered = kv.get("remote_num_tokens", 0) if EXPECT_KEY in kv else 0
        params.update({PULLED_KEY: offered, LOCAL_KEY: 0, **({CHECKED_KEY: offered} if offered else {})})
        return params

    def d_params(request: web.Request, kv: dict, n: int, ids: list[int]) -> dict:
        """D's handles, and its sequence when asked, as pdserve's entry adds it."""
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "d",
                  "remote_request_id": request.headers.get("X-Request-Id", "d"),
                  "remote_block_ids": [list(range(0, n // 16))], "remote_host": "127.0.0.1", "remote_port": 2,
                  "remote_num_tokens": n + REPLY_TOKENS}
        if kv.get(WANT_TOKENS_KEY):
            params[TOKENS_KEY] = ids + [7 + i for i in range(REPLY_TOKENS)]
        return params

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        n = count(body)
        ids = list(range(1000, 1000 + n))
        if kv.get("do_remote_decode"):
            return web.json_response({"id": "p", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": n, "completion_tokens": 1},
                "kv_transfer_params": p_params(request, kv, n, ids)},
                dumps=lambda o: json.dumps(o, separators=(",", ":")))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        want = bool(body.get("return_token_ids"))
        await out.write(sse({"id": "d", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            **({"prompt_token_ids": ids} if want else {})}))
        for i in range(REPLY_TOKENS):
            await out.write(sse({"id": "d", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": f" r{i}"}, "finish_reason": None,
                 **({"token_ids": [7 + i]} if want else {})}]}))
        await out.write(sse({"id": "d", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {}, "finish_reason": "length"}], "kv_transfer_params": d_params(request, kv, n, ids)}))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def messages(request: web.Request) -> web.StreamResponse:
        """Anthropic Messages as vLLM serves them; D's handles and, when asked (pdserve_return_token_ids), its
        sequence on message_stop, as pdserve's entry puts them there."""
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        n = count(body)
        ids = list(range(1000, 1000 + n))
        if kv.get("do_remote_decode"):
            return web.json_response({"id": "msg_p", "type": "message", "role": "assistant", "model": "m",
                                      "content": [{"type": "text", "text": "x"}], "stop_reason": "max_tokens",
                                      "usage": {"input_tokens": n, "output_tokens": 1},
                                      "kv_transfer_params": p_params(request, kv, n, ids)},
                                     dumps=lambda o: json.dumps(o, separators=(",", ":")))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(sse({"type": "message_start", "message": {
            "id": "msg_d", "type": "message", "role": "assistant", "content": [], "model": "m", "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": n, "output_tokens": 0}}}, "message_start"))
        await out.write(sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                            "content_block_start"))
        for i in range(REPLY_TOKENS):
            await out.write(sse({"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": f" r{i}"}}, "content_block_delta"))
        params = d_params(request, kv, n, ids)
        await out.write(sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                        + sse({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                               "usage": {"input_tokens": n, "output_tokens": REPLY_TOKENS}}, "message_delta")
                        + sse({"type": "message_stop", "kv_transfer_params": params}, "message_stop"))
        await out.write_eof()
        return out

    app = fake_vllm_app(256 * 1024 * 1024)
    app.router.add_post(PATHS["chat"], chat)
    app.router.add_post(PATHS["messages"], messages)
    serve_on_two_ports(app, port)


# ---------------------------------------------------------------------------------------------------------

async def first_chunk(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, str, str]:
    """(seconds to the first content chunk, the reply's text, Server-Timing)."""
    t0 = time.perf_counter()
    ttft, reply = None, []
    async with session.post(url, data=orjson.dumps(body), headers=JSON) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        timing = f'{r.headers.get("Server-Timing", "")}; reuse {r.headers.get("X-PDServe-Reuse", "-")}'
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            pieces = [c.get("delta", {}).get("content") for c in event.get("choices", [])] + \
                [(event.get("delta") or {}).get("text")] * (event.get("type") == "content_block_delta")
            for content in pieces:
                if content:
                    ttft = ttft or time.perf_counter() - t0
                    reply.append(content)
    return ttft or float("nan"), "".join(reply), timing


async def direct(session: aiohttp.ClientSession, p_url: str, d_url: str, body: dict, api: str) -> float:
    """Both legs by this script (orjson, as the router): P's (its prompt ids asked), then D's stream with P's
    params and ids. No reuse decision, no history digest, no store: what any two-leg proxy must do at least."""
    t0 = time.perf_counter()
    async with session.post(p_url + PATHS[api], headers=JSON, data=orjson.dumps({
            **body, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   WANT_PROMPT_IDS_KEY: True}})) as r:
        params = orjson.loads(await r.read())["kv_transfer_params"]
    p_leg = time.perf_counter() - t0
    # D's sequence asked in the params (the entry's patch), as the router asks on every format but completions
    took, _, _ = await first_chunk(session, d_url + PATHS[api], {**body, "kv_transfer_params": {
        **params, WANT_TOKENS_KEY: True}})
    return p_leg + took


async def measure(args) -> dict:
    os.sched_setaffinity(0, load_core())
    port = free_port_pair()
    fakes = spawn([sys.executable, str(Path(__file__).resolve()), "--serve-fakes", str(port)], load_core())
    p_url, d_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    url, router, cfg = start_arm("pdserve", p_url, d_url, {}, [])
    rows: dict[str, list] = {"router": [], "direct": [], "cpu_ms": [], "timing": []}
    try:
        await wait_up(p_url)
        await wait_up(url)
        await asyncio.sleep(2.5)               # the first health probe marks the servers healthy
        proc = psutil.Process(router.pid)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for turn in range(args.turns + 1):      # the first pair unrecorded: connections and caches warm
                first = {"model": "m", "messages": history(args.tokens, args.messages, turn), "max_tokens": 32,
                         "stream": True}
                _, reply, _ = await first_chunk(session, url + PATHS[args.api], first)
                second = {**first, "messages": first["messages"] + [
                    {"role": "assistant", "content": reply}, {"role": "user", "content": text(1000, -turn - 1)}]}
                cpu0 = sum(proc.cpu_times()[:2])
                took, _, timing = await first_chunk(session, url + PATHS[args.api], second)
                cpu = sum(proc.cpu_times()[:2]) - cpu0
                alone = await direct(session, p_url, d_url, second, args.api)
                if turn:
                    rows["router"].append(1000 * took)
                    rows["direct"].append(1000 * alone)
                    rows["cpu_ms"].append(1000 * cpu)
                    rows["timing"].append(timing)
    finally:
        router.terminate()
        router.wait(10)
        os.unlink(cfg)
        fakes.terminate()
        fakes.wait(10)
    reused = sum("reuse hit" in t for t in rows["timing"])
    body_kb = len(json.dumps(second)) / 1024
    print(f"{args.api}: turn 2 of ~{count(second)} tokens ({body_kb:.0f} KB body), {args.turns} turns, one at a "
          f"time:")
    print(f"  TTFT p50: router {statistics.median(rows['router']):.1f} ms, direct "
          f"{statistics.median(rows['direct']):.1f} ms; router added (median of pairs) "
          f"{statistics.median(r - d for r, d in zip(rows['router'], rows['direct'])):.1f} ms; router CPU a turn 2 "
          f"{statistics.mean(rows['cpu_ms']):.1f} ms (mean: the clock counts 10 ms ticks)")
    print(f"  turns the router offered D's blocks for: {reused} of {len(rows['timing'])}; the last one's "
          f"Server-Timing: {rows['timing'][-1]}")
    return {"tokens": count(second), "body_kb": body_kb, **rows, "offered": reused}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-fakes":
        serve_fakes(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=36864, help="turn 1's history, tokens")
    ap.add_argument("--messages", type=int, default=40, help="messages in turn 1's history")
    ap.add_argument("--turns", type=int, default=20, help="conversations measured (turn 2 of each)")
    ap.add_argument("--api", choices=sorted(PATHS), default="chat", help="chat completions or Anthropic Messages")
    ap.add_argument("--json", action="store_true", help="print every figure as JSON at the end")
    args = ap.parse_args()
    out = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
