#!/usr/bin/env python3
"""What a stalled Redis costs each request (issue 35, items 2 and 3): the router process (`python -m
pdserve.router`) against benchmarks/router/bench_store.py's fast fake backend with a Redis store, 64 clients each running
a conversation (one take and one put per turn), and the longest wait of any request while Redis misbehaves:

- sigstop: Debian's redis-server, SIGSTOPped for --stall seconds mid-run, then SIGCONT;
- silent: router.store is a listener that accepts connections and never answers (from the start);
- big-puts (the store alone, no router): 40 puts of 800 KB, one every 25 ms, to a SIGSTOPped Redis: how
  long each put's caller waited, and how many were still pending after --stall seconds.

Printed per scenario: the requests in flight at any time during the fault, failed ones, their max / p99 / p50
wait, how many waited over store_timeout + 0.5 s, and the longest wait of a request done before the fault (the
box's own latency at 64 clients). The router runs on core 0; backend, Redis and the clients share core 1.

Usage: .venv/bin/python benchmarks/scenarios/store_faults.py [--clients 64] [--stall 6] [--timeout 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))   # bench_router, bench_store
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_router import PROXY_CORE, free_port, load_core, pct, spawn, wait_up  # noqa: E402

HERE = Path(__file__).resolve()


def redis_server(port: int, data: str) -> subprocess.Popen:
    return spawn([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                  "--dir", data, "--save", "", "--appendonly", "no", "--maxmemory", "256mb",
                  "--maxmemory-policy", "volatile-ttl"], load_core())


async def silent_listener() -> tuple[asyncio.AbstractServer, int]:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def clients(url: str, n: int, until: float, waits: list[tuple[float, float, int]]) -> None:
    """n clients, each a conversation: (started, seconds, status) per request."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> None:
            history: list = []
            while time.monotonic() < until:
                body = {"model": "m", "messages": history[-6:] + [{"role": "user", "content": f"turn of {i}"}],
                        "max_tokens": 8, "conversation_id": f"client-{i}"}
                started = time.monotonic()
                try:
                    async with session.post(url + "/v1/chat/completions", json=body) as r:
                        status = r.status
                        data = await r.json(content_type=None)
                except aiohttp.ClientError:
                    status, data = 0, {}
                waits.append((started, time.monotonic() - started, status))
                if status == 200:
                    history = body["messages"] + [data["choices"][0]["message"]]
        await asyncio.gather(*(one(i) for i in range(n)))


def summary(name: str, waits: list[tuple[float, float, int]], fault: tuple[float, float], bound: float) -> dict:
    during = [w for w in waits if w[0] < fault[1] and w[0] + w[1] > fault[0]]     # in flight during the fault
    before = [w for w in waits if w[0] + w[1] <= fault[0]]
    secs = [w[1] for w in during]
    row = {"scenario": name, "requests": len(during), "failed": sum(w[2] != 200 for w in during),
           "max_s": max(secs, default=0.0), "p99_s": pct(secs, 99) if secs else 0.0,
           "p50_s": pct(secs, 50) if secs else 0.0, "over_bound": sum(s > bound for s in secs),
           "max_before_s": max((w[1] for w in before), default=0.0)}
    print(f"{name:8s} {row['requests']:6d} requests in the fault, {row['failed']} failed; wait max "
          f"{row['max_s']:.3f} s, p99 {row['p99_s']:.3f} s, p50 {row['p50_s']:.3f} s; over {bound:g} s: "
          f"{row['over_bound']}; max before the fault {row['max_before_s']:.3f} s", flush=True)
    return row


async def through_router(store: str, backend_url: str, args, fault) -> list[tuple[float, float, int]]:
    """Run the clients against a router on `store`; `fault(start, end)` is awaited alongside (the stall)."""
    port = free_port()
    cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"prefill": [{"name": "prefill-0", "url": backend_url}], "decode": [{"name": "decode-0",
               "url": backend_url}], "model": "m", "port": port, "store": store, "cluster": "faults",
               "store_timeout": args.timeout}, cfg)
    cfg.close()
    router = spawn([sys.executable, "-m", "pdserve.router", "--config", cfg.name], PROXY_CORE,
                   env={"PYTHONPATH": str(HERE.parents[2])})
    waits: list[tuple[float, float, int]] = []
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_up(url)
        await asyncio.sleep(2.5)                       # the first health probe marks the backend healthy
        start = time.monotonic()
        await asyncio.gather(clients(url, args.clients, start + args.warm + args.stall + args.after, waits),
                             fault(start + args.warm, start + args.warm + args.stall))
    finally:
        router.terminate()
        router.wait(10)
        os.unlink(cfg.name)
    return waits


