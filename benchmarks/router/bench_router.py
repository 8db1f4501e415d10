#!/usr/bin/env python3
"""The router's own cost, measured against a fast fake vLLM backend on this machine.

Three ways to serve the same P -> D two-leg flow, each measured for non-streaming and streaming (128
tokens) requests at 1 and 64 concurrent clients:

- direct:   the load generator does both legs itself against the backend (no proxy at all);
- pdserve:  the real router process (`python -m pdserve.router`);
- baseline: vLLM's reference proxy design (FastAPI + httpx, as in vLLM's disaggregated-serving example
            proxies), written below with the same two legs;
- pdserve-admission: pdserve with every admission check on and none binding;
- pdserve-redis: pdserve with its reuse store in Redis (Debian's redis-server, on the load side's core);
- vllm-router: vLLM's Rust router (PyPI `vllm-router`, the bench extra) in its P-D mode, started with the
            same arguments as `pdserve bench`'s vllm-router arm (pdserve/bench/vrouter.py).

Added latency = proxy p50/p99 minus direct p50/p99 at 1 client. Throughput = requests per second at 64
clients. The proxy under test runs alone on core 0; the backend and the load generator share core 1, and
the proxy's CPU use is printed so a run where the proxy was not the bottleneck is visible. On a host with cores
to spare, `--load-cores 2 3 4 5 --backend-cores 6 7` spreads the load side (bench_router_spread.py) so that it
is not what limits a fast proxy.

Usage: .venv/bin/python benchmarks/router/bench_router.py [--duration 5] [--out out/bench-router.json]
       [--arms pdserve vllm-router] [--runs N] [--clients 1 64] [--no-stream] [--api chat messages responses]
       [--proxy-core 0] [--load-cores 1 ...] [--backend-cores ...]

`--runs N` repeats the measurement N times, the arms interleaved in each run (a noisy neighbour hits both
alike), and prints every run's figures, not only a mean. Every cell prints the proxy's CPU microseconds per
request (us/req: its CPU seconds over the cell, psutil, by the requests answered) beside req/s; with a pdserve
arm and vllm-router, a last table puts each pdserve cell beside vllm-router's: the req/s ratio, both p50s and
both us/req (on a loaded box the ratio swings, the CPU per request much less).

`--api chat messages responses` sends the same two-leg turn as OpenAI chat completions, Anthropic Messages
(`/v1/messages`) or OpenAI Responses (`/v1/responses`, message items, store off), each API's cells interleaved
with the others'; the backend answers each in vLLM's shapes (Messages' handles on message_stop, Responses'
in response.completed after a response.created with a null kv_transfer_params), every arm sends the API's own
legs (P's output cap: `max_tokens`, or `max_output_tokens` for Responses). With `--cpu`, per API too, and
`--reps N` measures each API N times, alternated on one router process, and prints the medians.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router_backends import APIS, CAP, REMOTE_DECODE, request_body, run, run_backend, run_baseline  # noqa: E402
from bench_router_spread import snapshot, spread_load  # noqa: E402
# Where each side runs (--proxy-core, --load-cores, --backend-cores; the defaults fit a 2-core box).
PROXY_CORE, LOAD_CORES, BACKEND_CORES = {0}, [1], [1]


def load_core() -> set[int]:
    """The core of this process (the load generator's first), of Redis and of the baseline's backend."""
    return {LOAD_CORES[0]}

# ---------------------------------------------------------------------------------------------------------
# Load generation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose next port is free too (the backend's P and D ports)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def spawn(argv: list[str], cores: set[int], env: dict | None = None, log=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=log, stderr=log,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores))


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


async def one_request(session: aiohttp.ClientSession, target: str, stream: bool, direct: bool,
                      api: str = "chat") -> None:
    body = request_body(api, stream)
    url = target + APIS[api]
    if direct:   # the client does the two legs itself
        p_body = {**body, CAP[APIS[api]]: 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        async with session.post(url, json=p_body) as r:
            body["kv_transfer_params"] = (await r.json())["kv_transfer_params"]
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        if stream:
            # Read as it arrives, not line by line: Messages and Responses events are three lines each (chat's
            # two), and parsing lines here made the load generator, not the proxy, the limit of streamed cells.
            async for _ in r.content.iter_any():
                pass
        else:
            await r.read()


async def load(target: str, clients: int, stream: bool, direct: bool, duration: float,
               proc: psutil.Process | None = None, api: str = "chat") -> tuple[list[float], dict[str, float]]:
    """Latencies of the measured phase, and what the proxy and the load generator used during it."""
    if len(LOAD_CORES) > 1:
        return await spread_load(target, clients, stream, direct, duration, api, LOAD_CORES, proc)
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await run_clients(session, clients, time.monotonic() + 0.5, target, stream, direct, api)   # warm up
        before = snapshot(proc)
        await run_clients(session, clients, time.monotonic() + duration, target, stream, direct, api, latencies)
        after = snapshot(proc)
    return latencies, {k: after[k] - before[k] for k in before}


async def run_clients(session: aiohttp.ClientSession, clients: int, deadline: float, target: str, stream: bool,
                      direct: bool, api: str, latencies: list[float] | None = None) -> None:
    """`clients` clients, each sending one request after another until `deadline` (time.monotonic); each
    request's seconds appended to `latencies` when given."""
    async def client() -> None:
        while time.monotonic() < deadline:
            t = time.perf_counter()
            await one_request(session, target, stream, direct, api)
            if latencies is not None:
                latencies.append(time.perf_counter() - t)
    await asyncio.gather(*(client() for _ in range(clients)))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def measure(name: str, target: str, proc: psutil.Process | None, stream: bool, clients: int, args,
                  api: str = "chat") -> dict:
    lat, used = await load(target, clients, stream, name == "direct", args.duration, proc, api)
    n = len(lat)
    r = {"proxy": name, "api": api, "stream": stream, "clients": clients, "requests": n,
         "rps": n / args.duration, "p50_ms": 1000 * pct(lat, 50), "p99_ms": 1000 * pct(lat, 99),
         "proxy_cpu_percent": 100 * used["proxy_cpu_s"] / args.duration if proc else None,
         "proxy_cpu_us_per_request": 1e6 * used["proxy_cpu_s"] / n if proc else None,
         "proxy_preempted_per_s": used["proxy_preempted"] / args.duration if proc else None,
         "load_cpu_percent": 100 * used["load_cpu_s"] / args.duration,
         # by core number ("core10_" sorts before "core1_" as text)
         "cores_busy_percent": [round(100 * used[f"core{i}_busy_s"] / args.duration)
                                for i in range(sum(k.startswith("core") for k in used))]}
    print(f"  {name:11s} {api:9s} stream={str(stream):5s} clients={clients:2d}: {r['rps']:7.0f} req/s  "
          f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  load cpu {r['load_cpu_percent']:.0f}%"
          + (f"  proxy cpu {r['proxy_cpu_percent']:.0f}%, {r['proxy_cpu_us_per_request']:.0f} us/req, "
             f"preempted {r['proxy_preempted_per_s']:.0f}/s" if proc else ""), file=sys.stderr)
    return r


ARMS = ("direct", "pdserve", "pdserve-admission", "pdserve-redis", "pdserve-no-access-log", "baseline", "vllm-router")
# Every admission check on (per-tenant rate and in-flight cap, global cap with a queue), none binding:
# what admission costs a request that it lets through.
ADMISSION_ON = {"tenant_rate": 1e9, "tenant_max_in_flight": 100_000, "max_in_flight": 100_000, "queue_size": 100}


def start_arm(name: str, backend_url: str, decode_url: str, router_cfg: dict, helpers: list[subprocess.Popen]
              ) -> tuple[str, subprocess.Popen | None, str | None]:
    """(url, process, its config file) of one arm, started on the proxy core; what the arm needs beside it
    (the pdserve-redis arm's redis-server) is appended to `helpers`, stopped with the arms."""
    if name == "direct":
        return backend_url, None, None
    port = free_port()
    if name.startswith("pdserve"):
        # pdserve-no-access-log: the access log's cost, the arms interleaved against `pdserve` (it is on there)
        extra = ADMISSION_ON if name == "pdserve-admission" else {"access_log": False} \
            if name == "pdserve-no-access-log" else {}
        if name == "pdserve-redis":
            redis_port = free_port()
            # Debian's redis-server, no persistence, on the load side's core (the router keeps core 0 alone)
            helpers.append(spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"], load_core()))
            extra = {"store": f"redis://127.0.0.1:{redis_port}/0"}
        cfg_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"prefill": [{"name": "prefill-0", "url": backend_url}],
                   "decode": [{"name": "decode-0", "url": decode_url}], "model": "m", "port": port,
                   **router_cfg, **extra}, cfg_file)
        cfg_file.close()
        # its log in a file opened for appending, as `pdserve up` gives it (the access log writes there)
        with tempfile.NamedTemporaryFile("ab", suffix=".log", delete=False) as log:
            router = spawn([sys.executable, "-m", "pdserve.router", "--config", cfg_file.name], PROXY_CORE, log=log)
        os.unlink(log.name)
        return f"http://127.0.0.1:{port}", router, cfg_file.name
    if name == "baseline":
        me = [sys.executable, str(Path(__file__).resolve())]
        return f"http://127.0.0.1:{port}", spawn([*me, "--serve-baseline", str(port), backend_url], PROXY_CORE), None
    from pdserve.bench import vrouter
    exe = vrouter.executable()
    if exe is None:
        raise SystemExit("error: arm vllm-router: the vllm-router package is not installed (pip install vllm-router)")
    return (f"http://127.0.0.1:{port}", spawn(vrouter.argv(exe, port, [backend_url], [decode_url], free_port()), PROXY_CORE,
                                               {"NO_COLOR": "1"}), None)


