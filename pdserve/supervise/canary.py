"""The canary: one small request through the router that must move KV from P to D.

Ports answering is not enough: a NIXL path that cannot transfer (wrong side-channel host, UCX fallen back
or broken, a stale agent after a restart) still answers /health. The canary compares the decode servers'
own `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` before and after one request.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future

from pdserve.observe.promtext import api_key_of, auth_headers, has, scrape, total
from pdserve.plan.records import ClusterPlan
from pdserve.supervise.process import ManagedProcess

log = logging.getLogger("pdserve.supervisor")

CANARY_TRIES = 3
CANARY_PAUSE = 2.0

BY_SOURCE = "vllm:prompt_tokens_by_source_total"

# Long enough to fill at least one KV block on every backend (CPU blocks are 128 tokens).
CANARY_TEXT = "pdserve canary: " + " ".join(f"check {i}" for i in range(160))


def canary_text() -> str:
    """Fresh text each time, varied from its first token: D's prefix cache held a repeated canary, so D
    read only the last 2 tokens from P and the check proved almost nothing."""
    return f"{uuid.uuid4().hex} {CANARY_TEXT}"


def external_tokens(url: str) -> float | None:
    """Tokens this server loaded from another server's KV (None when it exports no such metric)."""
    samples = scrape(url)
    if samples is None or not has(samples, BY_SOURCE):
        return None
    return total(samples, BY_SOURCE, source="external_kv_transfer")


def run_canary(router_url: str, decode_urls: list[str], model: str, api_key: str | None = None,
               timeout: float = 120.0) -> tuple[bool, str]:
    """(passed, what happened)."""
    before = [external_tokens(u) for u in decode_urls]
    headers = {"Content-Type": "application/json",
               **auth_headers(api_key)}
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": canary_text()}]})
    req = urllib.request.Request(router_url + "/v1/chat/completions", data=body.encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as err:
        return False, f"canary request failed: HTTP {err.code} {err.read()[:300].decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as err:
        return False, f"canary request failed: {err}"
    after = [external_tokens(u) for u in decode_urls]
    moved = sum((a or 0) - (b or 0) for a, b in zip(after, before))
    if moved > 0:
        return True, f"canary moved {moved:.0f} tokens of KV from prefill to decode"
    if all(a is None for a in after):
        return False, "decode servers export no vllm:prompt_tokens_by_source_total metric; cannot verify KV transfer"
    return False, "canary answered but no KV reached a decode server (check NIXL: side-channel host/ports, UCX)"


def plan_canary(plan: ClusterPlan) -> tuple[bool, str]:
    """The canary through a planned cluster's router, checked on its decode servers."""
    cfg = plan.router_config
    decode = [p.url for p in plan.processes if p.role == "decode"]
    return run_canary(plan.router.url, decode, cfg.get("model", ""), api_key_of(cfg),
                      timeout=min(float(cfg.get("request_timeout", 120.0)), 120.0))


class CanaryGate:
    """The supervisor's canaries: one at a time on the executor, at most every CANARY_PAUSE s after a
    failure; CANARY_TRIES failures in a row are out of tries, and the count starts over. At start-up, out
    of tries fails `up`; after a prefill restart, a pair that keeps failing has its decode servers
    restarted (they hold stale NIXL agent state); after a decode restart it does not."""

    def __init__(self, executor: Executor, canary: Callable[[ClusterPlan], tuple[bool, str]]):
        self.executor, self.canary = executor, canary
        self.failures = 0
        self._next_try = 0.0
        self._future: Future | None = None

    def try_once(self, now: float, plan: ClusterPlan) -> tuple[bool, str, bool] | None:
        """None while waiting or running, else (passed, what happened, out of tries)."""
        if self._future is None:
            if now < self._next_try:
                return None
            self._future = self.executor.submit(self.canary, plan)
        if not self._future.done():
            return None
        future, self._future = self._future, None
        try:
            ok, detail = future.result()
        except Exception as err:      # a canary that crashed is a failed canary, not a dead supervisor
            ok, detail = False, f"canary error: {err!r}"
        if ok:
            self.failures = 0
            return True, detail, False
        self.failures += 1
        self._next_try = now + CANARY_PAUSE
        out_of_tries = self.failures >= CANARY_TRIES
        if out_of_tries:
            self.failures = 0
        return False, detail, out_of_tries

    def at_start(self, now: float, plan: ClusterPlan) -> tuple[bool, str | None]:
        """(passed, why `up` fails once out of tries): backends may still be warming up."""
        tried = self.try_once(now, plan)
        if tried is None:
            return False, None
        ok, detail, out_of_tries = tried
        log.info("%s", detail)
        return ok, detail if out_of_tries else None

    def after_restart(self, now: float, plan: ClusterPlan, verify: set[str], procs: list[ManagedProcess],
                      restart_queue: deque[str]) -> None:
        """Check the P->D path after `verify` (prefill or decode servers) restarted; clears `verify` once
        decided, and queues the decode servers' restart when a prefill restart left the path failing."""
        tried = self.try_once(now, plan)
        if tried is None:
            return
        ok, detail, out_of_tries = tried
        restarted = ", ".join(sorted(verify))
        if ok:
            log.info("after restarting %s: %s", restarted, detail)
            verify.clear()
            return
        log.warning("after restarting %s: %s", restarted, detail)
        if out_of_tries:
            roles = {p.role for p in procs if p.name in verify}
            verify.clear()
            if "prefill" in roles:
                decode = [p.name for p in procs if p.role == "decode" and p.name not in restart_queue]
                log.warning("restarting %s: KV reads keep failing after a prefill restart", ", ".join(decode))
                restart_queue.extend(decode)