async def big_puts(redis_port: int, redis_proc: subprocess.Popen, args) -> None:
    from pdserve.router.kv.store import open_store
    from tests.kits.redis_rig import PARAMS
    store = open_store(f"redis://127.0.0.1:{redis_port}/0", ttl=30, max_entries=100,
                       max_bytes=2**30, cluster="faults", decodes=["decode-0"], timeout=args.timeout,
                       on_evict=lambda r, n: None, on_error=lambda op, why: None, on_health=lambda up: None)
    loop = asyncio.get_running_loop()
    big = list(range(200_000))
    await (await store.put(("t", "warm"), PARAMS, "decode-0", 0, [1]))
    waits: list[float] = []

    async def put(i: int) -> None:
        await asyncio.sleep(0.025 * i)
        started = loop.time()
        await (await store.put(("t", f"big{i}"), PARAMS, "decode-0", 0, big))
        waits.append(loop.time() - started)

    os.kill(redis_proc.pid, signal.SIGSTOP)
    try:
        tasks = [asyncio.create_task(put(i)) for i in range(40)]
        await asyncio.wait(tasks, timeout=args.stall)
        pending = sum(not t.done() for t in tasks)
    finally:
        os.kill(redis_proc.pid, signal.SIGCONT)
    await asyncio.wait(tasks, timeout=30)
    print(f"big-puts 40 puts of 800 KB to a paused Redis: {pending} pending after {args.stall:g} s; wait max "
          f"{max(waits, default=0):.3f} s, p50 {pct(waits, 50) if waits else 0:.3f} s", flush=True)
    await asyncio.wait_for(store.close(), 10)


async def main_async(args) -> None:
    os.sched_setaffinity(0, load_core())
    backend_port, redis_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    data = tempfile.mkdtemp(prefix="store-faults-")
    backend = spawn([sys.executable, str(HERE.parents[1] / "router" / "bench_store.py"), "--serve-backend", str(backend_port)],
                    load_core())
    redis = redis_server(redis_port, data)
    bound = args.timeout + 0.5
    try:
        await wait_up(backend_url)
        time.sleep(0.5)

        async def sigstop(start: float, end: float) -> None:
            await asyncio.sleep(start - time.monotonic())
            os.kill(redis.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(end - time.monotonic())
            finally:
                os.kill(redis.pid, signal.SIGCONT)

        if "sigstop" in args.scenarios:
            waits = await through_router(f"redis://127.0.0.1:{redis_port}/0", backend_url, args, sigstop)
            first = min(w[0] for w in waits)
            summary("sigstop", waits, (first + args.warm, first + args.warm + args.stall), bound)
        if "silent" in args.scenarios:
            server, port = await silent_listener()

            async def nothing(start: float, end: float) -> None:
                pass
            waits = await through_router(f"redis://127.0.0.1:{port}/0", backend_url, args, nothing)
            server.close()
            summary("silent", waits, (0.0, float("inf")), bound)
        if "big-puts" in args.scenarios:
            await big_puts(redis_port, redis, args)
    finally:
        for p in (backend, redis):
            p.terminate()
            p.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--stall", type=float, default=6.0, help="seconds Redis stays SIGSTOPped")
    ap.add_argument("--warm", type=float, default=2.0, help="seconds of load before the stall")
    ap.add_argument("--after", type=float, default=2.0, help="seconds of load after it")
    ap.add_argument("--timeout", type=float, default=0.25, help="router.store_timeout")
    ap.add_argument("--scenarios", nargs="+", default=["sigstop", "silent", "big-puts"],
                    choices=["sigstop", "silent", "big-puts"])
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
