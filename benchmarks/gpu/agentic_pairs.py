"""Two arms of one agentic workload, request by request (the generator is deterministic: the same conversation
and turn in both): each arm's TTFT, P leg and the rest (TTFT - P leg: D and the relay) p50/p90, then the paired
differences (A - B) of the P leg and TTFT, overall, per session, per source of A's KV (kv_source), per reuse
outcome the router reported for A's turn (X-PDServe-Reuse: an offer P's cache made moot is miss/prefix_cached).
  python3 agentic_pairs.py A-results.json B-results.json"""
import json
import statistics
import sys
from collections import defaultdict


def rows(path: str) -> dict:
    return {(r["conversation"], r["turn"]): r for r in json.load(open(path))["requests"]
            if r.get("ttft_s") is not None}


def q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


a, b = rows(sys.argv[1]), rows(sys.argv[2])
for name, arm in (("A", a), ("B", b)):
    legs = [r for r in arm.values() if r.get("prefill_s") is not None]
    ttft = [1000 * r["ttft_s"] for r in arm.values()]
    p_leg = [1000 * r["prefill_s"] for r in legs]
    rest = [1000 * (r["ttft_s"] - r["prefill_s"]) for r in legs]
    decide = [1000 * r["decide_s"] for r in arm.values() if r.get("decide_s") is not None]
    print(f"{name} {arm and next(iter(arm.values()))['arm']}: {len(arm)} answered; ms p50/p90: TTFT {q(ttft, .5):.0f}/"
          f"{q(ttft, .9):.0f}, P leg {q(p_leg, .5):.0f}/{q(p_leg, .9):.0f}, after P leg {q(rest, .5):.0f}/{q(rest, .9):.0f}"
          + (f", router's decision {q(decide, .5):.1f}/{q(decide, .9):.1f}" if decide else ""))
both = sorted(k for k in set(a) & set(b) if a[k].get("prefill_s") is not None and b[k].get("prefill_s") is not None)
leg = {k: 1000 * (a[k]["prefill_s"] - b[k]["prefill_s"]) for k in both}
ttft = {k: 1000 * (a[k]["ttft_s"] - b[k]["ttft_s"]) for k in both}
print(f"paired A - B over {len(both)} requests, median ms: P leg {statistics.median(leg.values()):+.0f}, "
      f"TTFT {statistics.median(ttft.values()):+.0f}")
for label, key in (("session", lambda k: a[k]["root"]), ("A's KV source", lambda k: a[k]["kv_source"]),
                   ("sub-agent", lambda k: bool(a[k]["agent"])),
                   ("A's reuse outcome (X-PDServe-Reuse; runs before it: -)", lambda k: a[k].get("reuse") or "-")):
    groups = defaultdict(list)
    for k in both:
        groups[key(k)].append(leg[k])
    print(f"  P leg by {label}: " + ", ".join(f"{g} {statistics.median(v):+.0f} (n {len(v)})"
                                             for g, v in sorted(groups.items(), key=lambda x: str(x[0]))))
