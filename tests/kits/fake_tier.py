"""The fake vLLM as a prefill server (P) with a CPU KV tier beside NIXL (issue 43 item 3), as vLLM's MultiConnector
composes them: NIXL first, so D's offer is read whenever NIXL takes it; the OffloadingConnector loads only when
NIXL loads nothing (the first child with tokens is chosen). pdserve's connector patch then reports the tier's
tokens under TIER_KEY, never under PULLED_KEY (pdserve/engine/patches.py).

- `--recompute-threshold T`: as vLLM's NIXL on P (kv_recompute_threshold), an offer of fewer than T tokens is
  left unread (D's blocks stay held until the router releases them).
- `--cpu-tier-tokens N`: the tier holds N tokens of every prompt (at most all but the last, which P computes).
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.router.wire import TIER_KEY

__all__ = ["TIER_KEY", "add_flags", "reads", "tier_tokens"]


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recompute-threshold", type=int, default=0, help="as P: D's offers below it go unread")
    p.add_argument("--cpu-tier-tokens", type=int, default=0, help="as P: tokens its CPU tier loads when none read")


def reads(args: argparse.Namespace, kv: dict[str, Any], prompt: list[int]) -> bool:
    return min(int(kv.get("remote_num_tokens", 0)), len(prompt) - 1) >= args.recompute_threshold


def tier_tokens(args: argparse.Namespace, kv: dict[str, Any], prompt: list[int], pulled: int) -> int:
    return min(args.cpu_tier_tokens, len(prompt) - 1) if kv.get("do_remote_decode") and not pulled else 0
