"""Shared by the issue-35 scenario scripts (the router under a broken or hostile neighbour): the real router
process (`python -m pdserve.router`, as `pdserve up` starts it) on a free port, against fake vLLM servers
(tests/kits/fake_vllm.py, each its own process) or a hostile backend the script serves itself; its /metrics
and its resident memory.

Not a scenario itself: benchmarks/scenarios/churn_admission.py, shifted_answers.py, endless_answer.py, rotating_flood.py
and hidden_short_turn.py use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# The tree whose router and fakes run (a `git worktree` of an earlier commit, to measure before a fix).
TREE = Path(os.environ.get("PDSERVE_TREE", ROOT))

from pdserve.observe.promtext import scrape, total  # noqa: E402

__all__ = ["ROOT", "fake", "free_port", "peak_rss_mb", "router", "rss_mb", "scrape", "total", "wait_http"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer in {timeout:g}s")
        time.sleep(0.1)


@contextlib.contextmanager
def fake(*args: str) -> Iterator[str]:
    """A fake vLLM server (tests/kits/fake_vllm.py, its own process, keeping no request bodies): its URL."""
    port = free_port()
    module = "tests.kits.fake_vllm" if (TREE / "tests" / "kits").is_dir() else "tests.fakes.fake_vllm"   # an older tree
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--no-record",
                             *args], cwd=TREE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def router(prefill: list[str], decode: list[str], log: str | None = None, args: tuple[str, ...] = (),
           port: int | None = None, **settings) -> Iterator[tuple[subprocess.Popen, str]]:
    """The router process on a free port (or `port`) with these backends and settings (router.json's keys):
    (process, URL); `args` go on its command line (a replica's --replica, --own-port). Its log goes to `log`
    (a path), else nowhere."""
    port = port or free_port()
    cfg = {"prefill": [{"name": f"prefill-{i}", "url": u} for i, u in enumerate(prefill)],
           "decode": [{"name": f"decode-{i}", "url": u} for i, u in enumerate(decode)],
           "model": "fake", "port": port, "health_interval": 0.5, **settings}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "router.json"
        path.write_text(json.dumps(cfg))
        out = open(log, "w") if log else subprocess.DEVNULL   # noqa: SIM115 - closed below
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--config", str(path), *args], cwd=TREE,
                                stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(url + "/health")
            yield proc, url
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
            if log:
                out.close()


def rss_mb(pid: int) -> float:
    """Resident memory of a process now, MiB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb(pid: int) -> float:
    """The most resident memory the process has had (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0
