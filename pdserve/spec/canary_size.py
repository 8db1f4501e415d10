"""How long the canary's turns are, in items of text: the supervisor builds them (supervise/canary.py) and a
config must leave them room (load.kv_problems). An item ("check N") is 2+ tokens in any tokenizer: a word
and a number, which is what sizing a turn by tokens relies on."""

from __future__ import annotations

CANARY_ITEMS = 160                  # at least one KV block on every backend (CPU blocks are 128 tokens)
TOKENS_PER_ITEM = 2
ITEMS_MARGIN = 32                   # 64+ tokens past a size the router compares with
FRAME_TOKENS = 8                    # the fresh id, "pdserve canary:" and the chat template, per message: at least


def canary_items(min_tokens: int = 0) -> int:
    """Items of canary text that make more than `min_tokens` tokens."""
    return max(CANARY_ITEMS, -(-min_tokens // TOKENS_PER_ITEM) + ITEMS_MARGIN)


def canary_tokens_at_least(threshold: int, decode_only_max_tokens: int) -> int:
    """The fewest tokens the canary's longest prompt can take (its second turn: a first turn past
    `threshold`, its 2-token reply, a follow-up past `decode_only_max_tokens`): a config whose
    --max-model-len is below it can never prove the D->P pull. Above it, a tokenizer that takes more
    tokens an item may still make vLLM refuse the turn; `up` then fails with vLLM's message."""
    items = canary_items(threshold) + canary_items(decode_only_max_tokens + 1)
    return TOKENS_PER_ITEM * items + 2 * FRAME_TOKENS + 2
