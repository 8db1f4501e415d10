"""Names on the wire between the router and pdserve's vLLM entry (pdserve/engine/patches.py adds them).

Keys the entry's connector patch adds to P's kv_transfer_params: tokens P loaded from D, and P's own
prefix-cache hits before that. The router removes them before D sees P's params.
"""

PULLED_KEY = "pdserve_pulled_tokens"
LOCAL_KEY = "pdserve_local_cached_tokens"
