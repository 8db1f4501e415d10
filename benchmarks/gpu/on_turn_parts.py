"""The reused ("on") turn in parts, and its bound, alone and under load (issue 44, items 1 and 2).

  python3 on_turn_parts.py ROUTER P_URL D_URL OUT_DIR [--length 36864] [--new 1000] [--reps 5]
      [--load-config CFG --load-name NAME --workload W.json [--concurrency 4] [--probes 5]]

Alone: `reps` times a new conversation of LENGTH - NEW tokens (turn 1, not streamed, 8 tokens), then its turn 2
with NEW more tokens, streamed, 4 tokens: "on" (P pulls turn 1's KV from D) and the same request under a new id
("off": nothing to reuse, P's prefix cache off, so P computes it all). Each turn's parts are the servers' own
figures for it (sums of vLLM's per-request histograms on /metrics, read before and 0.5 s after the turn, with
nothing else running): client TTFT; the router's Server-Timing (decide; prefill = P's whole leg); P's queue
(it includes the wait for the pull), NIXL's transfer and post time, descriptors and bytes
(vllm:nixl_*), P's compute (vllm:request_prefill_time), P's front end (its TTFT minus queue and compute: the
API server's render and tokenization, from vLLM's arrival stamp at render_chat's start; "P before its TTFT" =
P leg - P's TTFT: HTTP and the body's parse); D's queue (it includes D's read of P's new blocks), D's first step, D's
front end, D's TTFT; "router other" = client TTFT - decide - P leg - D's TTFT (relay and HTTP between legs).
Then 3 prefills of the new suffix alone, straight to P (no history): the compute of NEW tokens without the
attention over the history.

The bound: P's compute of the new tokens in the "on" turn (median) + reading D's blocks at the best transfer
rate measured in the reps (pulled bytes / best bytes-per-second of vllm:nixl_xfer_time); also with D's first
step added. The turn's ratio to it is printed.

Under load (with --load-config): `pdserve bench LOAD_CONFIG --attach NAME --workload W --concurrency C --stream`
in the background (the issue's workload), PROBES 36k conversations sent during it (turn 1, then the streamed
"on" turn: client TTFT and the router's legs per probe; from 3 s in, 2 s apart, while the bench runs), and each part's mean per request over the whole load
window from the same histograms (sum/count deltas; vLLM's latency buckets are too coarse for a p50), with each
server's API-server CPU seconds per request (process_cpu_seconds_total: the front ends' render and
tokenization). The probes' own requests are in those means (2 of each ~170).

Writes OUT_DIR/parts.json and OUT_DIR/parts.txt (the table, printed last); under load also the bench's output
(load-bench.txt) and its results.json (load-results.json).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from measure import filler, reply_of

HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
              "ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds",
              "xfer": "vllm:nixl_xfer_time_seconds", "post": "vllm:nixl_post_time_seconds",
              "bytes": "vllm:nixl_bytes_transferred", "descs": "vllm:nixl_num_descriptors"}
ROUTER_HISTOGRAMS = {"ttft": "pdserve_router_ttft_seconds", "request": "pdserve_router_request_seconds",
                     "admission_wait": "pdserve_router_admission_wait_seconds"}
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|\+Inf)$", re.M)


def get(url: str, timeout: float = 30) -> str:
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def post(url: str, body: dict, timeout: float = 600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def scrape(url: str, histograms: dict[str, str]) -> dict[str, float]:
    """Each histogram's _sum and _count (summed over its labels), tokens by source, the API server's CPU."""
    values: dict[str, float] = {}
    for name, labels, value in LINE.findall(get(url + "/metrics")):
        values[name] = values.get(name, 0.0) + (float(value) if value[0].isdigit() else 0.0)
        if name == "vllm:prompt_tokens_by_source_total":
            key = "pulled" if "external_kv_transfer" in labels else "computed" if "local_compute" in labels else ""
            if key:
                values[key] = values.get(key, 0.0) + float(value)
    out = {"cpu_s": values.get("process_cpu_seconds_total", 0.0), "pulled": values.get("pulled", 0.0),
           "computed": values.get("computed", 0.0)}
    for key, name in histograms.items():
        out[key] = values.get(name + "_sum", 0.0)
        out[key + "_n"] = values.get(name + "_count", 0.0)
    return out


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


def model_of(*urls: str) -> str:
    for url in urls:
        try:
            return json.loads(get(url + "/v1/models"))["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            continue
    raise SystemExit(f"no served model name from {urls}")


def chat(router: str, model: str, messages: list, conv: str, stream: bool, max_tokens: int) -> dict:
    """One chat turn through the router: client TTFT (first content chunk), the router's Server-Timing legs."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "conversation_id": conv, "stream": stream}
    t0 = time.perf_counter()
    with post(router + "/v1/chat/completions", body) as resp:
        timing = {m.group(1): float(m.group(2))
                  for m in re.finditer(r"(\w+);dur=([0-9.]+)", resp.headers.get("Server-Timing", ""))}
        pulled = resp.headers.get("X-PDServe-Pulled-Tokens")
        if not stream:
            raw = resp.read().decode()
            first = time.perf_counter() - t0
        else:
            first, lines = None, []
            for line in resp:
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.perf_counter() - t0
                lines.append(line.decode())
            raw = "".join(lines)
            first = first or time.perf_counter() - t0
    return {"ttft_ms": 1000 * first, "legs": timing, "pulled_header": pulled, "raw": raw}


