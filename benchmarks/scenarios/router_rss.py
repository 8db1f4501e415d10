#!/usr/bin/env python3
"""The router's resident memory without buffered requests or reuse entries: the baseline the Kubernetes export
adds to router.max_buffered_mb and reuse_max_mb for the router pods' memory limit (ROUTER_BASELINE_MIB in
pdserve/export/k8s_memory.py). The real router process (`python -m pdserve.router`, as `pdserve up` starts
it) against fake vLLM servers (tests/kits/fake_vllm.py): its RSS once healthy, then after `--turns`
two-turn conversations (imports, pools, metrics and code paths warmed; the few entries they leave are small)
and its peak (VmHWM).

Usage: .venv/bin/python benchmarks/scenarios/router_rss.py [--turns 200] [--set KEY=JSON ...]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

from hostile_kit import fake, peak_rss_mb, router, rss_mb


def chat(url: str, conversation: int, turn: int) -> None:
    body = {"model": "fake", "max_tokens": 8, "user": f"c{conversation}",
            "messages": [{"role": "user", "content": f"conversation {conversation} turn {turn} " * 20}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=200, help="conversations of two turns each")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a router.json setting, e.g. otlp_endpoint='\"http://127.0.0.1:4318/v1/traces\"'")
    args = ap.parse_args()
    settings = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    with fake() as p, fake() as d, router([p], [d], **settings) as (proc, url):
        time.sleep(2.0)     # a few health rounds
        idle = rss_mb(proc.pid)
        for i in range(args.turns):
            chat(url, i, 0)
            chat(url, i, 1)
        time.sleep(1.0)
        print(f"router RSS: {idle:.1f} MiB idle once healthy; {rss_mb(proc.pid):.1f} MiB after {args.turns} "
              f"two-turn conversations (peak {peak_rss_mb(proc.pid):.1f} MiB)")


if __name__ == "__main__":
    main()
