"""Issue 32's scenario on the embedded default, as a user would run it: D's KV cache made small, more
conversations than it holds, two turns each, through the router with the official openai client.

    .venv/bin/python benchmarks/scenarios/held_kv_load.py --held-kv on|off [--conversations 12] [--rows 320] [--follow-rows 30]
        [--d-kv-bytes 24000000] [--timeout 60] [--order same|reverse] [--out FILE.json]

It writes a cluster file from the embedded default (configs/local-cpu.yaml: the tiny built-in model, 1P1D, one
core each) on free ports, with `--kv-cache-memory-bytes` on the decode server (and its VLLM_CPU_KVCACHE_SPACE
taken out: vLLM lets that override the flag) and `router.held_kv` on or off (off: D's fixed timer, as before
issue 32), runs `pdserve up`, sends turn 1 of every conversation one after another, then turn 2 of every
conversation (the same order, or the reverse), and always runs `pdserve down`. A turn 1 is one user message of
--rows table rows (~14 tokens a row: 320 rows ~ 4.6k tokens); a turn 2 adds the reply and --follow-rows more.
The client: timeout --timeout s, no retries, `conversation_id` set.

Printed (and with --out written as JSON): per turn its seconds, outcome, the tokens P pulled from D (the
router's X-PDServe-Pulled-Tokens), the P and D legs (Server-Timing) and the seconds D's request waited in D's
queue (vllm:request_queue_time_seconds: waiting for KV room, the issue's stall, apart from slow compute on a
busy machine); requests failed or over 10 s, and those that waited over 1 s in D's queue; the turns 2 that reused and the misses by reason
(the router's /metrics, turn 2s only); the most KV D itself listed as held (GET /pdserve/held, every 0.25 s, in
whole blocks) and the router's held-token gauge, against the budget (held_kv_share of D's capacity); the
router's releases by reason and renewals.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scenarios"))

from pdserve.observe.promtext import scrape, total  # noqa: E402
from vllm_pair import free_ports  # noqa: E402
from pdserve.observe.routerstats import read_router  # noqa: E402
from pdserve.spec.load import DEFAULT_CONFIG  # noqa: E402

SLOW_S = 10.0


def pdserve(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def cluster_file(args, name: str, folder: Path) -> tuple[Path, dict]:
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    ports = free_ports(5)
    cfg["name"] = name
    cfg["router"] = {**cfg.get("router", {}), "port": ports[0], "held_kv": args.held_kv == "on"}
    cfg["prefill"].update(port=ports[1], nixl_side_channel_port=ports[2])
    cfg["decode"].update(port=ports[3], nixl_side_channel_port=ports[4])
    cfg["decode"]["env"] = {k: v for k, v in (cfg["decode"].get("env") or {}).items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    cfg["decode"]["vllm_args"] = [*cfg["decode"]["vllm_args"], "--kv-cache-memory-bytes", str(args.d_kv_bytes)]
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


def rows(conv: int, turn: int, n: int) -> str:
    return f"Conversation {conv}, turn {turn}. " + " ".join(
        f"row {i}: value {(i * 17 + conv * 7 + turn) % 101} status ok;" for i in range(n))


class HeldWatch(threading.Thread):
    """Polls D's own list of held turns and the router's gauge; keeps the maxima."""

    def __init__(self, d_url: str, router_url: str, block_size: int):
        super().__init__(daemon=True)
        self.d_url, self.router_url, self.block_size = d_url, router_url, block_size
        self.max_d = self.max_router = self.max_count = 0
        self.samples = self.over = 0              # samples, and those where D listed more than the budget
        self.budget: int | None = None
        self.over_since: float | None = None
        self.longest_over = 0.0                   # the longest stretch D listed more than the budget (s)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.d_url + "/pdserve/held", timeout=5) as r:
                    listed = json.loads(r.read())
                tokens = sum(h.get("blocks") or 0 for h in listed["held"]) * self.block_size
                self.max_d = max(self.max_d, tokens)
                now = time.monotonic()
                if self.budget is not None and tokens > self.budget:
                    self.over += 1
                    self.over_since = self.over_since or now
                    self.longest_over = max(self.longest_over, now - self.over_since)
                else:
                    self.over_since = None
                self.max_count = max(self.max_count, listed["count"])
                stats = read_router(self.router_url, timeout=5) or {}
                self.max_router = max([self.max_router, *((stats.get("held_kv") or {}).get("tokens") or {}).values()])
                self.samples += 1
            except (OSError, ValueError, KeyError):
                pass
            self.stop.wait(0.25)


def queue_seconds(d_url: str) -> float | None:
    samples = scrape(d_url, 10)
    return None if samples is None else total(samples, "vllm:request_queue_time_seconds_sum")


def legs(server_timing: str | None) -> dict[str, float]:
    out = {}
    for part in (server_timing or "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[f"{name}_ms"] = float(dur)
    return out


def capacity(d_url: str) -> tuple[int | None, int | None]:
    from pdserve.router.kv.held_ledger import capacity_of
    with urllib.request.urlopen(d_url + "/metrics", timeout=10) as r:
        return capacity_of(r.read().decode())


def run(args) -> dict:
    from openai import OpenAI
    name = f"held-kv-load-{args.held_kv}"
    folder = Path(tempfile.mkdtemp(prefix="held-kv-load-"))
    path, cfg = cluster_file(args, name, folder)
    router = f"http://127.0.0.1:{cfg['router']['port']}"
    d_url = f"http://127.0.0.1:{cfg['decode']['port']}"
    started = time.monotonic()
    res = pdserve("up", str(path))
    up_s = time.monotonic() - started
    if res.returncode != 0:
        pdserve("down", name)
        raise SystemExit(f"pdserve up failed ({res.returncode}): {res.stderr[-3000:]}")
    try:
        cap, block = capacity(d_url)
        budget = int(cap * 0.5) if cap else None
        watch = HeldWatch(d_url, router, block or 32)
        watch.budget = budget
        watch.start()
        client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=args.timeout, max_retries=0)
        histories = {c: [{"role": "user", "content": rows(c, 1, args.rows)}] for c in range(args.conversations)}
        turns: list[dict] = []

        def send(c: int, turn: int) -> None:
            t0 = time.monotonic()
            row = {"conversation": c + 1, "turn": turn}
            queued = queue_seconds(d_url)
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=cfg["served_model_name"], messages=histories[c], max_tokens=16,
                    extra_body={"conversation_id": f"load-{c}"})
                resp = raw.parse()
                histories[c].append({"role": "assistant", "content": resp.choices[0].message.content})
                row.update(outcome="ok", prompt_tokens=resp.usage.prompt_tokens,
                           pulled=int(raw.headers.get("X-PDServe-Pulled-Tokens") or 0),
                           plan=raw.headers.get("X-PDServe-Plan"), **legs(raw.headers.get("Server-Timing")))
            except Exception as e:  # noqa: BLE001 - a failed request is a figure here
                row.update(outcome=type(e).__name__, pulled=0)
                histories[c].append({"role": "assistant", "content": "(no answer)"})
            row["seconds"] = round(time.monotonic() - t0, 2)
            after_q = queue_seconds(d_url)
            if queued is not None and after_q is not None:
                row["d_queue_s"] = round(after_q - queued, 2)
            turns.append(row)
            print(json.dumps(row), flush=True)

        for c in range(args.conversations):
            send(c, 1)
        between = read_router(router) or {}
        order = range(args.conversations) if args.order == "same" else reversed(range(args.conversations))
        for c in order:
            histories[c].append({"role": "user", "content": rows(c, 2, args.follow_rows)})
            send(c, 2)
        time.sleep(1.0)
        watch.stop.set()
        watch.join(timeout=10)
        after = read_router(router) or {}
    finally:
        down = pdserve("down", name)
        if down.returncode != 0:
            print(f"pdserve down {name} failed: {down.stderr[-1500:]}", file=sys.stderr)
    turn2 = [t for t in turns if t["turn"] == 2]
    misses2 = {k: v - (between.get("misses_by_reason") or {}).get(k, 0)
               for k, v in (after.get("misses_by_reason") or {}).items()}
    held = after.get("held_kv") or {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    return {
        "held_kv": args.held_kv, "commit": commit.strip(), "dirty": bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            cwd=ROOT).stdout.strip()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "args": vars(args), "up_s": round(up_s, 1),
        "d_capacity_tokens": cap, "block_size": block, "budget_tokens": budget,
        "requests": len(turns),
        "failed": sum(t["outcome"] != "ok" for t in turns),
        "failed_or_slow": sum(t["outcome"] != "ok" or t["seconds"] > SLOW_S for t in turns),
        "waited_in_d_queue_over_1s": sum(t.get("d_queue_s", 0) > 1 for t in turns),
        "d_queue_s_max": max((t.get("d_queue_s", 0) for t in turns), default=0),
        "seconds_max": max(t["seconds"] for t in turns), "turn1_seconds": [t["seconds"] for t in turns if t["turn"] == 1],
        "turn2_seconds": [t["seconds"] for t in turn2],
        "turn2_reused": sum(t.get("pulled", 0) > 0 for t in turn2),
        "turn2_hits_counted": (after.get("reuse_hits") or 0) - (between.get("reuse_hits") or 0),
        "turn2_misses_by_reason": {k: v for k, v in misses2.items() if v},
        "max_held_on_d_tokens": watch.max_d, "max_held_on_d_turns": watch.max_count,
        "max_router_held_tokens": watch.max_router, "held_samples": watch.samples,
        "samples_d_over_budget": watch.over, "longest_d_over_budget_s": round(watch.longest_over, 2),
        "releases": held.get("releases"), "renewals": held.get("renewals"),
        "turn_outcomes": after.get("turn_outcomes"), "turns": turns,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--held-kv", choices=("on", "off"), default="on", help="router.held_kv")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--rows", type=int, default=320, help="table rows in turn 1 (~14 tokens each)")
    ap.add_argument("--follow-rows", type=int, default=30, help="table rows added by turn 2")
    ap.add_argument("--d-kv-bytes", type=int, default=24_000_000, help="decode's --kv-cache-memory-bytes")
    ap.add_argument("--timeout", type=float, default=60.0, help="the client's timeout per request (s)")
    ap.add_argument("--order", choices=("same", "reverse"), default="same", help="turn 2s' order")
    ap.add_argument("--out", help="write the figures here as JSON")
    args = ap.parse_args()
    result = run(args)
    summary = {k: v for k, v in result.items() if k not in ("turns", "args")}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
