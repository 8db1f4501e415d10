#!/usr/bin/env python3
"""Issue 35 item 11: what does SIGTERM of one router replica cost the clients? Two router processes share one
port (SO_REUSEPORT, as `router.replicas: 2` runs them) in front of fake P and D; --clients clients each send
requests one after another on one kept-alive connection for --seconds; --kill-at seconds in, replica 0 gets
SIGTERM (as `pdserve down` or a supervisor restart sends it) and drains. Counted: requests answered, and
requests that failed (the connection closed under them, or no connection).

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/replica_sigterm.py [--clients 32] [--seconds 6] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import signal
import time

import aiohttp

from hostile_kit import fake, free_port, router

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def load(url: str, clients: int, seconds: float, kill_at: float, victim) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    end = time.monotonic() + seconds

    async def client() -> None:
        connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
            while time.monotonic() < end:
                try:
                    async with s.post(url + CHAT, json=BODY) as resp:
                        await resp.read()
                        counts["ok" if resp.status == 200 else f"http_{resp.status}"] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    counts[f"failed ({type(err).__name__})"] += 1

    async def kill() -> None:
        await asyncio.sleep(kill_at)
        victim.send_signal(signal.SIGTERM)

    await asyncio.gather(kill(), *(client() for _ in range(clients)))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--kill-at", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for run in range(args.runs):
        port = free_port()
        with contextlib.ExitStack() as stack:
            p = stack.enter_context(fake("--delay", "0.005"))
            d = stack.enter_context(fake("--delay", "0.005"))
            replicas = [stack.enter_context(router([p], [d], port=port, replicas=2, args=(
                "--replica", f"router-{i}", "--own-port", str(free_port())))) for i in range(2)]
            counts = asyncio.run(load(replicas[0][1], args.clients, args.seconds, args.kill_at, replicas[0][0]))
        failed = sum(v for k, v in counts.items() if k != "ok")
        total = sum(counts.values())
        print(f"run {run}: {total} requests, {failed} failed ({100 * failed / max(1, total):.2f}%): {dict(counts)}")


if __name__ == "__main__":
    main()
