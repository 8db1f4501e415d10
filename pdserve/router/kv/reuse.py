"""What the router remembers of D's finished turn (ReuseEntry), and the decision to offer it to P.

Where entries are kept is the store's business (store.py: in memory, or shared in Redis); they are
single-use and expire on the store's clock safely before D's decoder_kv_blocks_ttl.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.router.wire import DECODE_ONLY, EXPECT_KEY, pack_ids

HIT = "hit"
MISS = "miss"
# A conversation's first turn (its history holds no earlier model output: WireFormat.first_turn) that reused
# nothing, counted apart from the misses with the decision's reason (mostly no_entry): there was nothing of it to
# reuse, so it stays out of the hit rate. A first turn that did read D's KV (a shared prefix) is a hit.
FIRST = "first"
ENGINE_CHECKED = "engine_checked"   # a hit offered with D's sequence for P's engine to cut (wire.EXPECT_KEY)
UNVERIFIED = "unverified"   # a hit: D's entry taken, the new prompt not tokenized (route.policy.new_tokens_bound)
CONTINUATION = "continuation"       # a hit: the new prompt continues D's sequence
TRIMMED = "trimmed"                 # a hit: only a prefix of D's sequence is the new prompt's
# a hit served on D alone (route plan decode_only): D's prefix cache holds the history, D computes the new tokens
HIT_REASONS = (CONTINUATION, TRIMMED, ENGINE_CHECKED, UNVERIFIED, DECODE_ONLY)
DECODE_FAILED = "decode_failed"     # a miss: planned on D alone, but D did not answer it (served otherwise, or failed)
NO_ENTRY = "no_entry"               # a miss: nothing stored for the follow-up (used, expired, evicted, restarted)
CPU_TIER = "cpu_tier"               # a miss of D's offer: P read none of it, it loaded the prompt from its own CPU
                                    #   KV tier instead (wire.TIER_KEY), e.g. D's part below NIXL's threshold there


@dataclass
class ReuseEntry:
    params: dict[str, Any]               # D's kv_transfer_params from the previous turn
    decode: str                          # the decode backend holding the blocks
    generation: int | None               # that backend's generation when the entry was made (None: a shared
                                         #   store's entry, whose replicas each count generations their own way)
    expires: float                       # router clock (monotonic seconds)
    sequence: Sequence[int] | None = None   # D's prompt + generated token ids, when the backend returned them
    size: int = 0                        # estimated bytes held (for the store's byte bound)
    alias: tuple[str, str] | None = None   # its second key, the prompt's (identity.prompt_key; the memory table's)
    by_prompt: bool = False              # taken by the prompt key: the client's reply may differ from D's
    continued: bool = False              # its conversation came back (held.py's lease keeps only those)

    @property
    def num_tokens(self) -> int:
        return int(self.params.get("remote_num_tokens") or 0)


@dataclass(frozen=True)
class Decision:
    result: str                          # hit | miss
    reason: str                          # why (for hits: one of HIT_REASONS)
    params: dict[str, Any] | None = None
    tokens: int = 0
    holder: str | None = None            # decode server that held the blocks (its prefix cache is warm)
    prompt_tokens: int | None = None     # the new prompt's length, when it was tokenized for the decision


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix, by slice comparisons (C loops: a 100k-token history is compared in well
    under a millisecond where an id-by-id Python loop took ~10 ms): the whole first, then halving the span
    that holds the first difference. A list beside an array (which never compare equal), or arrays of two
    types, are made arrays of one type first; what cannot be one goes id by id."""
    n = min(len(a), len(b))
    try:
        if isinstance(a, array) and not (isinstance(b, array) and b.typecode == a.typecode):
            b = array(a.typecode, b[:n])
        elif isinstance(b, array) and not isinstance(a, array):
            a = array(b.typecode, a[:n])
    except (TypeError, OverflowError):
        pass
    if type(a) is not type(b) or (isinstance(a, array) and a.typecode != b.typecode):
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n                   # a[:lo] == b[:lo]; the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def below_threshold(tokens: int, threshold: int) -> bool:
    """kv_recompute_threshold's rule, as vLLM's P applies it: fewer reusable tokens than the threshold
    (and never none) are recomputed rather than read from D."""
    return tokens < max(1, threshold)


