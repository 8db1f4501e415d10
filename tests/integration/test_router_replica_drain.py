"""SIGTERM of one router replica (issue 35 item 11): two router processes share a port (SO_REUSEPORT) in front of
fake servers; clients on kept-alive connections keep sending while one replica drains. Its answers from then on
close their connections (Connection: close), so no client sends a request into a connection closed under it."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.kits.fake_vllm import build_app as build_fake
from tests.kits.fake_vllm import parse_args
from tests.kits.router_rig import serve_app

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_health(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered")


async def test_a_draining_replica_closes_each_connection_with_an_answer(tmp_path):
    runners, urls = [], []
    for _ in range(2):
        runner, url = await serve_app(build_fake(parse_args(["--no-record", "--delay", "0.005"])))
        runners.append(runner)
        urls.append(url)
    port = free_port()
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"prefill": [{"name": "prefill-0", "url": urls[0]}],
                                  "decode": [{"name": "decode-0", "url": urls[1]}], "model": "fake", "port": port,
                                  "replicas": 2, "health_interval": 0.2}))
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.router", "--config", str(config), "--replica",
                               f"router-{i}", "--own-port", str(free_port())], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
    counts: collections.Counter = collections.Counter()
    try:
        await wait_health(f"http://127.0.0.1:{port}")
        await asyncio.sleep(0.3)                       # both replicas listening
        end = time.monotonic() + 2.0

        async def client() -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                while time.monotonic() < end:
                    try:
                        async with s.post(f"http://127.0.0.1:{port}{CHAT}", json=BODY) as resp:
                            await resp.read()
                            counts[resp.headers.get("X-PDServe-Router", "?")] += 1
                    except aiohttp.ClientConnectorError:
                        counts["connect_failed"] += 1  # a connect in flight as the listener closed (not ours)
                    except aiohttp.ClientError as err:
                        counts[f"failed: {type(err).__name__}"] += 1

        async def drain() -> None:
            await asyncio.sleep(0.7)
            procs[0].send_signal(signal.SIGTERM)

        await asyncio.gather(drain(), *(client() for _ in range(12)))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(20)
        for runner in runners:
            await runner.cleanup()
    assert counts["router-0"] and counts["router-1"], counts
    assert not [k for k in counts if k.startswith("failed")], counts
    assert counts["connect_failed"] <= 1, counts