async def main_async(args) -> dict:
    os.sched_setaffinity(0, load_core())
    me = [sys.executable, str(Path(__file__).resolve())]
    backend_port = free_port_pair()
    backend_url, decode_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{backend_port + 1}"
    # one backend a core, sharing the two ports (SO_REUSEPORT) when there are several
    procs = [spawn([*me, "--serve-backend", str(backend_port), *(["reuse"] if len(BACKEND_CORES) > 1 else [])],
                   {core}) for core in BACKEND_CORES]
    arms: list[tuple[str, str, subprocess.Popen | None]] = []
    files: list[str] = []
    try:
        for name in args.arms:
            url, proc, cfg = start_arm(name, backend_url, decode_url, json.loads(args.router_config), procs)
            arms.append((name, url, proc))
            procs += [proc] if proc else []
            files += [cfg] if cfg else []
        for url in (backend_url, *(url for _, url, _ in arms)):
            await wait_up(url)
        await asyncio.sleep(2.5)   # the router's first health probe marks the backend healthy
        rows = []
        # Arms interleaved cell by cell: a neighbour's load on this shared box hits them alike.
        for run in range(args.runs):
            for stream in (False, True) if args.stream else (False,):
                for clients in args.clients:
                    for api in args.api:
                        for name, url, proc in arms:
                            row = await measure(name, url, psutil.Process(proc.pid) if proc else None, stream,
                                                clients, args, api)
                            rows.append({**row, "run": run})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        for f in files:
            os.unlink(f)
    return summarize(rows) if {"direct", "pdserve", "baseline"} <= set(args.arms) and args.runs == 1 \
        and args.clients == [1, 64] and args.stream and args.api == ["chat"] else {"rows": rows}


