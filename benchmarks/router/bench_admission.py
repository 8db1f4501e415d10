#!/usr/bin/env python3
"""What admission control costs a request it lets through, measured in-process (no network, so a busy
machine hardly moves it): Admission.enter + exit with every check on and none binding (per-tenant token
bucket and in-flight cap, global cap with a queue, the outcome counter), and the tenant hash of an
Authorization header. The whole router's cost per request with admission on and off is in
benchmarks/router/bench_router.py (arms pdserve and pdserve-admission).

Usage: .venv/bin/python benchmarks/router/bench_admission.py [-n 200000] [--tenants 1000]
"""

import argparse
import asyncio
import hashlib
import time

from pdserve.router.front.admission import Admission, Limits
from pdserve.router.telemetry.metrics import RouterMetrics

ALL_ON = Limits(max_in_flight=100_000, queue_size=100, tenant_max_in_flight=100_000, tenant_rate=1e9)


async def enter_exit(n: int, tenants: int) -> float:
    gate = Admission(ALL_ON, RouterMetrics())
    names = [f"t{i}" for i in range(tenants)]
    started = time.perf_counter()
    for i in range(n):
        tenant = names[i % tenants]
        await gate.enter(tenant)
        gate.exit(tenant)
    return (time.perf_counter() - started) / n


def tenant_hash(n: int) -> float:
    header = "Bearer sk-0123456789abcdef0123456789abcdef"
    started = time.perf_counter()
    for _ in range(n):
        hashlib.sha256(header.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return (time.perf_counter() - started) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=200_000, help="requests per measurement")
    ap.add_argument("--tenants", type=int, default=1000, help="distinct tenants, in turn")
    args = ap.parse_args()
    for rep in range(3):
        per = asyncio.run(enter_exit(args.n, args.tenants))
        print(f"run {rep}: admission enter+exit {1e6 * per:.2f} us/request ({args.tenants} tenants), "
              f"tenant hash {1e6 * tenant_hash(args.n):.2f} us")


if __name__ == "__main__":
    main()
