"""The roles a cluster's processes play, named once. It imports nothing, so every package that plans, starts,
checks, reads or exports processes may import it (tests/unit/test_layers.py), the router too (it imports
nothing else of pdserve but errors); its config's `prefill` and `decode` keys are these names."""

from __future__ import annotations

PREFILL = "prefill"
DECODE = "decode"
STORE = "store"          # the managed Redis (router.store: managed; plan/routers.py)
ROUTER = "router"
MPS = "mps"              # the managed CUDA MPS control daemon (gpu_sharing: mps; plan/gpu_sharing.py)

SERVER_ROLES = (PREFILL, DECODE)                 # the vLLM servers: the spec's two role sections
ROLES = (MPS, PREFILL, DECODE, STORE, ROUTER)    # start order; stop and restart orders derive from it
ROLE_ORDER = {role: i for i, role in enumerate(ROLES)}
