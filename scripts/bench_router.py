#!/usr/bin/env python3
"""The router's own cost, measured against a fast fake vLLM backend on this machine.

Three ways to serve the same P -> D two-leg flow, each measured for non-streaming and streaming (128
tokens) requests at 1 and 64 concurrent clients:

- direct:   the load generator does both legs itself against the backend (no proxy at all);
- pdserve:  the real router process (`python -m pdserve.router`);
- baseline: vLLM's reference proxy design (FastAPI + httpx, as in vLLM's disaggregated-serving example
            proxies), written below with the same two legs.

Added latency = proxy p50/p99 minus direct p50/p99 at 1 client. Throughput = requests per second at 64
clients. The proxy under test runs alone on core 0; the backend and the load generator share core 1, and
the proxy's CPU use is printed so a run where the proxy was not the bottleneck is visible.

Usage: .venv/bin/python scripts/bench_router.py [--duration 5] [--out bench-router.json]

`--cpu REV [REV ...]` compares router revisions instead (`.` is the working tree): each one's `pdserve`
package is exported to a temporary folder and run on core 0 against the same backend; printed side by side:
the router's CPU seconds (user + system) for N JSON requests and N streams (16 clients), and the longest
`/health` answer while one 13 MB body of 380k small messages is served (how long a huge body stalls the
event loop for every other client). With `--tracing`, each revision runs twice: tracing off, and on
(`otlp_endpoint` set, every request sampled, spans exported over OTLP/HTTP to a sink beside the backend):
the router's CPU then includes its exporter thread.
"""


import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

TOKENS = 128
PROXY_CORE, LOAD_CORE = {0}, {1}

# ---------------------------------------------------------------------------------------------------------
# The fast fake backend: answers the P leg (max_tokens 1 with do_remote_decode) and the D leg at once.


