"""How long a cluster takes to start, and each server to come back after a SIGKILL of its API-server pid.

`pdserve up` of a config in a fresh PDSERVE_HOME, then for each server in turn: SIGKILL, the seconds until
`pdserve status` shows it `ready` again with a new pid; then `down`. `--spawn` adds PDSERVE_ENGINE_FORK=0 to
every server's env (vLLM's own spawn of the engine core and workers), for the other side of the comparison.
Runs on the config's own ports: nothing else may hold them.

  .venv/bin/python benchmarks/scenarios/start_and_restart.py [CONFIG] [--spawn] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pdserve.engine.names import FORK_ENV
from pdserve.orchestrate import ops
from pdserve.spec.load import DEFAULT_CONFIG


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=900)


def process(name: str, server: str) -> dict:
    return next(p for p in ops.status(name).to_json()["processes"] if p["name"] == server)


def restart_seconds(name: str, server: str, timeout: float = 600) -> float:
    pid = process(name, server)["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while time.monotonic() - t0 < timeout:
        now = process(name, server)
        if now["pid"] != pid and now["state"] == "ready":
            return time.monotonic() - t0
        time.sleep(0.25)
    raise TimeoutError(f"{server} not ready {timeout:.0f} s after its SIGKILL")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG))
    ap.add_argument("--spawn", action="store_true", help=f"{FORK_ENV}=0 on every server")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    servers = [f"{role}-{i}" for role in ("decode", "prefill") for i in range(cfg[role].get("replicas", 1))]
    if args.spawn:
        for role in ("prefill", "decode"):
            cfg[role]["env"] = {**(cfg[role].get("env") or {}), FORK_ENV: "0"}
    with tempfile.TemporaryDirectory(prefix="pdserve-restart-") as tmp:
        os.environ["PDSERVE_HOME"] = str(Path(tmp) / "home")
        path = Path(tmp) / "cluster.yaml"
        path.write_text(yaml.safe_dump(cfg))
        t0 = time.monotonic()
        up = pdserve("up", str(path))
        result = {"config": args.config, "children": "spawn" if args.spawn else "default", "up_rc": up.returncode,
                  "up_s": round(time.monotonic() - t0, 1), "restart_s": {}}
        try:
            if up.returncode != 0:
                print(up.stderr[-3000:], file=sys.stderr)
                return 1
            for server in servers:
                time.sleep(5)                     # the router's probe sees the survivor settled
                result["restart_s"][server] = round(restart_seconds(cfg["name"], server), 1)
        finally:
            pdserve("down", cfg["name"])
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['children']}: up {result['up_s']} s; " + "; ".join(
            f"{s} SIGKILLed, ready again after {t} s" for s, t in result["restart_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
