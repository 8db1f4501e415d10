"""A low open-file limit (issue 25, point 2): the router, started under `prlimit --nofile=1024` (a common
default), splits its descriptors between client connections and the upstream pool, serves 300 concurrent
streams, and counts every connection it refuses; far below that it refuses to start, saying why."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from tests.kits.fake_vllm import build_app as build_fake
from tests.kits.fake_vllm import parse_args
from tests.kits.ports import free_ports

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
STREAMS = 300
CHAT = "/v1/chat/completions"


async def _fake(*argv: str) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_fake(parse_args(["--no-record", *argv])), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def _router(tmp_path, nofile: int, p_url: str, d_url: str) -> tuple[subprocess.Popen, str]:
    [port] = free_ports(1)
    cfg = {"prefill": [{"name": "prefill-0", "url": p_url}], "decode": [{"name": "decode-0", "url": d_url}],
           "model": "fake", "port": port, "health_interval": 0.5}
    path = tmp_path / "router.json"
    path.write_text(json.dumps(cfg))
    log = open(tmp_path / "router.log", "w")
    proc = subprocess.Popen(["prlimit", f"--nofile={nofile}:{nofile}", sys.executable, "-m", "pdserve.router",
                             "--config", str(path)], stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def _ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen) -> None:
    for _ in range(200):
        assert proc.poll() is None, "the router exited"
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the router never answered /health")


async def _stream(session: aiohttp.ClientSession, url: str) -> str:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    try:
        async with session.post(url + CHAT, json=body) as resp:
            lines = [line async for line in resp.content if line.strip()]
            if resp.status == 200 and lines and lines[-1].strip() == b"data: [DONE]":
                return "served"
            return f"http {resp.status}"
    except aiohttp.ClientError as err:
        return f"reset ({type(err).__name__})"


def _counted(metrics: str) -> float:
    """Client connections and requests the router refused with a counted reason."""
    return sum(float(m.group(1)) for m in re.finditer(
        r'^pdserve_router_(?:connections_dropped|busy)_total\{[^}]*\} (\S+)$', metrics, re.M))


async def test_300_concurrent_streams_under_nofile_1024_are_all_served_or_counted(tmp_path):
    p_runner, p_url = await _fake()
    d_runner, d_url = await _fake("--token-delay", "0.05")     # the streams overlap
    proc, url = _router(tmp_path, 1024, p_url, d_url)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _ready(session, url, proc)
            outcomes = await asyncio.gather(*(_stream(session, url) for _ in range(STREAMS)))
            async with session.get(url + "/metrics") as resp:
                metrics = await resp.text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        await p_runner.cleanup()
        await d_runner.cleanup()
    log = (tmp_path / "router.log").read_text()
    refused = [o for o in outcomes if o != "served"]
    assert len(refused) == _counted(metrics), (sorted(set(outcomes)), log[-2000:])
    assert outcomes.count("served") == STREAMS, sorted(set(outcomes))
    clients, upstream = map(int, re.search(r"up to (\d+) client connections, (\d+) upstream", log).groups())
    assert clients >= STREAMS and clients + upstream <= 1024 - 64, log


def test_the_router_refuses_to_start_with_too_few_descriptors(tmp_path):
    proc, _ = _router(tmp_path, 90, "http://127.0.0.1:9", "http://127.0.0.1:9")
    assert proc.wait(timeout=60) != 0
    log = (tmp_path / "router.log").read_text()
    assert "open-file limit 90 is too low" in log and "ulimit -Hn" in log, log
