#!/usr/bin/env python3
"""Issue 35 item 1: does admission lose slots when queued clients leave? The real router with max_in_flight 4
and a queue of 200, against fake P and D servers that answer after --delay seconds; waves of 150 concurrent
requests, half of whose clients hang up while queued (at a random moment within --leave-within seconds, so
some leave just as a slot frees). Afterwards nothing is in flight, so every slot the router still counts
(pdserve_router_admission_in_flight) is lost; a probe then sends max_in_flight slow requests at once and
counts how many were admitted without queueing. Also counted: answers other than 200 among the clients
that stayed (a 500 is the InvalidStateError of the issue).

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/churn_admission.py [--requests 18000] [--wave 150]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time

import aiohttp

from hostile_kit import fake, router, scrape, total

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def one(session: aiohttp.ClientSession, url: str, leave_after: float | None, statuses: collections.Counter) -> None:
    async def ask():
        async with session.post(url + CHAT, json=BODY) as resp:
            await resp.read()
            statuses[resp.status] += 1

    if leave_after is None:
        await ask()
        return
    try:
        await asyncio.wait_for(ask(), leave_after)
    except asyncio.TimeoutError:
        statuses["left"] += 1


async def churn(url: str, requests: int, wave: int, leave_within: float, max_in_flight: int, seed: int) -> dict:
    rng = random.Random(seed)
    statuses: collections.Counter = collections.Counter()
    # One connection per request: a client that leaves closes its own, which cancels its handler.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        sent = 0
        while sent < requests:
            n = min(wave, requests - sent)
            await asyncio.gather(*(one(session, url, rng.random() * leave_within if i % 2 else None, statuses)
                                   for i in range(n)))
            sent += n
        await asyncio.sleep(0.5)
        samples = scrape(url)
        gauge = any(name == "pdserve_router_admission_in_flight" for name, _ in samples)
        lost = total(samples, "pdserve_router_admission_in_flight") if gauge else None   # None: a router without it
        queued = total(samples, "pdserve_router_admission_queue_depth")
        admitted_before = total(samples, "pdserve_router_admission_total", outcome="admitted")
        # The probe: max_in_flight requests at once, none should wait.
        probe: collections.Counter = collections.Counter()
        await asyncio.gather(*(one(session, url, None, probe) for _ in range(max_in_flight)))
        admitted = total(scrape(url), "pdserve_router_admission_total", outcome="admitted") - admitted_before
    return {"requests": requests, "seconds": round(time.monotonic() - started, 1), "statuses": dict(statuses),
            "slots_lost": "n/a (no gauge)" if lost is None else int(lost), "queue_depth_after": int(queued),
            "probe_admitted_at_once": f"{int(admitted)} of {max_in_flight} (the others lost)",
            "admission_outcomes": {dict(labels)["outcome"]: int(value) for (name, labels), value in samples.items()
                                   if name == "pdserve_router_admission_total"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=18_000)
    ap.add_argument("--wave", type=int, default=150)
    ap.add_argument("--max-in-flight", type=int, default=4)
    ap.add_argument("--queue", type=int, default=200)
    ap.add_argument("--delay", type=float, default=0.002, help="the fake servers' seconds per answer")
    ap.add_argument("--leave-within", type=float, default=0.3, help="a leaving client hangs up within this")
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--log", help="the router's log file")
    args = ap.parse_args()
    with fake("--delay", str(args.delay)) as p, fake("--delay", str(args.delay)) as d, \
            router([p], [d], log=args.log, max_in_flight=args.max_in_flight, queue_size=args.queue,
                   queue_timeout=30.0, decode_only=False) as (_, url):
        result = asyncio.run(churn(url, args.requests, args.wave, args.leave_within, args.max_in_flight, args.seed))
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
