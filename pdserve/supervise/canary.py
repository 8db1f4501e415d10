"""The canary: a small conversation through the router that must move KV from P to D, and back.

Ports answering is not enough: a NIXL path that cannot transfer (wrong side-channel host, UCX fallen back
or broken, a stale agent after a restart) still answers /health. The canary compares the decode servers'
own `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` before and after one request.
It also times the transfers: each direction's rate is the bytes NIXL moved over the time those transfers
took (the deltas of vLLM's `nixl_bytes_transferred` and `nixl_xfer_time_seconds` across the canary's own
transfers; vLLM's logged throughput sums per-transfer rates, vLLM #48224). With reuse on, a second turn
makes P pull the first one back from D: its first turn is sized past the router's `kv_recompute_threshold` and
its second past `decode_only_max_tokens`, so that pull is due on every config, and a second turn that pulls
nothing fails (a D->P path never proven is not a working one). A path that works but at a rate below the
plan's floor (on GPUs: UCX's TCP emulation, slower than recomputing) fails: a deployment slower than one
without P-D is no success.
"""

from __future__ import annotations

import json
import time
import logging
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from pdserve.observe import transfer
from pdserve.observe.promtext import Samples, api_key_of, auth_headers, has, scrape, total
from pdserve.plan.records import ClusterPlan
from pdserve.roles import DECODE, PREFILL, SERVER_ROLES
from pdserve.router.config import RouterConfig
from pdserve.router.wire import PULLED_HEADER
from pdserve.spec.canary_size import CANARY_ITEMS, canary_items
from pdserve.supervise.process import ManagedProcess

log = logging.getLogger("pdserve.supervisor")

CANARY_TRIES = 3
CANARY_PAUSE = 2.0

BY_SOURCE = "vllm:prompt_tokens_by_source_total"

FLOOR_HINT = ("the transport is emulated or misrouted: for GPU buffers over UCX keep UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y "
              "(pdserve sets it unless a server's env says otherwise), check UCX_TLS and the NIXL backend "
              "(LIBFABRIC on EFA); `kv_transfer.min_transfer_gbps: 0` accepts a slow transport")


def canary_text(items: int = CANARY_ITEMS) -> str:
    """Fresh text each time, varied from its first token: D's prefix cache held a repeated canary, so D
    read only the last 2 tokens from P and the check proved almost nothing."""
    return f"{uuid.uuid4().hex} pdserve canary: " + " ".join(f"check {i}" for i in range(items))


@dataclass(frozen=True)
class Reading:
    """One server's NIXL counters: tokens loaded from another server, bytes read, seconds reading, reads."""
    tokens: float | None
    moved: float
    seconds: float
    reads: float


def reading(url: str) -> Reading | None:
    samples: Samples | None = scrape(url)
    if samples is None:
        return None
    tokens = total(samples, BY_SOURCE, source="external_kv_transfer") if has(samples, BY_SOURCE) else None
    moved = transfer.from_samples(samples)
    return Reading(tokens, moved.moved, moved.seconds, moved.reads)


@dataclass(frozen=True)
class Leg:
    """What the servers of one role read during one canary turn."""
    tokens: float
    moved: float
    seconds: float
    reads: float

    @property
    def gbps(self) -> float | None:
        return transfer.Transfers(self.moved, self.seconds, self.reads).gbps

    def describe(self, direction: str) -> str:
        rate = f" at {self.gbps:.2f} GB/s ({self.moved / 1e6:.1f} MB in {1000 * self.seconds:.1f} ms)" \
            if self.gbps is not None else ""
        return f"{direction} {self.tokens:.0f} tokens{rate}"


def leg(before: list[Reading | None], after: list[Reading | None]) -> Leg:
    pairs = [(b, a) for b, a in zip(before, after) if a is not None and b is not None]
    return Leg(sum((a.tokens or 0) - (b.tokens or 0) for b, a in pairs), sum(a.moved - b.moved for b, a in pairs),
               sum(a.seconds - b.seconds for b, a in pairs), sum(a.reads - b.reads for b, a in pairs))


@dataclass(frozen=True)
class CanaryResult:
    ok: bool
    detail: str
    to_decode: Leg | None = None       # P->D, read by D
    to_prefill: Leg | None = None      # D->P, pulled by P on the second turn
    slow: bool = False                 # it worked, below the floor


def _chat(router_url: str, headers: dict[str, str], body: dict, timeout: float) -> tuple[dict, dict[str, str]]:
    """One turn; refused by the router's admission control (429/503 with Retry-After), asked again after
    the wait it names while `timeout` allows: the canary is a request like any other (its tenant is the
    cluster's API key, or no key), and a busy deployment is not a broken one."""
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(router_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read()), dict(resp.headers)
        except urllib.error.HTTPError as err:
            wait = err.headers.get("Retry-After", "") if err.code in (429, 503) else ""
            if not wait.isdigit() or time.monotonic() + int(wait) > deadline:
                raise
            err.close()
            time.sleep(int(wait))