def print_against(rows: list[dict], other: str = "vllm-router") -> None:
    """Each pdserve arm beside `other` cell by cell: the req/s ratio, the p50s and both routers' CPU per request
    (what a change to the router's hot path moves, far less with the neighbours' load than req/s)."""
    cells = {(r["run"], r["api"], r["stream"], r["clients"], r["proxy"]): r for r in rows}
    pairs = [(r, cells.get((r["run"], r["api"], r["stream"], r["clients"], other))) for r in rows
             if r["proxy"].startswith("pdserve")]
    pairs = [(ours, theirs) for ours, theirs in pairs if theirs is not None]
    if not pairs:
        return
    print(f"\n{'run':>3s} {'arm':22s} {'api':9s} {'stream':6s} {'clients':>7s} {'req/s x':>8s} {'p50 ms':>13s} "
          f"{'us/req':>11s}   (pdserve/{other})")
    for ours, theirs in pairs:
        print(f"{ours['run']:3d} {ours['proxy']:22s} {ours['api']:9s} {str(ours['stream']):6s} {ours['clients']:7d} "
              f"{ours['rps'] / theirs['rps']:7.2f}x {ours['p50_ms']:6.2f}/{theirs['p50_ms']:<6.2f} "
              f"{ours['proxy_cpu_us_per_request']:5.0f}/{theirs['proxy_cpu_us_per_request']:<5.0f}")


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
    repo = Path(__file__).resolve().parents[2]
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