class Probe:
    def __init__(self, args, model: str):
        self.args, self.model = args, model

    def conversation(self, tag: str, seed: int) -> tuple[list, str]:
        """Turn 1 (not streamed) of a new conversation; returns turn 2's messages and the conversation id."""
        a = self.args
        conv = f"parts-{tag}-{seed}-{time.time_ns()}"
        msgs = [{"role": "user", "content": filler(a.p, a.length - a.new, a.length + 7 * seed)}]
        first = chat(a.router, self.model, msgs, conv, False, 8)
        msgs += [{"role": "assistant", "content": reply_of(first["raw"], False)},
                 {"role": "user", "content": filler(a.p, a.new, a.length + 7 * seed + 1)}]
        return msgs, conv

    def turn(self, msgs: list, conv: str) -> dict:
        """The streamed turn 2 with each server's own figures for it (nothing else running)."""
        a = self.args
        p0, d0 = scrape(a.p, HISTOGRAMS), scrape(a.d, HISTOGRAMS)
        got = chat(a.router, self.model, msgs, conv, True, 4)
        time.sleep(0.5)       # D's request ends after its 4 tokens: its histograms then hold it
        p, d = delta(p0, scrape(a.p, HISTOGRAMS)), delta(d0, scrape(a.d, HISTOGRAMS))
        return parts(got, p, d)


def ms(x: float) -> float:
    return round(1000 * x, 1)


def parts(got: dict, p: dict, d: dict) -> dict:
    decide, p_leg = got["legs"].get("decide", 0.0), got["legs"].get("prefill", 0.0)
    # P's pull inside its step (engine/sync_pull.py): vLLM's prefill time then spans the READ, which the bound
    # counts apart; a pull waited for in the queue (vLLM's asynchronous path) leaves the queue at least as long.
    in_step = p["xfer"] if p["xfer"] > 0 and p["queue"] < p["xfer"] else 0.0
    row = {"client_ttft": round(got["ttft_ms"], 1), "router_decide": decide, "p_leg": p_leg,
           "p_front_end": ms(p["ttft"] - p["queue"] - p["prefill"]), "p_queue": ms(p["queue"]),
           "pull_xfer": ms(p["xfer"]), "pull_post": ms(p["post"]), "p_compute": ms(p["prefill"] - in_step),
           "p_ttft": ms(p["ttft"]), "d_front_end": ms(d["ttft"] - d["queue"] - d["prefill"]),
           "d_queue": ms(d["queue"]), "d_read_xfer": ms(d["xfer"]), "d_first_step": ms(d["prefill"]),
           "d_ttft": ms(d["ttft"]), "pulled_tokens": p["pulled"], "computed_tokens": p["computed"],
           "pull_bytes": p["bytes"], "pull_descriptors": p["descs"], "pulls": p["xfer_n"],
           "p_cpu_ms": ms(p["cpu_s"]), "d_cpu_ms": ms(d["cpu_s"]), "pull_in_step": ms(in_step)}
    row["router_other"] = round(row["client_ttft"] - decide - p_leg - row["d_ttft"], 1)
    row["p_outside_ttft"] = round(p_leg - row["p_ttft"], 1)    # HTTP, body parse: before vLLM's arrival stamp
    return row


def suffix_prefill(args, model: str, reps: int = 3) -> list[float]:
    """P's compute of NEW tokens with no history: straight to P, a completion of the suffix alone."""
    out = []
    for rep in range(reps):
        p0 = scrape(args.p, HISTOGRAMS)
        text = filler(args.p, args.new, 99991 + rep)
        post(args.p + "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}).read()
        p = delta(p0, scrape(args.p, HISTOGRAMS))
        out.append(ms(p["prefill"]))
    return out


def median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 1) if vals else float("nan")


