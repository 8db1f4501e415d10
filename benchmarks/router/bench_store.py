#!/usr/bin/env python3
"""What the reuse store costs per request: the router (`python -m pdserve.router`) against a fast fake
backend, with `router.store: memory` and with a Redis store (Debian's redis-server, started here on a free
loopback port), same load, side by side.

Unlike benchmarks/router/bench_router.py's requests, every request here is a conversation turn that uses the store:
it carries a conversation id (one per client), so the router takes the conversation's entry (one Redis round
trip), and D answers with block handles, so the router stores the new one (another). Measured per store:
p50/p99 at 1 client and requests per second at 64 clients, JSON and streamed (128 tokens), and the router's
CPU seconds per 1000 requests. The router runs alone on core 0; the backend, Redis and the load generator
share core 1 (bench_router.py's split).

Usage: .venv/bin/python benchmarks/router/bench_store.py [--duration 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router import PROXY_CORE, free_port, load_core, pct, spawn, wait_up  # noqa: E402
from bench_router_backends import TOKENS  # noqa: E402

D_PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "e-d",
            "remote_request_id": "r", "remote_block_ids": [list(range(64))], "remote_host": "127.0.0.1",
            "remote_port": 1, "remote_num_tokens": 8}   # below the threshold: the turn needs no /tokenize


def run_backend(port: int) -> None:
    from aiohttp import web

    p_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e-p",
                "remote_request_id": "r", "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1",
                "remote_port": 1}
    chunk = b'data: {"id":"d","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
    last = ('data: {"id":"d","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},'
            '"finish_reason":"length"}],"kv_transfer_params":' + json.dumps(D_PARAMS) + '}\n\n').encode()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return web.json_response({"id": "p", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1}, "kv_transfer_params": p_params})
        if not body.get("stream"):
            return web.json_response({"id": "d", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "tok " * TOKENS}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": TOKENS}, "kv_transfer_params": D_PARAMS})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(TOKENS):
            await out.write(chunk)
        await out.write(last)      # the final chunk with D's handles (vLLM 0.33's shape)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def load(target: str, clients: int, stream: bool, duration: float) -> list[float]:
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(n: int, deadline: float, record: bool) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS,
                    "stream": stream, "conversation_id": f"client-{n}-{stream}"}
            while time.monotonic() < deadline:
                t = time.perf_counter()
                async with session.post(target + "/v1/chat/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                    await r.read()
                if record:
                    latencies.append(time.perf_counter() - t)
        await asyncio.gather(*(worker(i, time.monotonic() + 0.5, False) for i in range(clients)))
        await asyncio.gather(*(worker(i, time.monotonic() + duration, True) for i in range(clients)))
    return latencies


async def one_store(store: str, backend_url: str, args) -> list[dict]:
    port = free_port()
    cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"prefill": [{"name": "prefill-0", "url": backend_url}], "decode": [{"name": "decode-0", "url": backend_url}],
               "model": "m", "port": port, "store": store, "cluster": "bench"}, cfg)
    cfg.close()
    router = spawn([sys.executable, "-m", "pdserve.router", "--config", cfg.name], PROXY_CORE)
    rows = []
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_up(url)
        await asyncio.sleep(2.5)    # the first health probe marks the backend healthy
        proc = psutil.Process(router.pid)
        for stream in (False, True):
            for clients in (1, 64):
                cpu0 = sum(proc.cpu_times()[:2])
                lat = await load(url, clients, stream, args.duration)
                cpu = sum(proc.cpu_times()[:2]) - cpu0
                rows.append({"store": store.split(":")[0], "stream": stream, "clients": clients, "requests": len(lat),
                             "rps": len(lat) / args.duration, "p50_ms": 1000 * pct(lat, 50),
                             "p99_ms": 1000 * pct(lat, 99), "cpu_s_per_1000": 1000 * cpu / max(1, len(lat))})
                r = rows[-1]
                print(f"  {r['store']:6s} stream={str(stream):5s} clients={clients:2d}: {r['rps']:6.0f} req/s  "
                      f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
                      f"router CPU {r['cpu_s_per_1000']:.2f} s/1000 req", file=sys.stderr)
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as resp:
                text = await resp.text()
        outcomes = [line for line in text.splitlines() if line.startswith(("pdserve_router_turns_total",
                                                                             "pdserve_router_store_errors_total"))]
        print("   " + "; ".join(outcomes), file=sys.stderr)
    finally:
        router.terminate()
        router.wait(10)
        os.unlink(cfg.name)
    return rows


async def main_async(args) -> list[dict]:
    os.sched_setaffinity(0, load_core())
    backend_port, redis_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    data = tempfile.mkdtemp(prefix="bench-store-redis-")
    procs = [spawn([sys.executable, str(Path(__file__).resolve()), "--serve-backend", str(backend_port)], load_core()),
             spawn([shutil.which("redis-server") or "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                    "--dir", data, "--save", "", "--appendonly", "no", "--maxmemory", "256mb",
                    "--maxmemory-policy", "volatile-ttl"], load_core())]
    rows: list[dict] = []
    try:
        await wait_up(backend_url)
        for _ in range(args.rounds):
            for store in ("memory", f"redis://127.0.0.1:{redis_port}/0"):
                rows += await one_store(store, backend_url, args)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        shutil.rmtree(data, ignore_errors=True)
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-backend":
        return run_backend(int(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds measured per scenario")
    ap.add_argument("--rounds", type=int, default=2, help="memory/redis pairs, alternated")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    print(f"{'store':7s} {'stream':7s} {'p50@1 ms':>9s} {'p99@1 ms':>9s} {'rps@64':>7s} {'CPU s/1000 req @64':>19s}")
    for r1 in (r for r in rows if r["clients"] == 1):
        r64 = next(r for r in rows if r["clients"] == 64 and r["stream"] == r1["stream"] and r["store"] == r1["store"]
                   and rows.index(r) > rows.index(r1))
        print(f"{r1['store']:7s} {str(r1['stream']):7s} {r1['p50_ms']:9.2f} {r1['p99_ms']:9.2f} {r64['rps']:7.0f} "
              f"{r64['cpu_s_per_1000']:19.2f}")


if __name__ == "__main__":
    main()
