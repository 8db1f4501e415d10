"""Where a turn goes, decided in one place: the flow gathers the inputs, asks `RoutePolicy.plan`, and runs the
plan it gets (flow.py). Nothing here does I/O, so every rule is tested in milliseconds with fakes
(tests/unit/test_route_policy.py).

- PrefillThenDecode: P prefills (reading what of D's blocks the offer allows), D reads P's blocks and decodes.
- DecodeOnly: the holder D computes the few new tokens itself on top of the conversation it still holds
  (its own prefix cache), with no P leg, no pull and no hand-over. D still publishes the finished turn's blocks
  (vLLM's NIXL connector does so for any request that carries kv_transfer_params on a bidirectional consumer,
  docs/router.md "Short turns on D"), so the next long turn's P pulls the conversation as before.
- Degraded(role): no server of the other role is usable: the turn is served whole on `role`, no KV transfer
  (role None: no server of either role, 503).

How a prefill server is chosen (PREFILL_PICKS, the schema's `prefill_policy` choices) and whether P is offered
D's blocks (the cost guard) are the policy's too; the P leg asks for them per attempt (prefill.py).
"""

from __future__ import annotations

import hashlib
import marshal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.router.config import AFFINITY, LEAST_LOADED, RouterConfig
from pdserve.router.identity import Key
from pdserve.router.kv.reuse import HIT, MISS, Decision
from pdserve.router.route import affinity
from pdserve.router.route.backends import Backend, Pool
from pdserve.router.route.cost import CostModel
from pdserve.router.wire import DECODE_ONLY, DEGRADED, PREFILL_THEN_DECODE
from pdserve.roles import SERVER_ROLES

# D's blocks published by a turn served on D alone: any non-empty kv_transfer_params without do_remote_decode
# makes a bidirectional consumer keep the finished request's blocks and return their handles.
LOCAL_PARAMS = {"do_remote_prefill": False}
# Why a held turn went P then D (PrefillThenDecode.local_refused; pdserve_router_decode_only_refused_total).
TOO_LONG, UNKNOWN_LENGTH, DECODE_BUSY, PREFILL_FASTER = "too_long", "unknown_length", "decode_busy", "prefill_faster"


@dataclass(frozen=True)
class PrefillThenDecode:
    decision: Decision | None = None   # what of D's blocks P may read (None: no conversation looked up)
    anchor: str | None = None          # the prefill pin (affinity), or preference (a root session, least_loaded)
    local_refused: str = ""            # why D alone was not chosen (empty: not a candidate)
    name = PREFILL_THEN_DECODE


@dataclass(frozen=True)
class DecodeOnly:
    holder: str                        # the decode server holding the conversation
    new_tokens: int                    # tokens D computes: the prompt beyond the block-aligned prefix it holds
    held_tokens: int                   # the verified common prefix D holds
    prompt_tokens: int | None = None   # the new prompt's tokens (exact, or a bound from above when unverified)
    name = DECODE_ONLY


@dataclass(frozen=True)
class Degraded:
    role: str | None                   # the role left to serve the turn whole; None: neither (503)
    why: str
    name = DEGRADED


TurnPlan = PrefillThenDecode | DecodeOnly | Degraded


@dataclass(frozen=True)
class TurnInputs:
    missing: tuple[str, ...] = ()      # roles with no usable server (after a recheck)
    decision: Decision | None = None   # the trimmed offer (reuse.decide), with the new prompt's length
    anchor: str | None = None
    block_size: int | None = None      # the KV block size (D's prefix cache hits whole blocks)
    holder_load: int = 0               # requests in flight on the holder D now
    unseen_change: bool = False        # the prompt has inputs P's count cannot see (UNTOKENIZED) not D's turn's


def new_tokens(decision: Decision, block_size: int | None) -> int | None:
    """Tokens D computes for the new prompt: all beyond the whole blocks of the common prefix it holds."""
    if decision.prompt_tokens is None:
        return None
    held = decision.tokens if not block_size else decision.tokens // block_size * block_size
    return max(1, decision.prompt_tokens - held)