def alone(args, probe: Probe) -> dict:
    for warm in range(2):      # compile/warm shapes and the NIXL handshake outside the figures
        msgs, conv = probe.conversation("warm", warm)
        probe.turn(msgs, conv)
    rows = []
    for rep in range(args.reps):
        msgs, conv = probe.conversation("alone", rep)
        for arm, cid in (("on", conv), ("off", conv + "-off")):
            row = {"rep": rep, "arm": arm} | probe.turn(msgs, cid)
            print(json.dumps(row), flush=True)
            rows.append(row)
    on = [r for r in rows if r["arm"] == "on"]
    off = [r for r in rows if r["arm"] == "off"]
    rates = [r["pull_bytes"] / (r["pull_xfer"] / 1000) for r in on if r["pull_xfer"] > 0 and r["pull_bytes"] > 0]
    best_rate = max(rates) if rates else None
    suffix = suffix_prefill(args, probe.model)
    p_compute = median(on, "p_compute")
    read_ms = round(1000 * median(on, "pull_bytes") / best_rate, 1) if best_rate else None
    bound = round(p_compute + read_ms, 1) if read_ms is not None else None
    on_ttft, off_ttft = median(on, "client_ttft"), median(off, "client_ttft")
    return {"rows": rows, "on": {k: median(on, k) for k in on[0] if k not in ("rep", "arm")},
            "off": {k: median(off, k) for k in off[0] if k not in ("rep", "arm")},
            "off_on": round(off_ttft / on_ttft, 2) if on_ttft else None,
            "bound": {"p_compute_ms": p_compute, "suffix_alone_prefill_ms": suffix,
                      "best_rate_gbps": round(best_rate / 1e9, 1) if best_rate else None,
                      "read_ms_at_best_rate": read_ms, "bound_ms": bound,
                      "bound_with_d_step_ms": round(bound + median(on, "d_first_step"), 1) if bound else None,
                      "on_over_bound": round(on_ttft / bound, 2) if bound else None}}


def under_load(args, probe: Probe, out: Path) -> dict:
    load_dir = Path(tempfile.mkdtemp(prefix="parts-load-"))   # bench's csv and plots stay out of OUT_DIR
    cmd = [sys.executable, "-m", "pdserve", "bench", args.load_config, "--attach", args.load_name, "--workload",
           args.workload, "--concurrency", str(args.concurrency), "--stream", "--out", str(load_dir)]
    before = {"p": scrape(args.p, HISTOGRAMS), "d": scrape(args.d, HISTOGRAMS),
              "router": scrape(args.router, ROUTER_HISTOGRAMS)}
    t0 = time.time()
    log = open(out / "load-bench.txt", "w")
    bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    probes: list[dict] = []

    def probing():
        time.sleep(args.probe_start_s)
        for i in range(args.probes):
            if bench.poll() is not None:
                return
            msgs, conv = probe.conversation("load", i)
            got = chat(args.router, probe.model, msgs, conv, True, 4)
            row = {"probe": i, "client_ttft": round(got["ttft_ms"], 1), "router_decide": got["legs"].get("decide"),
                   "p_leg": got["legs"].get("prefill"), "pulled_header": got["pulled_header"]}
            row["after_p_leg"] = round(row["client_ttft"] - (row["router_decide"] or 0) - (row["p_leg"] or 0), 1)
            print(json.dumps(row), flush=True)
            probes.append(row)
            time.sleep(args.probe_gap_s)

    thread = threading.Thread(target=probing, daemon=True)
    thread.start()
    rc = bench.wait()
    thread.join(timeout=120)
    log.close()
    wall = time.time() - t0
    if (load_dir / "results.json").exists():
        shutil.copy(load_dir / "results.json", out / "load-results.json")
    after = {"p": scrape(args.p, HISTOGRAMS), "d": scrape(args.d, HISTOGRAMS),
             "router": scrape(args.router, ROUTER_HISTOGRAMS)}
    means = {}
    for role in ("p", "d", "router"):
        dd = delta(before[role], after[role])
        n = {k: dd[k + "_n"] for k in (HISTOGRAMS if role != "router" else ROUTER_HISTOGRAMS)}
        means[role] = {k: ms(dd[k] / n[k]) if n[k] else None for k in n if k not in ("bytes", "descs")}
        means[role]["requests"] = n["ttft"]
        if role != "router":
            means[role]["pulls"] = n["xfer"]
            means[role]["descriptors_per_pull"] = round(dd["descs"] / n["descs"], 1) if n["descs"] else None
            means[role]["gbps"] = round(dd["bytes"] / dd["xfer"] / 1e9, 1) if dd["xfer"] else None
            means[role]["pulled_tokens"], means[role]["computed_tokens"] = dd["pulled"], dd["computed"]
        means[role]["cpu_ms_per_request"] = ms(dd["cpu_s"] / n["ttft"]) if n["ttft"] else None
    for role in ("p", "d"):
        m = means[role]
        if None not in (m["ttft"], m["queue"], m["prefill"]):
            m["front_end"] = round(m["ttft"] - m["queue"] - m["prefill"], 1)
    return {"bench_rc": rc, "wall_s": round(wall, 1), "command": " ".join(cmd), "probes": probes,
            "probe_median": {k: median(probes, k) for k in ("client_ttft", "router_decide", "p_leg", "after_p_leg")},
            "means_per_request": means}