def run_backend(port: int) -> None:
    from aiohttp import web

    p_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                "remote_request_id": "r", "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1",
                "remote_port": 1}
    message = {"role": "assistant", "content": "ok"}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return web.json_response({"id": "p", "object": "chat.completion", "choices": [
                {"index": 0, "message": message, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": 1}, "kv_transfer_params": p_params})
        if not body.get("stream"):
            return web.json_response({"id": "d", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "tok " * TOKENS}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 8, "completion_tokens": TOKENS}})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        chunk = b'data: {"id":"d","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
        for _ in range(TOKENS):
            await out.write(chunk)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def traces(request: web.Request) -> web.Response:    # an OTLP/HTTP sink for --tracing
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)   # the huge-body case of --cpu reaches it
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", lambda r: health(r))
    app.router.add_post("/v1/traces", traces)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------------------------------------------------
# The baseline: vLLM's reference proxy design (FastAPI + httpx), same two legs as the router.


def run_baseline(port: int, backend: str) -> None:
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    client = httpx.AsyncClient(timeout=None, base_url=backend, limits=httpx.Limits(max_connections=None))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        p_body = {**body, "max_tokens": 1, "stream": False,
                  "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        p = await client.post("/v1/chat/completions", json=p_body)
        d_body = {**body, "kv_transfer_params": p.json().get("kv_transfer_params")}
        if not body.get("stream"):
            d = await client.post("/v1/chat/completions", json=d_body)
            return JSONResponse(d.json())

        async def relay():
            async with client.stream("POST", "/v1/chat/completions", json=d_body) as resp:
                async for chunk in resp.aiter_bytes():
                    yield chunk
        return StreamingResponse(relay(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---------------------------------------------------------------------------------------------------------
# Load generation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], cores: set[int], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, cores))


async def wait_up(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def one_request(session: aiohttp.ClientSession, target: str, stream: bool, direct: bool) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "stream": stream}
    url = target + "/v1/chat/completions"
    if direct:   # the client does the two legs itself
        p_body = {**body, "max_tokens": 1, "stream": False,
                  "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        async with session.post(url, json=p_body) as r:
            body["kv_transfer_params"] = (await r.json())["kv_transfer_params"]
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        if stream:
            async for _ in r.content:
                pass
        else:
            await r.read()


async def load(target: str, clients: int, stream: bool, direct: bool, duration: float) -> list[float]:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker(deadline: float, record: bool) -> None:
            while time.monotonic() < deadline:
                t = time.perf_counter()
                await one_request(session, target, stream, direct)
                if record:
                    latencies.append(time.perf_counter() - t)
        await asyncio.gather(*(worker(time.monotonic() + 0.5, False) for _ in range(clients)))   # warm up
        await asyncio.gather(*(worker(time.monotonic() + duration, True) for _ in range(clients)))
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def measure(name: str, target: str, proc: psutil.Process | None, args) -> list[dict]:
    rows = []
    for stream in (False, True):
        for clients in (1, 64):
            if proc:
                proc.cpu_percent()
            lat = await load(target, clients, stream, name == "direct", args.duration)
            cpu = proc.cpu_percent() if proc else None
            rows.append({"proxy": name, "stream": stream, "clients": clients, "requests": len(lat),
                         "rps": len(lat) / args.duration, "p50_ms": 1000 * pct(lat, 50),
                         "p99_ms": 1000 * pct(lat, 99), "proxy_cpu_percent": cpu})
            print(f"  {name:8s} stream={str(stream):5s} clients={clients:2d}: {rows[-1]['rps']:7.0f} req/s  "
                  f"p50 {rows[-1]['p50_ms']:6.2f} ms  p99 {rows[-1]['p99_ms']:6.2f} ms"
                  + (f"  proxy cpu {cpu:.0f}%" if cpu is not None else ""), file=sys.stderr)
    return rows


async def main_async(args) -> dict:
    os.sched_setaffinity(0, LOAD_CORE)
    me = [sys.executable, str(Path(__file__).resolve())]
    backend_port, router_port, baseline_port = free_port(), free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    procs = [spawn([*me, "--serve-backend", str(backend_port)], LOAD_CORE)]
    cfg_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"prefill": [{"name": "prefill-0", "url": backend_url}], "decode": [{"name": "decode-0", "url": backend_url}],
               "model": "m", "port": router_port}, cfg_file)
    cfg_file.close()
    router = spawn([sys.executable, "-m", "pdserve.router", "--config", cfg_file.name], PROXY_CORE)
    baseline = spawn([*me, "--serve-baseline", str(baseline_port), backend_url], PROXY_CORE)
    procs += [router, baseline]
    try:
        for url in (backend_url, f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{baseline_port}"):
            await wait_up(url)
        await asyncio.sleep(2.5)   # the router's first health probe marks the backend healthy
        rows = []
        for name, url, proc in (("direct", backend_url, None),
                                ("pdserve", f"http://127.0.0.1:{router_port}", psutil.Process(router.pid)),
                                ("baseline", f"http://127.0.0.1:{baseline_port}", psutil.Process(baseline.pid))):
            rows += await measure(name, url, proc, args)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        os.unlink(cfg_file.name)
    return summarize(rows)


def summarize(rows: list[dict]) -> dict:
    def get(proxy, stream, clients):
        return next(r for r in rows if r["proxy"] == proxy and r["stream"] == stream and r["clients"] == clients)
    summary = []
    for stream in (False, True):
        direct, ours, base = (get(p, stream, 1) for p in ("direct", "pdserve", "baseline"))
        ours64, base64 = get("pdserve", stream, 64), get("baseline", stream, 64)
        summary.append({"stream": stream,
                        "pdserve_added_p50_ms": ours["p50_ms"] - direct["p50_ms"],
                        "pdserve_added_p99_ms": ours["p99_ms"] - direct["p99_ms"],
                        "baseline_added_p50_ms": base["p50_ms"] - direct["p50_ms"],
                        "baseline_added_p99_ms": base["p99_ms"] - direct["p99_ms"],
                        "pdserve_rps_64": ours64["rps"], "baseline_rps_64": base64["rps"],
                        "rps_ratio_64": ours64["rps"] / base64["rps"]})
    return {"rows": rows, "summary": summary}


# ---------------------------------------------------------------------------------------------------------
# CPU per request, revision against revision


def export_revision(rev: str, into: Path) -> Path:
    """The pdserve package of `rev` (`.`: the working tree) under `into`, for PYTHONPATH."""
    repo = Path(__file__).resolve().parents[1]
    if rev == ".":
        subprocess.run(["cp", "-r", str(repo / "pdserve"), str(into)], check=True)
    else:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "pdserve"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def requests_cpu(proc: psutil.Process, url: str, n: int, stream: bool) -> float:
    """Router CPU seconds for n requests from 16 clients."""
    left = n
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):
            await one_request(session, url, stream, False)      # warm up
        before = cpu_seconds(proc)

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one_request(session, url, stream, False)
        await asyncio.gather(*(worker() for _ in range(16)))
        return cpu_seconds(proc) - before


async def huge_body_stall(url: str) -> tuple[float, float, int]:
    """(longest /health answer in s while a 13 MB body of 380k messages is served, its own seconds, status)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 380_000,
                       "max_tokens": 4}).encode()
    worst, done = 0.0, False
    async with aiohttp.ClientSession() as session:
        async def probe() -> None:
            nonlocal worst
            while not done:
                t = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.01)
        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.2)
        t = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
            status = r.status
        took = time.perf_counter() - t
        await asyncio.sleep(0.2)
        done = True
        await prober
    return worst, took, status


async def compare_cpu(revs: list[str], n: int, tracing: bool = False) -> list[dict]:
    os.sched_setaffinity(0, LOAD_CORE)
    backend_port = free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = spawn([sys.executable, str(Path(__file__).resolve()), "--serve-backend", str(backend_port)], LOAD_CORE)
    rows = []
    try:
        await wait_up(backend_url)
        for rev, traced in [(r, t) for r in revs for t in ((False, True) if tracing else (False,))]:
            with tempfile.TemporaryDirectory() as tmp:
                export_revision(rev, Path(tmp))
                port = free_port()
                cfg = Path(tmp) / "router.json"
                cfg.write_text(json.dumps({"prefill": [{"name": "prefill-0", "url": backend_url}],
                                           "decode": [{"name": "decode-0", "url": backend_url}],
                                           "model": "m", "port": port,
                                           **({"otlp_endpoint": backend_url + "/v1/traces"} if traced else {})}))
                router = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--config", str(cfg)], cwd=tmp,
                                          env={**os.environ, "PYTHONPATH": tmp}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL,
                                          preexec_fn=lambda: os.sched_setaffinity(0, PROXY_CORE))
                try:
                    url = f"http://127.0.0.1:{port}"
                    await wait_up(url)
                    await asyncio.sleep(2.5)   # the first health probe marks the backend healthy
                    proc = psutil.Process(router.pid)
                    json_cpu = await requests_cpu(proc, url, n, False)
                    stream_cpu = await requests_cpu(proc, url, n, True)
                    stall, took, status = await huge_body_stall(url)
                finally:
                    router.terminate()
                    router.wait(10)
            rev_label = f"{rev}+trace" if traced else rev
            rows.append({"rev": rev_label, "json_cpu_s": json_cpu, "stream_cpu_s": stream_cpu, "health_stall_s": stall,
                         "huge_body_s": took, "huge_body_status": status})
            print(f"  {rev_label}: {n} json {json_cpu:.2f} CPU-s, {n} streams {stream_cpu:.2f} CPU-s, "
                  f"/health stalled up to {stall:.2f} s by a 13 MB body (HTTP {status}, {took:.2f} s)",
                  file=sys.stderr)
    finally:
        backend.terminate()
        backend.wait(10)
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-backend":
        return run_backend(int(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[1] == "--serve-baseline":
        return run_baseline(int(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds measured per scenario")
    ap.add_argument("--out", default="bench-router.json", help="where to write the full results")
    ap.add_argument("--cpu", nargs="+", metavar="REV", help="compare the router's CPU per request of revisions")
    ap.add_argument("-n", type=int, default=1000, help="requests per kind with --cpu")
    ap.add_argument("--tracing", action="store_true", help="with --cpu: each revision with tracing off and on")
    args = ap.parse_args()
    if args.cpu:
        rows = asyncio.run(compare_cpu(args.cpu, args.n, args.tracing))
        print(f"{'revision':12s} {f'{args.n} json CPU-s':>16s} {f'{args.n} streams CPU-s':>19s} "
              f"{'/health stall s':>16s} {'13 MB body s':>13s}")
        for r in rows:
            print(f"{r['rev']:12s} {r['json_cpu_s']:16.2f} {r['stream_cpu_s']:19.2f} {r['health_stall_s']:16.2f} "
                  f"{r['huge_body_s']:13.2f}")
        return
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'stream':7s} {'added p50 ms':>13s} {'added p99 ms':>13s} {'rps@64':>8s} "
          f"{'baseline added p50':>19s} {'baseline rps@64':>16s} {'ratio':>6s}")
    for s in result["summary"]:
        print(f"{str(s['stream']):7s} {s['pdserve_added_p50_ms']:13.2f} {s['pdserve_added_p99_ms']:13.2f} "
              f"{s['pdserve_rps_64']:8.0f} {s['baseline_added_p50_ms']:19.2f} {s['baseline_rps_64']:16.0f} "
              f"{s['rps_ratio_64']:6.1f}x")


if __name__ == "__main__":
    main()