async def requests_cpu(proc: psutil.Process, url: str, n: int, stream: bool, api: str = "chat") -> float:
    """Router CPU seconds for n requests from 16 clients."""
    left = n
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):
            await one_request(session, url, stream, False, api)      # warm up
        before = cpu_seconds(proc)

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one_request(session, url, stream, False, api)
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


async def compare_cpu(revs: list[str], n: int, tracing: bool = False, apis: tuple[str, ...] = ("chat",),
                      reps: int = 1, router_config: dict | None = None) -> list[dict]:
    os.sched_setaffinity(0, load_core())
    backend_port = free_port_pair()     # the backend listens on this port and the next
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = spawn([sys.executable, str(Path(__file__).resolve()), "--serve-backend", str(backend_port)], load_core())
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
                                           "model": "m", "port": port, **(router_config or {}),
                                           **({"otlp_endpoint": backend_url + "/v1/traces"} if traced else {})}))
                # The router's log goes to a file opened for appending, as `pdserve up` gives it (its access
                # log writes a line a request there).
                router_log = open(Path(tmp) / "router.log", "ab")
                router = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--config", str(cfg)], cwd=tmp,
                                          env={**os.environ, "PYTHONPATH": tmp}, stdout=router_log,
                                          stderr=router_log,
                                          preexec_fn=lambda: os.sched_setaffinity(0, PROXY_CORE))
                try:
                    url = f"http://127.0.0.1:{port}"
                    await wait_up(url)
                    await asyncio.sleep(2.5)   # the first health probe marks the backend healthy
                    proc = psutil.Process(router.pid)
                    # the APIs alternated, `reps` times, on one router process: a neighbour's load hits them alike
                    runs: dict[str, list[tuple[float, float]]] = {api: [] for api in apis}
                    for _ in range(reps):
                        for api in apis:
                            runs[api].append((await requests_cpu(proc, url, n, False, api),
                                              await requests_cpu(proc, url, n, True, api)))
                    stall, took, status = await huge_body_stall(url)
                finally:
                    router.terminate()
                    router.wait(10)
                    router_log.close()
                log_lines = len((Path(tmp) / "router.log").read_bytes().splitlines())
            rev_label = f"{rev}+trace" if traced else rev
            for api, got in runs.items():
                json_cpu, stream_cpu = (statistics.median(kind) for kind in zip(*got))
                rows.append({"rev": rev_label, "api": api, "json_cpu_s": json_cpu, "stream_cpu_s": stream_cpu,
                             "json_runs_s": [j for j, _ in got], "stream_runs_s": [t for _, t in got],
                             "health_stall_s": stall, "huge_body_s": took, "huge_body_status": status,
                             "router_log_lines": log_lines})
                print(f"  {rev_label} {api}: {n} json {json_cpu:.2f} CPU-s, {n} streams {stream_cpu:.2f} CPU-s "
                      f"(median of {reps}: {' '.join(f'{j:.2f}/{t:.2f}' for j, t in got)}), "
                      f"/health stalled up to {stall:.2f} s by a 13 MB body (HTTP {status}, {took:.2f} s); "
                      f"router log {log_lines} lines",
                      file=sys.stderr)
    finally:
        backend.terminate()
        backend.wait(10)
    return rows