def table(res: dict) -> str:
    lines = []
    if "alone" in res:
        a = res["alone"]
        on, off, b = a["on"], a["off"], a["bound"]
        lines.append(f"ALONE: {res['length']} tokens (+{res['new']} new), streamed, median of {res['reps']}; ms")
        lines.append(f"{'part':<34}{'on':>10}{'off':>10}")
        for key, label in (("client_ttft", "client TTFT (first token)"), ("router_decide", "router: decide"),
                           ("router_other", "router: other (relay, HTTP)"), ("p_leg", "P leg (router-timed)"),
                           ("p_outside_ttft", "  P before its TTFT (HTTP, JSON)"),
                           ("p_front_end", "  P front end (render, tokenize)"), ("p_queue", "  P queue (incl. a queued pull)"),
                           ("pull_xfer", "    pull: NIXL transfer"), ("pull_post", "    pull: NIXL post"),
                           ("pull_in_step", "  P's step: its pull"), ("p_compute", "  P's step: compute"),
                           ("d_ttft", "D to first token"),
                           ("d_front_end", "  D front end"), ("d_queue", "  D queue (incl. its read)"),
                           ("d_read_xfer", "    D's read: NIXL transfer"), ("d_first_step", "  D first step"),
                           ("pulled_tokens", "tokens pulled by P"), ("computed_tokens", "tokens P computed"),
                           ("pull_descriptors", "NIXL descriptors (P)"), ("p_cpu_ms", "P API server CPU"),
                           ("d_cpu_ms", "D API server CPU")):
            lines.append(f"{label:<34}{on.get(key, float('nan')):>10}{off.get(key, float('nan')):>10}")
        lines.append(f"off/on {a['off_on']}x; suffix alone on P (no history) {b['suffix_alone_prefill_ms']} ms")
        lines.append(f"BOUND = P compute {b['p_compute_ms']} + read {b['read_ms_at_best_rate']} ms "
                     f"(at the best {b['best_rate_gbps']} GB/s) = {b['bound_ms']} ms (+ D first step: "
                     f"{b['bound_with_d_step_ms']}); on / bound = {b['on_over_bound']}x")
    if "load" in res:
        load = res["load"]
        m = load["means_per_request"]
        lines.append(f"UNDER LOAD: bench rc {load['bench_rc']}, {load['wall_s']} s; {len(load['probes'])} probes "
                     "(only while the bench ran), their median (ms): "
                     + ", ".join(f"{k} {v}" for k, v in load["probe_median"].items()))
        lines.append(f"{'mean per request (ms)':<34}{'P':>10}{'D':>10}")
        for key, label in (("ttft", "engine TTFT"), ("front_end", "front end"), ("queue", "queue"),
                           ("xfer", "NIXL transfer (per pull)"), ("post", "NIXL post (per pull)"),
                           ("prefill", "compute / first step"), ("e2e", "request e2e"),
                           ("cpu_ms_per_request", "API server CPU"), ("descriptors_per_pull", "descriptors a pull"),
                           ("gbps", "GB/s"), ("requests", "requests"), ("pulls", "pulls")):
            lines.append(f"{label:<34}{str(m['p'].get(key)):>10}{str(m['d'].get(key)):>10}")
        r = m["router"]
        lines.append(f"router: TTFT mean {r['ttft']} ms, admission wait mean {r['admission_wait']} ms, "
                     f"CPU {r['cpu_ms_per_request']} ms a request ({r['requests']} requests)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("router")
    ap.add_argument("p")
    ap.add_argument("d")
    ap.add_argument("out")
    ap.add_argument("--length", type=int, default=36864)
    ap.add_argument("--new", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-alone", action="store_true")
    ap.add_argument("--load-config")
    ap.add_argument("--load-name")
    ap.add_argument("--workload")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--probes", type=int, default=5)
    ap.add_argument("--probe-start-s", type=float, default=3.0)
    ap.add_argument("--probe-gap-s", type=float, default=2.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_of(args.router, args.p)
    probe = Probe(args, model)
    res: dict = {"length": args.length, "new": args.new, "reps": args.reps, "model": model}
    if not args.skip_alone:
        res["alone"] = alone(args, probe)
    if args.load_config:
        res["load"] = under_load(args, probe, out)
    (out / "parts.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (out / "parts.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
