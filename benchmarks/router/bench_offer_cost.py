"""What an engine-checked offer of D's blocks costs P (docs/router.md, "What an offer costs P"): the router hands
P D's whole sequence under wire.EXPECT_KEY, P's API server parses the body (JSON, then vLLM's own
ChatCompletionRequest), the params go to the engine core by msgpack, and the engine core's scheduler cuts the offer
to the common prefix with the prompt (engine/patches.cut_offer), once per offered turn. Times each part for a
history of N tokens, as the checkout on PYTHONPATH sends it (wire.pack_ids where it exists, else a JSON list), so
two commits compare by running this from each (the router's part runs on the router, the rest on P):
  .venv/bin/python benchmarks/router/bench_offer_cost.py [--tokens 106000] [--reps 20]
  PYTHONPATH=/tmp/old .venv/bin/python /tmp/old/benchmarks/router/bench_offer_cost.py   # another commit's tree"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import msgspec
import orjson

from pdserve.engine import patches
from pdserve.router import wire

try:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
except ImportError:                             # older vLLM
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest


def timed(fn, reps: int) -> float:
    """Median ms of `reps` calls."""
    runs = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        runs.append(1000 * (time.perf_counter() - started))
    return statistics.median(runs)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--tokens", type=int, default=106_000, help="D's sequence and P's prompt (default: the H200 "
                                                               "agentic run's p50 prompt)")
    a.add_argument("--reps", type=int, default=20)
    args = a.parse_args()
    rng = random.Random(0)
    seq = [rng.randrange(151_000) for _ in range(args.tokens)]
    prompt = seq + [rng.randrange(151_000) for _ in range(700)]    # the next turn: D's sequence + new tokens
    offered, block = len(seq) - 1, 64
    packed = hasattr(wire, "pack_ids")
    expect = wire.pack_ids(seq[:offered]) if packed else list(seq[:offered])
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d", "remote_host": "h",
              "remote_port": 1, "remote_request_id": "d-1", "remote_num_tokens": offered,
              "remote_block_ids": [list(range(-(-offered // block)))], wire.EXPECT_KEY: expect}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                       "kv_transfer_params": params}).encode()
    encoded = msgspec.msgpack.encode(params)
    parsed = json.loads(body)

    def check():
        patches.cut_offer(dict(params), prompt, block)

    common = patches.cut_offer(dict(params), prompt, block)
    def router_side():
        value = wire.pack_ids(seq[:offered]) if packed else list(seq[:offered])
        orjson.dumps({**parsed, "kv_transfer_params": {**params, wire.EXPECT_KEY: value}})

    parts = {
        "router: the sequence's value + P's body (orjson)": timed(router_side, args.reps),
        "P's API server: JSON parse of the body": timed(lambda: json.loads(body), args.reps),
        "P's API server: vLLM's ChatCompletionRequest": timed(
            lambda: ChatCompletionRequest.model_validate(parsed), args.reps),
        "to the engine core: msgpack encode + decode": timed(
            lambda: msgspec.msgpack.decode(msgspec.msgpack.encode(params)), args.reps),
        "engine core's scheduler: cut_offer": timed(check, args.reps),
    }
    print(f"EXPECT_KEY as {'pack_ids (one string)' if packed else 'a JSON list'}: {args.tokens:,} tokens, body "
          f"{len(body) / 1e6:.2f} MB, msgpack {len(encoded) / 1e6:.2f} MB; the check found {common:,} in common")
    for name, ms in parts.items():
        print(f"  {name:<48} {ms:8.2f} ms")
    print(f"  {'total (median of ' + str(args.reps) + ' each)':<48} {sum(parts.values()):8.2f} ms")


if __name__ == "__main__":
    main()
