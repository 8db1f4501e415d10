#!/usr/bin/env python3
"""Issue 35 item 8: does a well-behaved client keep being served while another floods? The real router
(max_in_flight 8, queue 32, queue_timeout 2 s, tenant_max_in_flight 16) against fake P and D servers that
answer in --delay seconds; a flooder at 127.0.0.2 keeps --flooders requests in flight, and the good client at
127.0.0.1 sends --good requests one after another. Arms: `rotating` (no API key: the flooder sends a new
Authorization with every request, each a new tenant) and `one-key` (router.api_key_env set: everyone sends
the one key, so everyone is one tenant); each without and with the per-address cap (client_max_in_flight).

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/rotating_flood.py [--good 50] [--flooders 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os

import aiohttp

from hostile_kit import fake, router, scrape

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEY_ENV, KEY = "PDSERVE_FLOOD_TEST_KEY", "sk-the-one-key"


async def scenario(url: str, good: int, flooders: int, rotating: bool) -> tuple[collections.Counter, collections.Counter]:
    stop = asyncio.Event()
    flood: collections.Counter = collections.Counter()
    served: collections.Counter = collections.Counter()

    async def flooder(session: aiohttp.ClientSession, k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            auth = f"Bearer flood-{k}-{n}" if rotating else f"Bearer {KEY}"
            try:
                async with session.post(url + CHAT, json=BODY, headers={"Authorization": auth}) as resp:
                    await resp.read()
                    flood[resp.status] += 1
            except aiohttp.ClientError:
                flood["error"] += 1

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=0),
                                     timeout=timeout) as bad, aiohttp.ClientSession(timeout=timeout) as client:
        tasks = [asyncio.create_task(flooder(bad, k)) for k in range(flooders)]
        await asyncio.sleep(1.0)                       # the flood is on
        auth = {"Authorization": f"Bearer {KEY if not rotating else 'good-client'}"}
        for _ in range(good):
            async with client.post(url + CHAT, json=BODY, headers=auth) as resp:
                await resp.read()
                served[resp.status] += 1
        stop.set()
        await asyncio.gather(*tasks)
    return served, flood


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--good", type=int, default=50)
    ap.add_argument("--flooders", type=int, default=64)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--client-cap", type=int, default=4, help="client_max_in_flight of the capped arms")
    ap.add_argument("--arms", nargs="+", default=["rotating", "one-key"], choices=["rotating", "one-key"])
    ap.add_argument("--caps", nargs="+", type=int, help="client_max_in_flight values to run (default 0 and --client-cap)")
    args = ap.parse_args()
    os.environ[KEY_ENV] = KEY
    limits = {"max_in_flight": 8, "queue_size": 32, "queue_timeout": 2.0, "tenant_max_in_flight": 16}
    for arm in args.arms:
        for cap in args.caps or [0, args.client_cap]:
            settings = dict(limits, **({"client_max_in_flight": cap} if cap else {}))
            if arm == "one-key":
                settings["api_key_env"] = KEY_ENV
            with fake("--delay", str(args.delay)) as p, fake("--delay", str(args.delay)) as d, \
                    router([p], [d], decode_only=False, **settings) as (_, url):
                served, flood = asyncio.run(scenario(url, args.good, args.flooders, arm == "rotating"))
                outcomes = {dict(labels)["outcome"]: int(v) for (name, labels), v in
                            (scrape(url, api_key=KEY if arm == "one-key" else None) or {}).items()
                            if name == "pdserve_router_admission_total"}
            print(f"{arm}, client_max_in_flight {cap}: good client {served[200]} of {args.good} served "
                  f"({dict(served)}); flooder {dict(flood)}; admission {outcomes}")


if __name__ == "__main__":
    main()