DEFAULT_OUT = Path(__file__).resolve().parents[2] / "out" / "bench-router.json"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-backend":
        return run_backend(int(sys.argv[2]), reuse_port=sys.argv[3:] == ["reuse"])
    if len(sys.argv) > 3 and sys.argv[1] == "--serve-baseline":
        return run_baseline(int(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds measured per scenario")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the full results (default: out/ of this checkout, ignored by git; results worth keeping go to benchmarks/results/DATE-NAME/)")
    ap.add_argument("--cpu", nargs="+", metavar="REV", help="compare the router's CPU per request of revisions")
    ap.add_argument("-n", type=int, default=1000, help="requests per kind with --cpu")
    ap.add_argument("--reps", type=int, default=1, help="with --cpu: measure each API this many times, alternated "
                    "(medians printed)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=["direct", "pdserve", "baseline"],
                    help="what to measure (vllm-router needs the vllm-router package)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the measurement, arms interleaved")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 64], help="concurrent clients per cell")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="non-streamed requests only")
    ap.add_argument("--router-config", default="{}", help="extra pdserve router settings, as JSON (with --cpu too, "
                    "for every revision)")
    ap.add_argument("--tracing", action="store_true", help="with --cpu: each revision with tracing off and on")
    ap.add_argument("--api", nargs="+", choices=tuple(APIS), default=["chat"],
                    help="wire formats to send (chat completions, Anthropic Messages, OpenAI Responses), interleaved")
    ap.add_argument("--proxy-core", type=int, default=0, help="the core the router under test runs on")
    ap.add_argument("--load-cores", type=int, nargs="+", default=[1], help="one load-generator process a core "
                    "(several: bench_router_spread.py; this process stays on the first)")
    ap.add_argument("--backend-cores", type=int, nargs="+", help="one fake backend a core (default: the first "
                    "load core, shared with the load generator)")
    args = ap.parse_args()
    global PROXY_CORE, LOAD_CORES, BACKEND_CORES
    PROXY_CORE, LOAD_CORES = {args.proxy_core}, args.load_cores
    BACKEND_CORES = args.backend_cores or args.load_cores[:1]
    if args.cpu:
        rows = run(compare_cpu(args.cpu, args.n, args.tracing, tuple(args.api), args.reps,
                               json.loads(args.router_config)))
        print(f"{'revision':12s} {'api':9s} {f'{args.n} json CPU-s':>16s} {f'{args.n} streams CPU-s':>19s} "
              f"{'/health stall s':>16s} {'13 MB body s':>13s}")
        for r in rows:
            print(f"{r['rev']:12s} {r['api']:9s} {r['json_cpu_s']:16.2f} {r['stream_cpu_s']:19.2f} "
                  f"{r['health_stall_s']:16.2f} {r['huge_body_s']:13.2f}")
        return
    result = run(main_async(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if "summary" not in result:
        print(f"{'run':>3s} {'arm':12s} {'api':9s} {'stream':6s} {'clients':>7s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} "
              f"{'cpu %':>6s} {'us/req':>7s} {'preempt/s':>9s} {'load cpu %':>10s}  cores busy %")
        for r in result["rows"]:
            print(f"{r['run']:3d} {r['proxy']:12s} {r['api']:9s} {str(r['stream']):6s} {r['clients']:7d} {r['rps']:7.0f} "
                  f"{r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {r['proxy_cpu_percent'] or 0:6.0f} "
                  f"{r['proxy_cpu_us_per_request'] or 0:7.0f} {r['proxy_preempted_per_s'] or 0:9.0f} "
                  f"{r['load_cpu_percent']:10.0f}  {'/'.join(map(str, r['cores_busy_percent']))}")
        print_against(result["rows"])
        return
    print(f"{'stream':7s} {'added p50 ms':>13s} {'added p99 ms':>13s} {'rps@64':>8s} "
          f"{'baseline added p50':>19s} {'baseline rps@64':>16s} {'ratio':>6s}")
    for s in result["summary"]:
        print(f"{str(s['stream']):7s} {s['pdserve_added_p50_ms']:13.2f} {s['pdserve_added_p99_ms']:13.2f} "
              f"{s['pdserve_rps_64']:8.0f} {s['baseline_added_p50_ms']:19.2f} {s['baseline_rps_64']:16.0f} "
              f"{s['rps_ratio_64']:6.1f}x")


if __name__ == "__main__":
    main()
