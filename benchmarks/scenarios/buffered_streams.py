#!/usr/bin/env python3
"""Issue 45 item 4: what do concurrent long streams cost the router in all? The real router (a process of its
own: resident memory read from /proc) against fake servers whose D streams valid events without end
(tests/kits/hostile.py's --endless-events); N clients read their streams for --seconds at once. Each stream
keeps up to router.max_answer_mb (32 MiB) of lines and token ids for the next turn; router.max_buffered_mb
bounds their sum. Prints, per arm (a max_buffered_mb value), the router's peak resident memory and the most
pdserve_router_buffered_bytes seen (sampled every 0.2 s), then whether a new request is served or refused.

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/buffered_streams.py [--arms 100000 256 64]
       [--max-answer-mb 4] (a smaller bound per stream: the sum past max_buffered_mb in seconds on a slow box)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time

import aiohttp

from hostile_kit import fake, peak_rss_mb, router, rss_mb

CHAT = "/v1/chat/completions"


def body(i: int, stream: bool) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant",
            "content": "hi"}, {"role": "user", "content": "more"}], "max_tokens": 3, "stream": stream}


async def read_for(session: aiohttp.ClientSession, url: str, i: int, seconds: float) -> int:
    got = 0
    async with session.post(url + CHAT, json=body(i, True)) as resp:
        end = time.monotonic() + seconds
        async for chunk in resp.content.iter_any():
            got += len(chunk)
            if time.monotonic() > end:
                break
    return got


async def buffered(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as resp:
        m = re.search(r"^pdserve_router_buffered_bytes (\S+)$", await resp.text(), re.M)
        return float(m.group(1)) if m else 0.0


async def run(url: str, streams: int, seconds: float) -> tuple[list[int], float, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(read_for(session, url, i, seconds)) for i in range(streams)]
        most = 0.0
        while not all(t.done() for t in tasks):
            most = max(most, await buffered(session, url))
            await asyncio.sleep(0.2)
        got = [t.result() for t in tasks]
    async with aiohttp.ClientSession() as session, session.post(url + CHAT, json=body(99, False)) as resp:
        return got, most, resp.status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", type=float, default=[100000, 256, 64], help="max_buffered_mb values")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--max-answer-mb", type=float, default=32.0, help="router.max_answer_mb: one stream's bound")
    args = ap.parse_args()
    for mb in args.arms:
        with fake() as p, fake("--endless-events") as d, router([p], [d], decode_only=False,
                                                                 max_buffered_mb=mb, max_answer_mb=args.max_answer_mb) as (proc, url):
            before = rss_mb(proc.pid)
            got, most, status = asyncio.run(run(url, args.streams, args.seconds))
            print(f"max_buffered_mb {mb:g}: {args.streams} streams read {sum(got) / 2**20:.0f} MiB in all; router "
                  f"RSS {before:.0f} MiB at start, peak {peak_rss_mb(proc.pid):.0f} MiB; most buffered "
                  f"{most / 2**20:.0f} MiB; a request after: {status}")


if __name__ == "__main__":
    main()