def held(entry: ReuseEntry, *, holder_healthy: bool, holder_generation: int) -> bool:
    """The entry's decode server is usable and still the process that made it (so its blocks are there)."""
    return holder_healthy and (entry.generation is None or holder_generation == entry.generation)


def decide(entry: ReuseEntry, *, holder_healthy: bool, holder_generation: int, threshold: int,
           new_prompt: list[int] | None, block_size: int | None) -> Decision:
    """Whether (and how much of) D's blocks P may read for the new prompt.

    P reads D's blocks by position and never checks the tokens, so only the common token prefix of D's
    sequence (its prompt + generated tokens) and the new prompt is valid KV. A partial match is cut at the
    first differing token: P reads the blocks that hold the common prefix (vLLM's pull reads
    cdiv(remote_num_tokens, block_size) blocks) and computes from there, overwriting the rest of the last
    block, as it does with D's own unaligned counts. Anything that cannot be verified is not offered.
    """
    if not held(entry, holder_healthy=holder_healthy, holder_generation=holder_generation):
        return Decision(MISS, "holder_unhealthy")
    if entry.sequence is None or new_prompt is None:
        return Decision(MISS, "unverifiable")
    params = dict(entry.params)
    offered = entry.num_tokens
    # P must compute at least the last prompt token itself to produce logits.
    common = min(common_prefix_len(entry.sequence[:offered], new_prompt), len(new_prompt) - 1)
    reason = CONTINUATION
    if common < offered:
        if not block_size or common < block_size:   # at most a template header in common: an edited history
            return Decision(MISS, "not_a_continuation")
        params["remote_block_ids"] = _trim_blocks(params.get("remote_block_ids") or [], -(-common // block_size))
        params["remote_num_tokens"] = offered = common
        reason = TRIMMED
    if below_threshold(offered, threshold):
        return Decision(MISS, "below_threshold")
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    return Decision(HIT, reason, params, offered)


def engine_checked(entry: ReuseEntry, *, holder_healthy: bool, holder_generation: int, threshold: int) -> Decision:
    """The offer when the router cannot learn the new prompt's token ids (no render endpoint for the format):
    D's handles with D's sequence, which P's engine (pdserve's entry) compares with its own prompt and cuts the
    offer to their common prefix before it reads anything. The outcome is known from P's answer."""
    if not held(entry, holder_healthy=holder_healthy, holder_generation=holder_generation):
        return Decision(MISS, "holder_unhealthy")
    if entry.sequence is None:
        return Decision(MISS, "unverifiable")
    offered = entry.num_tokens
    if below_threshold(offered, threshold):
        return Decision(MISS, "below_threshold")
    try:
        expect = pack_ids(entry.sequence[:offered])
    except (TypeError, OverflowError):      # not token ids (a store written by something else)
        return Decision(MISS, "unverifiable")
    params = {**entry.params, "do_remote_decode": True, "do_remote_prefill": False, EXPECT_KEY: expect}
    return Decision(HIT, ENGINE_CHECKED, params, offered)


def engine_outcome(offer: Decision, pulled: int | None, checked: int | None, block_size: int | None = None,
                   local: int | None = None, tier: int | None = None) -> Decision:
    """What an engine-checked offer came to, from P's own counts: a hit of what P pulled, or why not. As in
    decide, a common prefix shorter than a block (a template header at most) is an edited history; one that
    P's own prefix cache held but for less than a block (`local`: P's prefix-cache hits) left nothing worth
    reading (prefix_cached); a valid one P's CPU tier loaded instead (`tier`: its tokens) is CPU_TIER."""
    if not pulled:
        edited = not checked or (block_size is not None and checked < block_size)
        cached = bool(checked) and local is not None and local + (block_size or 0) >= checked
        reason = "unverifiable" if checked is None else "not_a_continuation" if edited else \
            CPU_TIER if tier else "prefix_cached" if cached else "below_threshold"
        return Decision(MISS, reason, holder=offer.holder)
    return Decision(HIT, CONTINUATION if checked == offer.tokens else TRIMMED, holder=offer.holder, tokens=pulled)


def _trim_blocks(blocks: Any, keep: int) -> Any:
    # One list per KV-cache group (a flat list in older vLLM); P maps D's blocks from the front, so
    # cutting remote_num_tokens without cutting every group would make P read the wrong blocks.
    if blocks and isinstance(blocks[0], list):
        return [group[:keep] for group in blocks]
    return list(blocks)[:keep]
