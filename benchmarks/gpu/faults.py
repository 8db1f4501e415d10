"""Server crashes on GPUs, through pdserve itself: up, load, reuse, then for each server of FAULTS_KILL
(comma-separated, default decode-0; e.g. decode-0,prefill-0) a SIGKILL of its API-server pid, recovery,
reuse; down. FAULTS_ATTACH=1 uses the cluster already running (no up); FAULTS_KEEP=1 leaves it running.

  python3 faults.py CONFIG.yaml OUT_DIR [RECOVERY_TIMEOUT_S]

Writes OUT_DIR/<name>-faults.json (summary, timeline, GPU memory every 2 s, every client request) and prints
the summary. While it runs: a client sends short chats (streamed and not, alternately) the whole time; the
cluster's phase and processes are read every second (so `start_after` shows: D starts only once P is ready).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402  (the GPU scripts' own helpers: filler text, chat, P's /metrics)

from pdserve.orchestrate.view import cluster_view  # noqa: E402
from pdserve.state.folder import ClusterDir  # noqa: E402

T0 = time.monotonic()
stop = threading.Event()


def now() -> float:
    return round(time.monotonic() - T0, 2)


def pd(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=timeout)


def gpu_memory() -> list[int]:
    """MiB used per GPU; [] without nvidia-smi (a dry run on a CPU machine)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
    except OSError:
        return []
    return [int(x) for x in out.split()]


def sample_gpus(rows: list) -> None:
    while not stop.is_set():
        rows.append([now(), *gpu_memory()])
        stop.wait(2)


def watch(name: str, timeline: list) -> None:
    """Phase and per-process (state, pid, restarts), recorded when they change."""
    last = None
    while not stop.is_set():
        try:
            st = cluster_view(ClusterDir(name)).to_json()
            seen = {"phase": st["phase"], **{p["name"]: [p["state"], p["pid"], p["restarts"]]
                                             for p in st["processes"]}}
        except Exception as e:   # state.json mid-write, router busy: the next read will do
            seen = {"error": type(e).__name__}
        if seen != last and "error" not in seen:
            timeline.append({"t": now(), **seen})
            last = seen
        stop.wait(1)


def client(router: str, rows: list) -> None:
    i = 0
    while not stop.is_set():
        stream = i % 2 == 1
        t = now()
        try:
            _, raw = measure.chat(router, [{"role": "user", "content": f"short question {i}: say hi"}],
                                  f"load-{i}", stream, 8)
            ok = "[DONE]" in raw if stream else bool(json.loads(raw).get("choices"))
            rows.append({"t": t, "s": round(now() - t, 3), "stream": stream, "ok": ok})
        except Exception as e:
            rows.append({"t": t, "s": round(now() - t, 3), "stream": stream, "ok": False, "error": str(e)[:200]})
        i += 1
        stop.wait(0.25)


def conversation(router: str, p_url: str, tag: str) -> dict:
    """Two turns (~4k tokens, then +300): turn 2's tokens pulled from D, read on P's /metrics."""
    msgs = [{"role": "user", "content": measure.filler(p_url, 4000, len(tag))}]
    _, raw = measure.chat(router, msgs, tag, False, 8)
    msgs += [{"role": "assistant", "content": measure.reply_of(raw, False)},
             {"role": "user", "content": measure.filler(p_url, 300, 7)}]
    ttft, m = measure.measured(p_url, lambda: measure.chat(router, msgs, tag, False, 1))
    return {"t": now(), "turn2_ms": round(1000 * ttft, 1), "pulled": m["pulled"], "xfer_ms": round(1000 * m["xfer_s"], 1)}


def state_of(name: str, proc: str) -> dict:
    return next(p for p in cluster_view(ClusterDir(name)).to_json()["processes"] if p["name"] == proc)