# The chat template's tokens around one message (role header, end marker), generously: Qwen's and Llama 3's
# take about 5, tool results a few more.
TEMPLATE_TOKENS_PER_MESSAGE = 16


# Request fields besides the messages that a chat template renders into the prompt (P's /tokenize gets them
# too: api/chat.TOKENIZE_CHAT_FIELDS; tool_choice "none" may drop the tools). A bound on the new messages
# holds only while these are the very ones of the turn D holds: their digest is stamped on the stored entry.
TEMPLATE_FIELDS = ("tools", "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
                   "add_generation_prompt", "continue_final_message", "tool_choice")
# Of those, the ones vLLM's /tokenize does not take (it renders without them): a change to them since D's turn
# is a prompt of unknown length.
UNTOKENIZED = ("documents", "tool_choice")
TURN_STAMP = "pdserve_turn"   # in a stored entry's params (flow.py): [messages through D's reply, template digest]


def template_digest(body: dict[str, Any]) -> str:
    """The TEMPLATE_FIELDS a request has, as one digest ("" for none). marshal, not JSON: 16 kB of tools in
    ~140 us where json.dumps took ~790 us (this 2-core VM, loaded). Equal JSON parses to objects that marshal
    equally (a difference would only cost a tokenize: the checked path)."""
    present = [(k, body[k]) for k in TEMPLATE_FIELDS if k in body]
    if not present:
        return ""
    try:
        return hashlib.blake2b(marshal.dumps(present, 4), digest_size=12).hexdigest()
    except ValueError:            # not marshallable: never the same
        return "?"


def new_messages_start(messages: list[Any] | None, start: int | None = None) -> int | None:
    """Where the new messages begin: `start` (the messages D holds) or, None, after the last assistant
    message; None when there is no such place."""
    if not messages:
        return None
    if start is None:
        start = next((i + 1 for i in range(len(messages) - 1, -1, -1)
                      if isinstance(messages[i], dict) and messages[i].get("role") == "assistant"), None)
    return start if start is not None and 0 < start <= len(messages) else None


def new_tokens_bound(messages: list[Any] | None, start: int | None = None) -> int | None:
    """An upper bound of the tokens that messages[start:] add to the prompt (start: the messages D holds; None:
    all after the last assistant message), without tokenizing: a token of a byte-level BPE (or SentencePiece)
    vocabulary covers at least one byte of text, plus the template's tokens per message and the generation
    prompt. None when there is nothing to bound by (no assistant message, a message that is not plain text)."""
    start = new_messages_start(messages, start)
    if start is None:
        return None
    total = TEMPLATE_TOKENS_PER_MESSAGE                  # the generation prompt
    for message in messages[start:]:
        if not isinstance(message, dict) or not set(message) <= {"role", "content", "name", "tool_call_id"}:
            return None
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            return None
        total += len(content.encode()) + TEMPLATE_TOKENS_PER_MESSAGE
    return total


def new_text(messages: list[Any] | None, start: int | None = None) -> str | None:
    """The text of messages[start:] (start as for new_tokens_bound), parts that are not text left out; None
    when there is no such range."""
    start = new_messages_start(messages, start)
    if start is None:
        return None
    texts = []
    for message in messages[start:]:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [content] if isinstance(content, str) else [p.get("text") for p in content
                                                             if isinstance(p, dict)] if isinstance(content, list) else []
        texts += [p for p in parts if isinstance(p, str)]
    return "\n".join(texts)


def new_tokens_at_least(text: str | None) -> int | None:
    """A lower bound of the tokens `text` (new_text) takes: its whitespace-separated words, as vocabularies
    split words before merging (GPT-2-style pre-tokenizers, SentencePiece's whitespace split). A tokenizer
    whose tokens span words would only make a turn look longer than it is: it then goes to P, never to a
    wrong KV (P checks)."""
    return None if text is None else len(text.split())


