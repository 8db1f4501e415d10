"""The router's Prometheus metrics (one registry per app, so tests can run several routers)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from pdserve.router.telemetry import metric_names as names
from pdserve.roles import SERVER_ROLES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "Client requests by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.client_cancelled = Counter("pdserve_router_client_cancelled",
                                        "Requests whose client went away before the answer was complete.",
                                        ["route"], registry=r)
        self.internal_errors = Counter("pdserve_router_internal_errors",
                                       "Requests that hit an unhandled router error (answered 500).", registry=r)
        self.router_busy = Counter("pdserve_router_busy",
                                   "Backend calls the router could not make for want of its own resources "
                                   "(pool_wait: no pooled connection free in time; resources: EMFILE, ENOMEM...). "
                                   "Never counted against a backend.", ["reason"], registry=r)
        self.connections_dropped = Counter("pdserve_router_connections_dropped",
                                           "Client connections the router refused or closed on its own: full "
                                           "(at the cap, every connection busy), evicted (an idle one or an "
                                           "unfinished head closed to make room), head_timeout, write_stalled (the "
                                           "client read nothing of its answer for body_timeout).", ["reason"],
                                           registry=r)
        # Read at scrape time (build_app sets its function): nothing per request.
        self.buffered_bytes = Gauge("pdserve_router_buffered_bytes", "Bytes the router holds for requests now "
                                    "(bodies, kept stream answers, whole answers being written): what "
                                    "router.max_buffered_mb bounds.", registry=r)
        self.buffer_refused = Counter("pdserve_router_buffer_refused", "Requests answered 503 because the "
                                      "router's buffers were full (router.max_buffered_mb).", ["route"], registry=r)
        self.degraded = Counter(names.DEGRADED_REQUESTS,
                                "Requests served whole by one server, without KV transfer, because no server "
                                "of the other role was usable.", ["served_by"], registry=r)
        self.plans = Counter(names.TURN_PLANS,
                             "Turns by the route plan chosen for them: prefill_then_decode, decode_only (served on "
                             "the holder decode server alone: no P leg, no pull), degraded (one role left).",
                             ["plan"], registry=r)
        self.local_refused = Counter("pdserve_router_decode_only_refused",
                                     "Turns D held whose new tokens were few enough for D alone but which went "
                                     "P then D, by the rule's reason: unknown_length (no token count), "
                                     "decode_busy (D is decoding others), prefill_faster (the measured rates "
                                     "predict P then D no slower). Turns with too many new tokens are not counted.",
                                     ["reason"], registry=r)
        self.degraded_now = Gauge(names.DEGRADED_NOW,
                                  "1 while no server of this role is usable (the last request found none).",
                                  ["missing"], registry=r)
        self.backend_requests = Counter("pdserve_router_backend_requests",
                                        "Requests sent to backends by backend, route and outcome (ok, error).",
                                        ["backend", "route", "outcome"], registry=r)
        self.turns = Counter(names.TURNS,
                             "Completion requests by how they ended, exactly one outcome each: stored (D's handles "
                             "kept for the next turn), unavailable (D reported none), untracked (no conversation "
                             "identity), degraded (served by one role), client_gone (the client left before the "
                             "answer was complete), failed (an error answer or a broken stream); by wire format "
                             "(api: chat, completions, messages, responses).",
                             ["outcome", "api"], registry=r)
        self.output_fitted = Counter("pdserve_router_output_tokens_fitted",
                                     "Requests whose output-token cap (max_tokens, max_completion_tokens, "
                                     "max_output_tokens) could not fit the decode server's context and was "
                                     "lowered to what the prompt leaves of max_model_len; by wire format (api).",
                                     ["api"], registry=r)
        self.identity = Counter("pdserve_router_conversation_identity",
                                "How requests were tied to a conversation: explicit (conversation_id or "
                                "X-Session-ID), history (automatic detection looked for an earlier turn), none.",
                                ["source"], registry=r)
        self.reuse = Counter(names.REUSE_DECISIONS,
                             "Reuse outcome per turn of a conversation: hit (P read D's blocks, or reason "
                             "decode_only: served on D alone, whose prefix cache held the history), miss and why, "
                             "or first (a conversation's first turn that reused nothing: no earlier model output in "
                             "its history, so nothing to reuse; out of the hit rate); by wire format (api).",
                             ["result", "reason", "api"], registry=r)
        self.reuse_tokens_offered = Counter(names.REUSE_TOKENS_OFFERED,
                                            "Tokens of D's KV offered to P (D's remote_num_tokens).", registry=r)
        self.reuse_tokens_pulled = Counter(names.REUSE_TOKENS_PULLED,
                                           "Prompt tokens P loaded from D's KV (P's connector count, added by "
                                           "pdserve.engine.entry; P's own prefix-cache hits are not in it).",
                                           registry=r)
        self.prefill_tokens_local = Counter(names.PREFILL_TOKENS_LOCAL,
                                            "Prompt tokens P took from its own prefix cache (not pulled from D).",
                                            registry=r)
        self.prefill_tokens_tier = Counter(names.REUSE_TOKENS_TIER,
                                           "Prompt tokens P loaded from its own CPU KV tier (a role's "
                                           "kv_offloading_size; not pulled from D, not in its GPU prefix cache).",
                                           registry=r)
        self.prefill_without_kv = Counter("pdserve_router_prefill_without_kv_params",
                                          "Prefills answered without kv_transfer_params (the server is not "
                                          "running NixlConnector): each was served again whole on decode.",
                                          ["backend"], registry=r)
        self.content_failures = Counter("pdserve_router_content_failures",
                                        "Requests that failed with a 5xx on every server tried: the request is "
                                        "the common factor, so no breaker counted them.", ["route"], registry=r)
        self.read_retries = Counter("pdserve_router_prefill_retries",
                                    "Prefill retried without D's blocks after a failed attempt with them.", registry=r)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Time to first token seen by the client.",
                              ["stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("pdserve_router_request_seconds", "End-to-end request latency.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(names.BACKEND_IN_FLIGHT, "Outstanding requests per backend.",
                               ["backend"], registry=r)
        self.healthy = Gauge(names.BACKEND_HEALTHY, "1 when the backend answers its health probe.",
                             ["backend", "role"], registry=r)
        self.breaker_open = Gauge(names.BACKEND_BREAKER_OPEN,
                                  "1 while the backend's circuit breaker is open or half-open.",
                                  ["backend", "role"], registry=r)
        self.cost = Gauge("pdserve_router_cost_seconds_per_token",
                          "Learned prefill cost per token: kind=recompute (per prefill server) or "
                          "pull (per prefill/decode pair).", ["kind", "prefill", "decode"], registry=r)
        self.entries_live = Gauge("pdserve_router_reuse_entries_live", "Reuse entries held now.", registry=r)
        self.entries_bytes = Gauge("pdserve_router_reuse_entries_bytes",
                                   "Estimated memory held by reuse entries.", registry=r)
        self.entries_evicted = Counter("pdserve_router_reuse_entries_evicted",
                                       "Reuse entries dropped unused: expired (reuse_ttl) or capacity "
                                       "(reuse_max_entries / reuse_max_bytes).", ["reason"], registry=r)
        # Held KV on the decode servers (held.py, docs/router.md "Held KV on the decode servers")
        self.held_tokens = Gauge(names.HELD_TOKENS, "KV tokens the router's entries hold on each decode server "
                                 "(whole blocks): the budget's count.", ["decode"], registry=r)
        self.held_budget = Gauge(names.HELD_BUDGET, "The held-KV budget of each decode server: held_kv_share of its "
                                 "KV capacity (0: not enforced).", ["decode"], registry=r)
        self.held_tenants = Gauge(names.HELD_TENANTS, "Tenants whose entries hold KV on each decode server: the "
                                  "budget's fair shares are its equal parts.", ["decode"], registry=r)
        self.held_capacity = Gauge(names.HELD_CAPACITY, "Each decode server's KV capacity in tokens, from its "
                                   "vllm:cache_config_info.", ["decode"], registry=r)
        self.held_control = Gauge(names.HELD_CONTROL, "1 while the decode server answers the held-KV control "
                                  "routes (pdserve's entry), 0 when it has none.", ["decode"], registry=r)
        self.held_releases = Counter(names.HELD_RELEASES, "Held turns the router had a decode server release, by "
                                     "reason: lru (over budget: the crossing tenant's own), over_share (over "
                                     "budget: another tenant's, over its fair share), replaced, evicted (table "
                                     "bounds), expired (table TTL, or the end of the lease), unused (taken by a "
                                     "turn that did not pull it), untracked (a turn with no entry kept), abandoned "
                                     "(its client left before D's handles came).", ["reason"], registry=r)
        self.held_renewals = Counter(names.HELD_RENEWALS, "Held turns renewed on their decode server (the lease).",
                                     registry=r)
        self.held_failures = Counter(names.HELD_FAILURES, "Held-KV control calls that failed (release, renew, "
                                     "list) or a capacity the server's /metrics did not give (capacity).",
                                     ["op"], registry=r)
        self.admission = Counter(names.ADMISSION,
                                 "Completion requests by admission outcome, one each (with admission on): admitted, "
                                 "queued (served after a wait), rejected_tenant_rate and rejected_tenant_in_flight "
                                 "(429), rejected_saturated (503, queue full), queue_timeout (503), client_gone "
                                 "(left while queued).", ["outcome"], registry=r)
        self.admission_queue = Gauge(names.ADMISSION_QUEUE, "Requests waiting for an admission slot now.",
                                     registry=r)
        # Read at scrape time (Admission sets its function): nothing per request.
        self.admission_in_flight = Gauge("pdserve_router_admission_in_flight", "Completion requests holding an "
                                         "admission slot now (what max_in_flight bounds).", registry=r)
        self.admission_wait = Histogram("pdserve_router_admission_wait_seconds",
                                        "Time queued requests waited for a slot (served or not).",
                                        buckets=LATENCY_BUCKETS, registry=r)
        # process_start_time_seconds and friends: the dashboard counts restarts by the start time's changes.
        ProcessCollector(registry=r)
        # Series that exist before their first event, so a dashboard shows 0 rather than no data.
        for stream in ("true", "false"):
            self.ttft.labels(stream)
        for role in SERVER_ROLES:
            self.degraded.labels(role)
            self.degraded_now.labels(role)
        self.store_up = Gauge(names.STORE_UP, "1 while the reuse store answers (the memory store always does); "
                              "0 while turns are served without it.", ["store"], registry=r)
        self.store_errors = Counter(names.STORE_ERRORS, "Reuse-store calls that failed: timeout, error, or down "
                                    "(not tried: the store was seen down less than a second ago).",
                                    ["op", "reason"], registry=r)
        # prometheus_client's labels() validates and locks on every call, many times a request; the
        # label sets here are bounded (routes, statuses, backends), so each child is looked up once.
        for metric in vars(self).values():
            if getattr(metric, "_labelnames", ()):
                metric.labels = functools.lru_cache(maxsize=4096)(metric.labels)