def main() -> int:
    config, out_dir = sys.argv[1], Path(sys.argv[2])
    recovery_timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 420
    cfg = yaml.safe_load(Path(config).read_text())
    name = cfg["name"]
    router, p_url = f"http://127.0.0.1:{cfg['router']['port']}", f"http://127.0.0.1:{cfg['prefill']['port']}"
    gpus, timeline, requests, res = [], [], [], {"name": name, "config": cfg}
    threads = [threading.Thread(target=sample_gpus, args=(gpus,), daemon=True),
               threading.Thread(target=watch, args=(name, timeline), daemon=True)]
    for t in threads:
        t.start()

    def save() -> None:
        res.update(timeline=timeline, gpu_mib=gpus, requests=requests)
        kills = os.environ.get("FAULTS_KILL", "decode-0").replace(",", "_")
        (out_dir / f"{name}-{kills}-faults.json").write_text(json.dumps(res, indent=1))

    def log(key: str, value) -> None:
        res[key] = value
        print(f"[{now():7.1f}s] {key}: {json.dumps(value)}", flush=True)
        save()

    log("gpu_mib_before_up", gpu_memory())
    if os.environ.get("FAULTS_ATTACH") != "1":
        up = pd("up", config)
        log("up", {"rc": up.returncode, "s": now(), "tail": (up.stdout + up.stderr)[-1500:]})
        if up.returncode != 0:
            stop.set()
            log("down", {"rc": pd("down", name).returncode})
            return 1
    load = threading.Thread(target=client, args=(router, requests), daemon=True)
    load.start()
    log("reuse_before", conversation(router, p_url, "before"))
    recovered_all = True
    for victim in os.environ.get("FAULTS_KILL", "decode-0").split(","):
        time.sleep(4)
        d = state_of(name, victim)
        restarts0, t_kill = d["restarts"], now()
        os.kill(d["pid"], signal.SIGKILL)      # the API server's pid only: its engine and workers are orphaned
        log(f"killed {victim}", {"t": t_kill, "pid": d["pid"], "gpu_mib": gpu_memory()})
        deadline = time.monotonic() + recovery_timeout
        while time.monotonic() < deadline:
            st = cluster_view(ClusterDir(name)).to_json()
            dd = next(p for p in st["processes"] if p["name"] == victim)
            if dd["restarts"] > restarts0 and dd["state"] == "ready" and st["phase"] == "running":
                break
            time.sleep(1)
        recovered = time.monotonic() < deadline
        recovered_all &= recovered
        t_back = now()
        during = [r for r in requests if t_kill - 1 <= r["t"] <= t_back]
        log(f"recovered {victim}", {"ok": recovered, "t": t_back, "s_after_kill": round(t_back - t_kill, 1),
                                    "gpu_mib": gpu_memory(), "requests": len(during),
                                    "failed": sum(not r["ok"] for r in during),
                                    "errors": sorted({r.get("error", "")[:80] for r in during if not r["ok"]})})
        if not recovered:
            break
        time.sleep(8)   # the router's health probe and breaker see the new server a few seconds after the supervisor
        log(f"reuse_after {victim}", conversation(router, p_url, f"after-{victim}"))
    time.sleep(3)
    stop.set()
    load.join(timeout=150)
    log("requests", {"total": len(requests), "failed": sum(not r["ok"] for r in requests),
                     "slowest_s": max((r["s"] for r in requests), default=None)})
    sup_log = (Path(os.environ["PDSERVE_HOME"]) / "clusters" / name / "logs" / "supervisor.log").read_text()
    log("supervisor_log", [ln for ln in sup_log.splitlines()
                           if re.search(r"degraded|running again|failed to start|restarting|stopped;|SIGKILL|"
                                        r"started, pid|ready$|fatal|leftover|still alive", ln)][-60:])
    log("peer_reset", "which may hold its memory" in sup_log)
    status = pd("status", name)
    log("status_after", status.stdout[-2500:])
    if os.environ.get("FAULTS_KEEP") == "1":
        save()
        return 0 if recovered_all else 1
    down = pd("down", name)
    log("down", {"rc": down.returncode, "output": (down.stdout + down.stderr)[-1500:]})
    time.sleep(2)
    log("gpu_mib_after_down", gpu_memory())
    save()
    return 0 if recovered_all and down.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
