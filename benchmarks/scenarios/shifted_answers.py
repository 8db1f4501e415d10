#!/usr/bin/env python3
"""Issue 35 item 4: does a pooled backend connection ever hand one request another's answer? The real router
against fake P and D servers that send interim answers (100 Continue, 103 Early Hints) before every answer and/or,
after every whole answer, the previous answer once more, unsolicited (tests/kits/hostile.py); each client
message carries a nonce that D echoes at the start of its reply, and D's reply says MISMATCH when the P handles
it was given were made for another prompt. Counted: answers that are another request's (a wrong nonce, or P
handles of another), failed requests, and requests served.

Arms (--arms): `interim` (the 1xx answers alone), `stray` (the unsolicited answer alone, right after the real
one), `glued` (both), `late` (1xx, and the stray answer 1 ms after the real one: under load the connection may
already carry the next request); the backends echo X-Request-Id as vLLM does with --enable-request-id-headers
(which pdserve's entry gives them). `glued-no-ids` and `late-no-ids`: the same from backends that do not.

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/shifted_answers.py [--requests 3000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import aiohttp

from hostile_kit import fake, router

CHAT = "/v1/chat/completions"
STRAY = ["--stray-answer", "--stray-delay"]
IDS = "--request-id-headers"     # as vLLM run by pdserve's entry answers (--enable-request-id-headers)
ARMS = {"interim": ["--interim", IDS], "stray": [*STRAY, "0", IDS], "glued": ["--interim", *STRAY, "0", IDS],
        "late": ["--interim", *STRAY, "0.001", IDS],
        "glued-no-ids": ["--interim", *STRAY, "0"], "late-no-ids": ["--interim", *STRAY, "0.001"]}


async def load(url: str, requests: int, concurrency: int) -> dict:
    counts: collections.Counter = collections.Counter()
    queue = iter(range(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for i in queue:
            nonce = f"n{i}x"
            body = {"model": "fake", "messages": [{"role": "user", "content": nonce}], "max_tokens": 2}
            try:
                async with session.post(url + CHAT, json=body) as resp:
                    data = await resp.json(content_type=None)
            except (aiohttp.ClientError, ValueError):
                counts["failed"] += 1
                continue
            if resp.status != 200:
                counts[f"http_{resp.status}"] += 1
                continue
            first = data["choices"][0]["message"]["content"].split("|")[0]
            if first.startswith("MISMATCH"):
                counts["another_requests_P_handles"] += 1
            elif first != nonce:
                counts["another_requests_answer"] += 1
            else:
                counts["own_answer"] += 1

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return {"seconds": round(time.monotonic() - started, 1), **counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--log", help="the router's log file")
    args = ap.parse_args()
    for arm in args.arms:
        manners = ["--echo", *ARMS[arm]]
        with fake(*manners) as p, fake(*manners) as d, \
                router([p], [d], log=args.log, decode_only=False, bidirectional_kv_xfer=False) as (_, url):
            result = asyncio.run(load(url, args.requests, args.concurrency))
        wrong = result.get("another_requests_answer", 0) + result.get("another_requests_P_handles", 0)
        print(f"{arm}: {args.requests} requests, {wrong} answered with another request's answer or P handles; "
              + ", ".join(f"{k} {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