def run_canary(router_url: str, decode_urls: list[str], model: str, api_key: str | None = None,
               timeout: float = 120.0, prefill_urls: list[str] | None = None,
               floor_gbps: float = 0.0, pull_threshold: int = 0, decode_only_max_tokens: int = 0) -> CanaryResult:
    """The P->D turn; with `prefill_urls` (reuse on) a second turn that P must pull from D: the first turn
    holds more than `pull_threshold` tokens (the router's kv_recompute_threshold) and the second brings more
    than `decode_only_max_tokens` new ones (else the router serves it on D alone). A measured rate below
    `floor_gbps` (0: no floor) fails as slow."""
    headers = {"Content-Type": "application/json", **auth_headers(api_key)}
    # No conversation id: the first turn then has no entry to look up (a named conversation would count a
    # no_entry miss), and the second is found by its history, as an unmodified client's is.
    first_items = canary_items(pull_threshold) if prefill_urls else CANARY_ITEMS
    messages = [{"role": "user", "content": canary_text(first_items)}]
    # Each turn its own vLLM cache_salt: with P's prefix cache on, P kept turn 1's blocks from its own prefill
    # and the second turn would find them there and pull nothing from D (the D->P path unproven).
    body = {"model": model, "max_tokens": 2, "messages": messages, "cache_salt": uuid.uuid4().hex}
    readings = lambda urls: [reading(u) for u in urls]  # noqa: E731
    before = readings(decode_urls)
    router_pulled = None   # X-PDServe-Pulled-Tokens of the second turn: what the router says P read
    try:
        reply, _ = _chat(router_url, headers, body, timeout)
        to_decode = leg(before, readings(decode_urls))
        to_prefill = None
        if prefill_urls and to_decode.tokens > 0:
            p_before = readings(prefill_urls)
            message = (reply.get("choices") or [{}])[0].get("message") or {"role": "assistant", "content": ""}
            follow_up = {"role": "user", "content": canary_text(canary_items(decode_only_max_tokens + 1))}
            _, answer_headers = _chat(router_url, headers, {**body, "messages": [*messages, message, follow_up],
                                                            "cache_salt": uuid.uuid4().hex}, timeout)
            router_pulled = answer_headers.get(PULLED_HEADER)
            to_prefill = leg(p_before, readings(prefill_urls))
    except urllib.error.HTTPError as err:
        return CanaryResult(False, f"canary request failed: HTTP {err.code} "
                                   f"{err.read()[:300].decode(errors='replace')}")
    except (urllib.error.URLError, OSError, ValueError) as err:
        return CanaryResult(False, f"canary request failed: {err}")
    if to_decode.tokens <= 0:
        if all(r is None or r.tokens is None for r in readings(decode_urls)):
            return CanaryResult(False, "decode servers export no vllm:prompt_tokens_by_source_total metric; "
                                       "cannot verify KV transfer")
        return CanaryResult(False, "canary answered but no KV reached a decode server (check NIXL: side-channel "
                                   "host/ports, UCX)", to_decode)
    said = [to_decode.describe("P->D")]
    if to_prefill is not None and to_prefill.tokens <= 0:
        why = (f"the router counted {router_pulled} tokens read but P's counters show none"
               if router_pulled and router_pulled != "0"
               else "P read nothing of the first turn (the router's reuse reasons: `pdserve status`)")
        return CanaryResult(False, f"canary moved {said[0]}, but no KV came back D->P on its second turn: {why} "
                                   f"(check decoder_kv_blocks_ttl, NIXL on the prefill servers)", to_decode, to_prefill)
    if to_prefill is not None:
        said.append(to_prefill.describe("D->P"))
    detail = "canary moved " + ", ".join(said)
    slow = [d for d, lg in (("P->D", to_decode), ("D->P", to_prefill))
            if floor_gbps and lg is not None and lg.gbps is not None and lg.gbps < floor_gbps]
    if slow:
        return CanaryResult(False, f"{detail}: {' and '.join(slow)} below the floor of {floor_gbps:g} GB/s "
                                   f"(kv_transfer.min_transfer_gbps); {FLOOR_HINT}", to_decode, to_prefill, True)
    return CanaryResult(True, detail, to_decode, to_prefill)


def canary_of_plan(plan: ClusterPlan, floor_gbps: float | None = None) -> CanaryResult:
    """The canary through a planned cluster's router, checked on its servers (`up` and `doctor`);
    `floor_gbps` None: the plan's own floor."""
    cfg = RouterConfig.from_dict(plan.router_config)     # as the router reads it: its defaults, in one place
    urls = {role: [p.url for p in plan.processes if p.role == role] for role in SERVER_ROLES}
    return run_canary(plan.router_url, urls[DECODE], cfg.model, api_key_of(plan.router_config),
                      timeout=min(cfg.request_timeout, 120.0),
                      prefill_urls=urls[PREFILL] if cfg.bidirectional_kv_xfer else None,
                      floor_gbps=plan.transfer_floor_gbps if floor_gbps is None else floor_gbps,
                      pull_threshold=cfg.kv_recompute_threshold,
                      decode_only_max_tokens=cfg.decode_only_max_tokens if cfg.decode_only else 0)


def plan_canary(plan: ClusterPlan) -> tuple[bool, str]:
    result = canary_of_plan(plan)
    return result.ok, result.detail


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
            if PREFILL in roles:
                decode = [p.name for p in procs if p.role == DECODE and p.name not in restart_queue]
                log.warning("restarting %s: KV reads keep failing after a prefill restart", ", ".join(decode))
                restart_queue.extend(decode)
