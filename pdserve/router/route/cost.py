"""Cost-aware reuse: learn whether pulling D's blocks is faster than recomputing them.

vLLM's only guard is a static token threshold, but a pull can be far slower than recompute (a NIXL
transport fallen back to TCP; figures in docs/router.md, "Cost-aware reuse"). So the router learns, from
the P legs it times itself:

- recompute cost per token, per prefill server: P-leg seconds / tokens P computed, on turns without a pull;
- pull cost per token, per (prefill, decode) pair: (P-leg seconds - recompute estimate for the tokens P
  still computed) / tokens P pulled, on turns with a pull.

The P leg is timed as P experiences it, transfer included; P's own `vllm:nixl_xfer_time_seconds` sums all
decode servers and overlapping requests, so it cannot be attributed to a pair or a turn. The recompute rate
is an exponential moving average. A pull's sample also carries whatever the turn waited in P's queue, and
under load that wait, spread over a follow-up's few pulled tokens, priced pulls as slower than recompute:
on one H200 under the 32k workload the guard sent 15 follow-ups to recompute 20-30k tokens each, which
lengthened P's queue for every other turn. Waiting only ever adds to a sample, so a pair's pull cost is the
fastest of its last `window` samples: what the transport did when nothing stood in front of it. A pair's
first pull (NIXL handshake included) is not a sample, nor is any pull that started before it ended
(concurrent first turns all wait for the same handshake). D's blocks are offered unless the pull is
predicted clearly (1.5x) slower than recompute; while it is, every `probe_every`-th candidate turn (or one
after `probe_interval` seconds) pulls anyway, and that measurement replaces the samples, so the router
follows the hardware both ways.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

MIN_SAMPLE_TOKENS = 32      # shorter legs are dominated by fixed overheads and would skew the rates
SLOWER_MARGIN = 1.5         # stop pulling only when a pull is predicted clearly slower: timings are noisy


class CostModel:
    def __init__(self, alpha: float = 0.3, probe_every: int = 8, probe_interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, window: int = 8):
        self.alpha = alpha
        self.window = window
        self.probe_every = probe_every
        self.probe_interval = probe_interval
        self.clock = clock
        self.recompute: dict[str, float] = {}             # prefill -> seconds per computed token
        self.pull: dict[tuple[str, str], float] = {}      # (prefill, decode) -> seconds per pulled token
        self._pull_samples: dict[tuple[str, str], deque[float]] = {}   # the pair's last `window` samples
        self._skipped: dict[tuple[str, str], int] = {}
        self._last_pull: dict[tuple[str, str], float] = {}
        self._probing: set[tuple[str, str]] = set()
        self._warm_at: dict[tuple[str, str], float] = {}   # pair -> when its first pull ended
        self.local: dict[str, float] = {}                  # decode -> seconds per token it computed alone
        self.d_base: dict[str, float] = {}                 # decode -> seconds to a D leg's first token

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, prefill: str, decode: str | None, seconds: float, prompt_tokens: int,
                cached_tokens: int, pulled: bool, pulled_tokens: int | None = None) -> None:
        """One successful P leg: `cached_tokens` were not computed (pulled from D, or P's prefix cache), of
        which `pulled_tokens` came from D (None: all of them). Only pulled tokens price a pull."""
        computed = max(0, prompt_tokens - cached_tokens)
        if not pulled or decode is None:
            if computed >= MIN_SAMPLE_TOKENS:
                self.recompute[prefill] = self._ewma(self.recompute.get(prefill), seconds / computed)
            return
        pair = (prefill, decode)
        now = self._last_pull[pair] = self.clock()
        if pair not in self._warm_at:
            # A pair's first pull includes NIXL's handshake and metadata exchange: not a transfer rate.
            self._warm_at[pair] = now
            return
        if now - seconds < self._warm_at[pair]:
            return   # it overlapped the first pull, so it waited for the same handshake
        moved = cached_tokens if pulled_tokens is None else pulled_tokens
        if moved < MIN_SAMPLE_TOKENS:
            return
        transfer = max(0.0, seconds - self.recompute.get(prefill, 0.0) * computed)
        samples = self._pull_samples.get(pair)
        if samples is None or pair in self._probing:
            # A re-probe measures hardware the samples may no longer describe: it replaces them.
            samples = self._pull_samples[pair] = deque(maxlen=self.window)
        self._probing.discard(pair)
        samples.append(transfer / moved)
        self.pull[pair] = min(samples)

    def should_pull(self, prefill: str, decode: str) -> bool:
        pair = (prefill, decode)
        recompute, pull = self.recompute.get(prefill), self.pull.get(pair)
        if recompute is None or pull is None or pull <= recompute * SLOWER_MARGIN:
            self._skipped[pair] = 0
            return True
        skipped = self._skipped.get(pair, 0)
        stale = self.clock() - self._last_pull.get(pair, 0.0) >= self.probe_interval
        if stale or skipped + 1 >= self.probe_every:
            self._skipped[pair] = 0
            self._probing.add(pair)
            return True
        self._skipped[pair] = skipped + 1
        return False

    # -- turns served on D alone (policy.ShortTurns) ----------------------------------------------
    def observe_first_token(self, decode: str, seconds: float) -> None:
        """A P-then-D turn's D leg, timed to its first streamed token: what any request costs on D before
        its first token (API server, prompt tokenization, scheduling, one step) when it computes nothing."""
        self.d_base[decode] = self._ewma(self.d_base.get(decode), seconds)

    def observe_local(self, decode: str, seconds: float, computed_tokens: int) -> None:
        """A turn served on D alone, timed to its first streamed token: D's own prefill rate, net of what
        its D leg would have cost anyway (observe_first_token). Gross, a short turn's rate is mostly that
        fixed part (on one H200 ~100 ms for ~150 tokens), which the P-then-D side pays too, so the rule
        would send turns to P that D serves faster. Unknown until a P-then-D D leg was timed."""
        base = self.d_base.get(decode)
        if computed_tokens >= MIN_SAMPLE_TOKENS and base is not None:
            self.local[decode] = self._ewma(self.local.get(decode), max(0.0, seconds - base) / computed_tokens)

    def prefill_rate(self) -> float | None:
        """Seconds per computed token of the fastest measured prefill server."""
        return min(self.recompute.values()) if self.recompute else None

    def local_rate(self, decode: str) -> float | None:
        """D's seconds per computed token: measured on D, else the prefill servers' (the same model)."""
        return self.local.get(decode, self.prefill_rate())

    def handover(self, decode: str, held_tokens: int) -> float | None:
        """Seconds a P leg spends on `held_tokens` of D's beyond computing (the pull and its overhead), at
        the fastest measured prefill server's rate for this decode server."""
        rates = [rate for (_, d), rate in self.pull.items() if d == decode]
        return min(rates) * held_tokens if rates else None
