"""The names of the router's metrics that pdserve reads back (`status`, pdserve/observe/routerstats.py): one
source for the exporter and its readers. Counters are exported with a `_total` suffix."""

TURNS = "pdserve_router_turns"
REUSE_DECISIONS = "pdserve_router_reuse_decisions"
REUSE_TOKENS_OFFERED = "pdserve_router_reuse_tokens_offered"
REUSE_TOKENS_PULLED = "pdserve_router_reuse_tokens_pulled"
PREFILL_TOKENS_LOCAL = "pdserve_router_prefill_tokens_local_cached"
TURN_PLANS = "pdserve_router_turn_plans"
DEGRADED_REQUESTS = "pdserve_router_degraded_requests"
DEGRADED_NOW = "pdserve_router_degraded"
BACKEND_HEALTHY = "pdserve_router_backend_healthy"
BACKEND_BREAKER_OPEN = "pdserve_router_backend_breaker_open"
BACKEND_IN_FLIGHT = "pdserve_router_backend_in_flight"
