"""The router's configuration, read from the JSON file the planner wrote."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Prefill policies (how the router picks a prefill server); the spec's choices and bench's arms use these.
LEAST_LOADED = "least_loaded"
AFFINITY = "affinity"          # one prefill server per conversation (affinity.py)
PREFILL_POLICIES = (LEAST_LOADED, AFFINITY)


@dataclass(frozen=True)
class BackendConfig:
    name: str
    url: str


@dataclass(frozen=True)
class RouterConfig:
    prefill: list[BackendConfig]
    decode: list[BackendConfig]
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    cluster: str = ""
    reuse_ttl: float = 432.0
    reuse_max_entries: int = 100_000              # reuse entries held at most (least recently stored out first)
    reuse_max_bytes: int = 256 * 1024 * 1024      # ... and their estimated memory at most
    kv_recompute_threshold: int = 64
    bidirectional_kv_xfer: bool = True
    decoder_kv_blocks_ttl: float = 480.0   # D keeps a finished turn's blocks this long (kv_transfer's)
    # Held KV on the decode servers (held.py): released when no longer needed, a budget, a lease.
    held_kv: bool = True               # off: D frees held blocks only at its own timer (or P's read)
    held_kv_share: float = 0.5         # held tokens per D stay under this share of its KV capacity (0: no budget),
                                       #   the tenant holding the most released first (held_ledger.over_budget)
    held_kv_lease: float = 3600.0      # renew a conversation that came back until this long after its last turn
                                       #   (0: no lease; a one-turn conversation goes at reuse_ttl)
    request_timeout: float = 600.0
    health_interval: float = 2.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_answer_mb: float = 32.0        # a backend's whole answer, or one line of its stream, at most (else 502)
    max_buffered_mb: float = 256.0     # request bodies and kept answers of all requests together (else 503)
    max_header_bytes: int = 8190
    header_timeout: float = 10.0       # a request head must be complete this long after its first byte
    body_timeout: float = 30.0         # a request body must be complete this long after its head (else 408)
    idle_timeout: float = 60.0         # an idle keep-alive connection is closed after this long
    max_connections: int = 4096        # open client connections (lowered to fit the open-file limit)
    api_key_env: str | None = None     # name of the environment variable holding the API key
    cost_aware: bool = True
    prefill_policy: str = LEAST_LOADED    # one of PREFILL_POLICIES
    decode_only: bool = True           # short turns served on the holder D alone (policy.ShortTurns)
    decode_only_max_tokens: int = 256  # ... when their new tokens are at most this many
    max_output_tokens: int = 0         # every request's output tokens at most this many (0: what the context leaves)
    cost_probe_every: int = 8          # while a pull is predicted slower, pull anyway every Nth turn ...
    cost_probe_interval: float = 60.0  # ... or when the last pull is this old
    upstream_max_connections: int = 1024   # connections to all backends together (pooled, kept alive)
    upstream_max_per_backend: int = 512    # ... and to any one backend
    upstream_pool_timeout: float = 30.0    # waiting this long for a pooled connection is the router's fault: 503
    breaker_failures: int = 3
    breaker_cooldown: float = 5.0
    drain_timeout: float = 120.0       # on SIGTERM: stop accepting, let turns in flight finish this long (drain.py)
    # A drained stop writes the memory store here and the next router reads it back (kv/store_file.py);
    # the cluster folder's REUSE_FILE, set by the planner; None: nothing kept across restarts
    reuse_file: str | None = None

    otlp_endpoint: str | None = None   # OTLP/HTTP traces URL (e.g. http://127.0.0.1:4318/v1/traces); None: no tracing
    trace_sample_ratio: float = 1.0    # share of requests traced (a client's sampled traceparent is followed)
    json_logs: bool = False            # one JSON line per completion request (request id, trace id, outcome...)
    access_log: bool = True            # one text line per request (front/observe.py); with json_logs, the JSON line
    # Admission (admission.py); 0 is unlimited, and with every limit 0 admission is off.
    max_in_flight: int = 0             # completion requests in flight in all; past it they queue
    queue_size: int = 0                # ... this many at most (then 503)
    queue_timeout: float = 5.0         # ... each this long at most (then 503)
    tenant_max_in_flight: int = 0      # per tenant (API key), queued ones included (then 429)
    tenant_rate: float = 0.0           # per tenant, requests per second (token bucket; then 429)
    tenant_burst: int = 0              # the bucket's size; 0: max(1, ceil(tenant_rate))
    client_max_in_flight: int = 0      # per client address (IPv6: its /64), queued ones included (then 429)
    client_rate: float = 0.0           # per client address, requests per second (token bucket; then 429)
    client_burst: int = 0              # the bucket's size; 0: max(1, ceil(client_rate))
    store: str = "memory"              # where reuse entries live: memory, or redis://HOST:PORT/DB (store.py)
    store_timeout: float = 0.25        # a store call answers within this, else the turn recomputes
    replicas: int = 1                  # router processes sharing the store (one port, SO_REUSEPORT)
    replica: str = ""                  # this process's name among them (X-PDServe-Router); set per process

    @property
    def max_answer_bytes(self) -> int:
        return int(self.max_answer_mb * 1024 * 1024)

    @property
    def max_buffered_bytes(self) -> int:
        return int(self.max_buffered_mb * 1024 * 1024)

    @property
    def client_stall_timeout(self) -> float:
        """How long a client may take none of its answer (its buffers full): the patience body_timeout gives a
        client sending, and never past request_timeout (a turn's own bound)."""
        return min(self.body_timeout, self.request_timeout)

    @classmethod
    def from_dict(cls, data: dict) -> "RouterConfig":
        """Unknown keys are an error: a misspelt setting must not fall back to a default silently."""
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown router settings: {', '.join(unknown)}")
        kwargs = dict(data)
        kwargs["prefill"] = [BackendConfig(**b) for b in data["prefill"]]
        kwargs["decode"] = [BackendConfig(**b) for b in data["decode"]]
        return cls(**kwargs)

    @classmethod
    def load(cls, path: str | Path) -> "RouterConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))
