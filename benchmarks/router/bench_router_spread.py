"""bench_router.py's load side over several cores, for a host with cores to spare (`--load-cores 2 3 4 5`).

On a 2-core box the load generator and the fake backend share one core, and in every vllm-router cell at 64
clients that core was the limit (100% busy while vllm-router used half of its own): the ratio then measures the
load side, not the routers. Here the clients are split over one load-generator process a core, each pinned to
its core, all measuring the same window (absolute CLOCK_MONOTONIC times, which every process on the host
shares), and `--backend-cores` runs one fake backend a core on the same two ports (SO_REUSEPORT).

A worker is this file run as `--load-worker JSON`; it prints one JSON line: its latencies and CPU seconds.
"""

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

WARM_S = 0.5           # each worker's own warm-up before the window
START_AFTER_S = 1.5    # spawn + imports + warm-up, before the measured window opens


def snapshot(proc: psutil.Process | None) -> dict[str, float]:
    """CPU seconds and involuntary context switches (another process took the core) of the proxy and of
    this load generator (the backend shares its core)."""
    out = {}
    for core, t in enumerate(psutil.cpu_times(percpu=True)):     # the whole machine, neighbours included
        out[f"core{core}_busy_s"] = sum(t) - t.idle - getattr(t, "iowait", 0.0)
    for who, p in (("proxy", proc), ("load", psutil.Process())):
        if p is not None:
            t = p.cpu_times()
            out[who + "_cpu_s"] = t.user + t.system
            out[who + "_preempted"] = preemptions(p.pid)
    return out


def preemptions(pid: int) -> int:
    """Involuntary context switches of all the process's threads (psutil counts the main thread only)."""
    n = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            n += int(next(line for line in (task / "status").read_text().splitlines()
                          if line.startswith("nonvoluntary_ctxt_switches")).split()[1])
        except (OSError, StopIteration):
            pass
    return n


def split(clients: int, parts: int) -> list[int]:
    """`clients` over `parts` workers as evenly as whole clients go, no worker with none."""
    parts = max(1, min(parts, clients))
    return [clients // parts + (i < clients % parts) for i in range(parts)]


async def spread_load(target: str, clients: int, stream: bool, direct: bool, duration: float, api: str,
                      cores: list[int], proc: psutil.Process | None) -> tuple[list[float], dict[str, float]]:
    """As bench_router.load, over one worker process a core of `cores`: the proxy snapshotted at the window's
    open and close, `load_cpu_s` the workers' CPU over the window."""
    start_at = time.monotonic() + START_AFTER_S
    end_at = start_at + duration
    workers = []
    for core, n in zip(cores, split(clients, len(cores))):
        spec = {"target": target, "clients": n, "stream": stream, "direct": direct, "api": api,
                "start_at": start_at, "end_at": end_at}
        workers.append(await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--load-worker", json.dumps(spec),
            stdout=subprocess.PIPE, preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})))
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    before = snapshot(proc)
    await asyncio.sleep(max(0.0, end_at - time.monotonic()))
    after = snapshot(proc)
    latencies, load_cpu = [], 0.0
    for w in workers:
        out, _ = await w.communicate()
        if w.returncode != 0:
            raise RuntimeError(f"load worker exited {w.returncode}")
        got = json.loads(out.decode().strip().splitlines()[-1])
        latencies += got["latencies"]
        load_cpu += got["cpu_s"]
    used = {k: after[k] - before[k] for k in before}
    used["load_cpu_s"] = load_cpu
    return latencies, used


async def worker(spec: dict) -> dict:
    from bench_router import run_clients     # noqa: PLC0415 (this file is run as a script beside it)
    latencies: list[float] = []
    me = psutil.Process()
    sends = (spec["target"], spec["stream"], spec["direct"], spec["api"])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.sleep(max(0.0, spec["start_at"] - WARM_S - time.monotonic()))
        await run_clients(session, spec["clients"], spec["start_at"], *sends)     # warm up
        cpu = me.cpu_times()
        await run_clients(session, spec["clients"], spec["end_at"], *sends, latencies)
        cpu2 = me.cpu_times()
    return {"latencies": latencies, "cpu_s": cpu2.user + cpu2.system - cpu.user - cpu.system}


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--load-worker":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_router_backends import run
    print(json.dumps(run(worker(json.loads(sys.argv[2])))))
