"""Drive many distinct conversations through the reuse table and print throughput and RSS as it fills.

Part 1: 1M conversations straight through `ReuseStore` (each turn: look up the conversation, miss, store
D's handles with a token sequence), as the router does for every new conversation.
Part 2: a shorter run through the router itself (in-process, fake vLLM backends), distinct
conversation ids, concurrent clients.

Flat throughput and a flat RSS once the table is full mean that the bounds hold and that no operation
scans the table. Run: .venv/bin/python benchmarks/router/bench_reuse_table.py [--store-n 1000000] [--router-n 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pdserve.router.kv.store_memory import MemoryTable as ReuseStore  # noqa: E402

PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "e",
          "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "remote_num_tokens": 255,
          "remote_block_ids": [list(range(16))]}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_store(n: int, every: int, tokens: int, max_entries: int, max_bytes: int) -> None:
    store = ReuseStore(ttl=432.0, max_entries=max_entries, max_bytes=max_bytes)
    sequence = list(range(tokens))
    print(f"store: {n} distinct conversations, {tokens} tokens each, bounds {max_entries} entries / "
          f"{max_bytes / 2**20:.0f} MiB")
    print(f"{'conversations':>14} {'ops/s':>10} {'entries':>9} {'est MiB':>8} {'RSS MiB':>8}")
    started = time.perf_counter()
    for i in range(n):
        store.take_first([("tenant", f"conv-{i}")])
        store.put(("tenant", f"conv-{i}"), PARAMS, "decode-0", 0, sequence)
        if (i + 1) % every == 0:
            now = time.perf_counter()
            print(f"{i + 1:>14} {every / (now - started):>10.0f} {len(store):>9} {store.bytes / 2**20:>8.1f} "
                  f"{rss_mib():>8.1f}", flush=True)
            started = now


async def bench_router(n: int, every: int, concurrency: int, max_entries: int) -> None:
    import aiohttp

    from tests.kits.router_rig import deployment
    print(f"\nrouter: {n} requests with distinct conversation ids, {concurrency} clients, "
          f"reuse_max_entries {max_entries} (router, fake backends and clients in this one process)")
    print(f"{'requests':>9} {'req/s':>8} {'entries':>8} {'RSS MiB':>8}")
    async with deployment(prefill_args=(["--no-record"],), decode_args=(["--no-record"],),
                          reuse_max_entries=max_entries) as dep:
        from pdserve.router.front.app import FLOW
        store = dep.router[FLOW].store
        counter = iter(range(n))
        done = 0
        started = time.perf_counter()

        async def client(session: aiohttp.ClientSession) -> None:
            nonlocal done, started
            for i in counter:
                body = {"model": "fake", "messages": [{"role": "user", "content": f"hello {i} " * 20}],
                        "max_tokens": 4, "conversation_id": f"conv-{i}"}
                async with session.post(dep.url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                done += 1
                if done % every == 0:
                    now = time.perf_counter()
                    print(f"{done:>9} {every / (now - started):>8.0f} {len(store):>8} {rss_mib():>8.1f}", flush=True)
                    started = now

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            await asyncio.gather(*(client(session) for _ in range(concurrency)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store-n", type=int, default=1_000_000)
    p.add_argument("--store-every", type=int, default=100_000)
    p.add_argument("--tokens", type=int, default=256, help="token ids per stored sequence")
    p.add_argument("--max-entries", type=int, default=100_000)
    p.add_argument("--max-mib", type=int, default=256)
    p.add_argument("--router-n", type=int, default=20_000)
    p.add_argument("--router-every", type=int, default=2_000)
    p.add_argument("--router-max-entries", type=int, default=5_000)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    if args.store_n:
        bench_store(args.store_n, args.store_every, args.tokens, args.max_entries, args.max_mib * 2**20)
    if args.router_n:
        asyncio.run(bench_router(args.router_n, args.router_every, args.concurrency, args.router_max_entries))


if __name__ == "__main__":
    main()