class ShortTurns:
    """The DecodeOnly rule. A turn is a candidate when its new tokens (what D's prefix cache cannot serve:
    the prompt beyond the whole blocks D holds) are at most `max_tokens`. It is served on D alone when that
    is predicted no slower than P then D, counting what it costs the k requests D is decoding (their decode
    steps wait for the prefill chunk):

        rate_D x n_D x (1 + k)  <=  hand-over(held tokens) + rate_P x n_P

    n_D: tokens D computes (new, plus the part of the last block D held: its prefix cache hits whole blocks);
    n_P: tokens P computes (P pulls D's sequence to the token). The hand-over is the pull and P-leg
    overhead as the cost model measured it; rate_P its recompute rate, rate_D D's own (measured on streamed
    D-alone turns, rate_P until then). While any of them is unknown an idle D takes the turn, a busy one not."""

    def __init__(self, max_tokens: int, costs: CostModel):
        self.max_tokens = max_tokens
        self.costs = costs

    def choose(self, inputs: TurnInputs) -> DecodeOnly | str:
        d = inputs.decision
        if d is None or d.result != HIT or d.holder is None:
            return ""                      # nothing held for this conversation: not a candidate
        n = new_tokens(d, inputs.block_size)
        if n is None or d.prompt_tokens is None or inputs.unseen_change:
            return UNKNOWN_LENGTH
        if n > self.max_tokens:
            return TOO_LONG
        costs, k = self.costs, inputs.holder_load
        rate, saved, p_rate = costs.local_rate(d.holder), costs.handover(d.holder, d.tokens), costs.prefill_rate()
        if rate is None or saved is None or p_rate is None:
            return DecodeOnly(d.holder, n, d.tokens, d.prompt_tokens) if k == 0 else DECODE_BUSY
        if rate * n * (1 + k) > saved + p_rate * max(1, d.prompt_tokens - d.tokens):
            return DECODE_BUSY if k else PREFILL_FASTER
        return DecodeOnly(d.holder, n, d.tokens, d.prompt_tokens)


PrefillPick = Callable[[Pool, "str | None", set[str]], "Backend | None"]
PREFILL_PICKS: dict[str, PrefillPick] = {
    # a named root session's own server while within the pin slack: its prefix cache holds what siblings share
    LEAST_LOADED: lambda pool, anchor, exclude: pool.pick(exclude=exclude, prefer=affinity.home(pool, anchor)),
    AFFINITY: affinity.pick,               # the conversation's own server while usable (affinity.py)
}


class RoutePolicy:
    def __init__(self, cfg: RouterConfig, costs: CostModel):
        self.cfg = cfg
        self.costs = costs                 # learned always; it guards pulls only with cost_aware
        self.pick = PREFILL_PICKS[cfg.prefill_policy]
        self.short = ShortTurns(cfg.decode_only_max_tokens, costs) if cfg.decode_only else None

    def anchor(self, explicit: Key | None, tenant: str, messages: list[Any] | None,
               root: str | None = None) -> str | None:
        """The turn's prefill anchor: pinned under affinity; under least_loaded a named root session only."""
        if self.cfg.prefill_policy == AFFINITY:
            return affinity.anchor(explicit, tenant, messages, root)
        return affinity.root_anchor(tenant, root)

    def plan(self, inputs: TurnInputs) -> TurnPlan:
        if inputs.missing:
            left = [r for r in SERVER_ROLES if r not in inputs.missing]
            return Degraded(left[0] if left else None, f"no {inputs.missing[0]} server usable")
        choice = self.short.choose(inputs) if self.short is not None else ""
        if isinstance(choice, DecodeOnly):
            return choice
        return PrefillThenDecode(inputs.decision, inputs.anchor, choice)

    def pick_prefill(self, pool: Pool, anchor: str | None, exclude: set[str]) -> Backend | None:
        return self.pick(pool, anchor, exclude)

    def offer(self, prefill: str, offer: Decision | None) -> tuple[Decision | None, Decision | None]:
        """What P on `prefill` is offered, and the reuse outcome if that changes it (the cost guard)."""
        if (offer is None or not self.cfg.cost_aware or offer.holder is None
                or self.costs.should_pull(prefill, offer.holder)):
            return offer, None
        return None, Decision(MISS, "pull_slower", holder=offer.holder)
