#!/usr/bin/env python3
"""Issue 35 item 7: what does a backend's unbounded answer cost the router? The real router (a process of its
own: its resident memory is read from /proc) against fake servers that answer with (tests/kits/hostile.py):

- endless-json: a JSON body that never ends (P and D alike, so that no role serves it whole instead);
- endless-line: for a stream, one SSE line that never ends (D);
- endless-events: a stream of valid events that never ends, read by the client for --seconds (D);
- huge-json: a valid 1 GiB JSON answer (P and D);
- token-ids: 4 concurrent answers with 2M prompt token ids each (~12 MB bodies; D), turns remembered.

For each: the answers' statuses and times, the router's peak resident memory (VmHWM) and the slowest /health
answer meanwhile (sampled every 20 ms: how long the router's event loop was stalled).

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/endless_answer.py [--arms ...] [--max-answer-mb 32]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import urllib.request

import aiohttp

from hostile_kit import fake, peak_rss_mb, router, rss_mb

CHAT = "/v1/chat/completions"
ARMS = ("endless-json", "endless-line", "endless-events", "huge-json", "token-ids")


def body(i: int = 0, stream: bool = False) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 3,
            "stream": stream}


class HealthWatch(threading.Thread):
    """/health every 20 ms from a thread of its own (the load's event loop busy reading must not count)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.slowest, self.stop = url, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            with urllib.request.urlopen(self.url + "/health", timeout=60) as resp:
                resp.read()
            self.slowest = max(self.slowest, time.monotonic() - t)
            time.sleep(0.02)


async def ask(session: aiohttp.ClientSession, url: str, payload: dict, read_for: float | None) -> str:
    started = time.monotonic()
    try:
        async with session.post(url + CHAT, json=payload) as resp:
            if read_for is not None:           # a client reading a stream for a while, then hanging up
                end = time.monotonic() + read_for
                async for _ in resp.content.iter_any():
                    if time.monotonic() > end:
                        break
                return f"{resp.status} read {read_for:g}s"
            data = await resp.read()
            tail = data[-160:].decode(errors="replace").replace("\n", " ") if resp.status != 200 or payload.get(
                "stream") else ""
            return f"{resp.status} in {time.monotonic() - started:.2f}s {tail}".strip()
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return f"{type(err).__name__} after {time.monotonic() - started:.1f}s"


async def run_arm(arm: str, url: str, seconds: float) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        if arm == "endless-json" or arm == "huge-json":
            return [await ask(session, url, body(i), None) for i in range(3)]
        if arm == "endless-line":
            return [await ask(session, url, body(i, stream=True), None) for i in range(3)]
        if arm == "endless-events":
            return [await ask(session, url, body(0, stream=True), seconds)]
        return list(await asyncio.gather(*(ask(session, url, body(i), None) for i in range(4))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--max-answer-mb", type=float, help="router.max_answer_mb (default: the router's)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long endless-events is read")
    ap.add_argument("--request-timeout", type=float, default=30.0)
    args = ap.parse_args()
    settings = {"request_timeout": args.request_timeout, "decode_only": False}
    if args.max_answer_mb:
        settings["max_answer_mb"] = args.max_answer_mb
    for arm in args.arms:
        p_args, d_args = {
            "endless-json": (["--endless-body"], ["--endless-body"]),
            "endless-line": ([], ["--endless-body"]),
            "endless-events": ([], ["--endless-events"]),
            "huge-json": (["--huge-body", str(1 << 30)], ["--huge-body", str(1 << 30)]),
            "token-ids": ([], ["--huge-ids", "2000000"]),
        }[arm]
        with fake(*p_args) as p, fake(*d_args) as d, router([p], [d], **settings) as (proc, url):
            before = rss_mb(proc.pid)

            watch = HealthWatch(url)
            watch.start()
            answers = asyncio.run(run_arm(arm, url, args.seconds))
            watch.stop.set()
            watch.join()
            slowest = watch.slowest
            print(f"{arm}: router RSS {before:.0f} MiB at start, peak {peak_rss_mb(proc.pid):.0f} MiB, "
                  f"{rss_mb(proc.pid):.0f} MiB after; slowest /health {1000 * slowest:.0f} ms")
            for answer in answers:
                print(f"  {answer}")


if __name__ == "__main__":
    main()
