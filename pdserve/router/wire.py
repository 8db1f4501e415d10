"""Names on the wire between the router and pdserve's vLLM entry (pdserve/engine/patches.py adds them).

Keys the entry's connector patch adds to P's kv_transfer_params: tokens P loaded from D, and P's own
prefix-cache hits before that. The router removes them before D sees P's params.
"""

PULLED_KEY = "pdserve_pulled_tokens"
LOCAL_KEY = "pdserve_local_cached_tokens"

# D's sequence for the next turn's continuation check, on every wire format: when the D leg's
# kv_transfer_params carry WANT_TOKENS_KEY (true), the entry's connector patch adds the request's prompt +
# generated token ids to the kv_transfer_params D returns, under TOKENS_KEY. The router takes them out
# before the client (the Anthropic and Responses endpoints take no `return_token_ids`).
WANT_TOKENS_KEY = "pdserve_return_token_ids"
TOKENS_KEY = "pdserve_token_ids"
