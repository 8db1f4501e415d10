"""The cluster.yaml models. Knobs that are vLLM's keep vLLM's names so users can map them one to one."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.router.config import PREFILL_POLICIES, RouterConfig

BUILTIN_MODEL_PREFIX = "pdserve:"
# Flags pdserve sets itself from the topology; giving them in vllm_args would contradict the plan.
RESERVED_VLLM_FLAGS = ("--model", "--host", "--port", "--kv-transfer-config", "--served-model-name",
                       "--tensor-parallel-size", "-tp", "--api-key")

Port = Field(ge=1, le=65535)
MANAGED_STORE = "managed"     # router.store: pdserve runs the Redis (plan/build.py)
STARTUP_TIMEOUT_S = 900.0     # how long a server may take to answer /health (and `restart` waits, by default)


class LauncherKind(str, enum.Enum):
    """How servers start (the spec's `launcher:`); each has its module in pdserve/launchers/."""
    LOCAL = "local"
    SSH = "ssh"
    SLURM = "slurm"


LAUNCHERS = tuple(k.value for k in LauncherKind)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoleSpec(Strict):
    """One role (prefill or decode): `replicas` identical vLLM servers."""

    replicas: int = Field(1, ge=1, le=64, description="Number of vLLM servers in this role.")
    host: str | list[str] = Field(
        "127.0.0.1",
        description="Without `hosts:`: the address the servers bind to on this machine. With `hosts:`: the name "
                    "of the host they run on, or a list naming one host per replica.")
    port: int = Field(..., ge=1, le=65535, description="HTTP port of the first replica; next replicas count up.")
    nixl_side_channel_port: int = Field(
        ..., ge=1, le=65535,
        description="VLLM_NIXL_SIDE_CHANNEL_PORT of the first replica; replica i uses port + i * tensor_parallel_size.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM --tensor-parallel-size per replica.")
    gpus: list[int] | None = Field(None, description="GPU indices (CUDA_VISIBLE_DEVICES), split across replicas.")
    cpus: list[int] | None = Field(None, description="CPU cores to bind (VLLM_CPU_OMP_THREADS_BIND), split across replicas.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, lt=1, description="vLLM --gpu-memory-utilization per server; with share_gpus the planner "
                                      "splits each shared GPU evenly unless this is given.")
    vllm_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` arguments, passed verbatim.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for these servers.")
    kv_offloading_size: float | None = Field(
        None, gt=0,
        description="GiB of host memory per server for a CPU KV tier: vLLM's OffloadingConnector beside "
                    "NixlConnector (under MultiConnector), so prompt blocks pushed out of GPU memory are loaded "
                    "back instead of recomputed. vLLM's own --kv-offloading-size would replace NIXL. Needs GPU "
                    "servers (kv_buffer_device cuda) with the prefix cache on (the tier is keyed by its hashes).")


MIB = 1024 * 1024
# The router's own dataclass is the one source of its defaults; these fields pass to it by name.
ROUTER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}


def router_field(name: str, description: str, **constraints: Any) -> Any:
    """A RouterSpec field whose default is the router's own (RouterConfig is the one source)."""
    return Field(ROUTER_DEFAULTS[name], description=description, **constraints)


# GB/s below which GPU KV transfers mean an emulated transport: far below any real GPU path, far above
# UCX's TCP emulation (docs/gpu.md, "Where the code's GPU settings come from").
GPU_TRANSFER_FLOOR_GBPS = 5.0


class KVTransferSpec(Strict):
    """Goes into vLLM's --kv-transfer-config (kv_role is set by pdserve per role), but for
    nixl_progress_delay_us, which NIXL's agent gets through pdserve.engine.entry."""

    kv_connector: Literal["NixlConnector"] = "NixlConnector"
    kv_buffer_device: Literal["cuda", "cpu"] = "cuda"
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    bidirectional_kv_xfer: bool = ROUTER_DEFAULTS["bidirectional_kv_xfer"]
    kv_recompute_threshold: int = Field(ROUTER_DEFAULTS["kv_recompute_threshold"], ge=0)
    decoder_kv_blocks_ttl: float = Field(ROUTER_DEFAULTS["decoder_kv_blocks_ttl"], gt=0)
    kv_lease_duration: float = Field(30.0, gt=0)
    backends: list[str] = Field(default_factory=lambda: ["UCX"], min_length=1)
    nixl_progress_delay_us: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Microseconds NIXL's progress thread sleeps between polls. NIXL's Python API uses 0, a busy "
                    "loop that holds one core per vLLM worker: fine on GPU nodes, ruinous on shared CPU cores. "
                    "Default: 1000 with kv_buffer_device cpu, else 0 (NIXL's own). Above 0, pdserve runs vLLM "
                    "through pdserve.engine.entry, which sets it.")
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="More kv_connector_extra_config keys, passed verbatim.")
    min_transfer_gbps: float | None = Field(
        None, ge=0,
        description="`up` and `doctor` fail when the canary's KV transfers (either direction) run slower than "
                    "this many GB/s: a transport emulated over TCP makes P-D slower than one server. Default: "
                    f"{GPU_TRANSFER_FLOOR_GBPS:g} with kv_buffer_device cuda, 0 (no floor) with cpu; 0 turns it off.")

    @property
    def transfer_floor_gbps(self) -> float:
        if self.min_transfer_gbps is not None:
            return self.min_transfer_gbps
        return GPU_TRANSFER_FLOOR_GBPS if self.kv_buffer_device == "cuda" else 0.0


class RouterSpec(Strict):
    host: str = router_field("host", "Router bind address; 127.0.0.1 unless you mean to expose it.")
    port: int = router_field("port", "Router port.", ge=1, le=65535)
    reuse_ttl: float | None = Field(
        None, gt=0, description="Seconds the router keeps D's block handles; default 90% of decoder_kv_blocks_ttl.")
    reuse_max_entries: int = router_field("reuse_max_entries", "Conversations whose D handles the router holds "
                                          "at most (least recently stored out first).", ge=1)
    reuse_max_mb: float = Field(ROUTER_DEFAULTS["reuse_max_bytes"] / MIB, gt=0,
                                description="Estimated memory of those handles at most, in MiB.")
    request_timeout: float = router_field("request_timeout", "Seconds a backend may keep the router waiting: for a whole answer, a stream's first byte, or between two of its bytes (a steady stream runs on).", gt=0)
    header_timeout: float = router_field("header_timeout", "Seconds a client may take to send a request's "
                                         "headers.", gt=0)
    body_timeout: float = router_field("body_timeout", "Seconds a client may take to send a request's body "
                                       "(then 408), or to read none of its answer (then its connection is closed "
                                       "and its slot freed; at most request_timeout).", gt=0)
    idle_timeout: float = router_field("idle_timeout", "Seconds an idle keep-alive client connection stays "
                                       "open.", gt=0)
    max_connections: int = router_field("max_connections", "Open client connections at most (lowered to fit "
                                        "the open-file limit).", ge=1)
    upstream_max_connections: int = router_field("upstream_max_connections", "Pooled connections to all "
                                                 "backends together.", ge=1)
    upstream_max_per_backend: int = router_field("upstream_max_per_backend", "Pooled connections to any one "
                                                 "backend.", ge=1)
    api_key_env: str | None = router_field(
        "api_key_env", "Name of an environment variable holding an API key. When set, every router endpoint but "
        "/health requires 'Authorization: Bearer <key>', and the vLLM servers get the same key (VLLM_API_KEY), "
        "so they refuse clients that bypass the router.", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    cost_aware: bool = router_field("cost_aware", "Offer D's blocks to P only while pulling them is measured to "
                                    "be faster than recomputing (see docs/router.md).")
    prefill_policy: Literal[PREFILL_POLICIES] = router_field(
        "prefill_policy", "How the router picks a prefill server: the least loaded one, or 'affinity': each "
        "conversation stays on one (rendezvous hashing; least loaded while that one is down), so P's own "
        "prefix cache holds its history.")
    decode_only: bool = router_field(
        "decode_only", "Serve a short follow-up turn on the decode server that holds the conversation, alone: it "
        "computes the few new tokens on top of its prefix cache, with no prefill leg and no KV hand-over, and "
        "still keeps the turn's blocks for the next long turn's pull (docs/router.md, 'Short turns on D').")
    max_output_tokens: int = router_field(
        "max_output_tokens", "Output tokens any request gets at most, whatever it asks (its cap lowered, or set "
        "where it sends none): an operator's bound on every reply's length and decode time. 0: only the "
        "context bounds it (what the prompt leaves of the server's max_model_len).", ge=0)
    decode_only_max_tokens: int = router_field(
        "decode_only_max_tokens", "Most new tokens (beyond the whole blocks the decode server holds) a turn may "
        "have to be served on D alone; a busy D takes fewer, as measured (docs/router.md).", ge=1)
    held_kv: bool = router_field(
        "held_kv", "Manage the KV blocks decode servers hold for the next turns (docs/router.md, 'Held KV on the "
        "decode servers'): release at once what the router no longer needs, keep each server's held tokens under "
        "held_kv_share of its KV cache (the least recently used of the tenant holding the most released first: "
        "equal shares between tenants), and renew the blocks of conversations "
        "still in use past decoder_kv_blocks_ttl. Off: decode servers free held blocks only at their timer, so a "
        "full KV cache makes new turns wait for it. Needs the decode servers run through pdserve's entry (the "
        "default with bidirectional_kv_xfer).")
    held_kv_share: float = router_field(
        "held_kv_share", "Share of each decode server's KV cache (its vllm:cache_config_info) the blocks held for "
        "next turns may fill; the rest stays for the requests running. 0: no budget (and no lease).", ge=0, le=1)
    held_kv_lease: float = router_field(
        "held_kv_lease", "Seconds after a conversation's last turn its held blocks may still be renewed (the lease), "
        "while its decode server is under budget, if the conversation came back (a turn after its first): one that "
        "never did goes at reuse_ttl. Past it, or with 0, they are released at the router's own expiry.", ge=0)
    breaker_failures: int = router_field("breaker_failures", "Consecutive failed requests that open a "
                                         "backend's circuit breaker.", ge=1)
    breaker_cooldown: float = router_field("breaker_cooldown", "Seconds an open breaker waits before one trial "
                                           "request.", gt=0)
    max_body_mb: float = Field(ROUTER_DEFAULTS["max_body_bytes"] / MIB, gt=0,
                               description="Largest request body accepted, in MiB.")
    max_answer_mb: float = router_field("max_answer_mb", "Largest answer the router reads from a backend, in MiB: "
                                        "a whole JSON answer, or one line of a stream (a longer stream is relayed "
                                        "but not remembered). Past it the read stops: a 502 (a broken stream).",
                                        gt=0)
    max_buffered_mb: float = router_field("max_buffered_mb", "Bytes the router buffers for all requests together, "
                                          "in MiB: request bodies, the answers it keeps for reuse, whole answers "
                                          "being written. Past it a new request gets 503 with Retry-After (see "
                                          "docs/router.md, Security).", gt=0)
    # Admission (docs/router.md "Admission"); 0 is unlimited; off by default.
    max_in_flight: int = router_field("max_in_flight", "Completion requests in flight through the router at "
                                      "most; past it they wait in the queue. 0: unlimited.", ge=0)
    queue_size: int = router_field("queue_size", "Requests that may wait for a slot past max_in_flight; a full "
                                   "queue answers 503 with Retry-After.", ge=0)
    queue_timeout: float = router_field("queue_timeout", "Seconds a request may wait in the queue (then 503 with "
                                        "Retry-After).", gt=0)
    tenant_max_in_flight: int = router_field("tenant_max_in_flight", "Completion requests one tenant (API key) "
                                             "may have in flight or queued; past it 429 with Retry-After. "
                                             "0: unlimited.", ge=0)
    tenant_rate: float = router_field("tenant_rate", "Requests per second one tenant may send (token bucket); "
                                      "past it 429 with Retry-After. 0: unlimited.", ge=0)
    tenant_burst: int = router_field("tenant_burst", "Requests a tenant may send at once above tenant_rate (the "
                                     "bucket's size); 0: max(1, tenant_rate).", ge=0)
    client_max_in_flight: int = router_field(
        "client_max_in_flight", "Completion requests one client address (an IPv6 /64) may have in flight or "
        "queued, whatever credentials it sends; past it 429 with Retry-After. Keep it below tenant_max_in_flight "
        "so that clients sharing one key share it fairly; behind a proxy every client has the proxy's address. "
        "0: unlimited.", ge=0)
    client_rate: float = router_field("client_rate", "Requests per second one client address may send (token "
                                      "bucket), whatever credentials it sends; past it 429. 0: unlimited.", ge=0)
    client_burst: int = router_field("client_burst", "Requests a client address may send at once above "
                                     "client_rate; 0: max(1, client_rate).", ge=0)

    store: str = router_field(
        "store", "Where the router keeps D's block handles between turns: 'memory' (this router process; lost "
        "when it restarts), 'redis://HOST:PORT/DB' (a Redis you run: shared by replicas, kept across router "
        "restarts; pdserve never starts or stops it), or 'managed' (pdserve runs the system's redis-server on "
        "127.0.0.1:store_port, data in the cluster folder, stopped by `down`).", min_length=1)
    store_port: int | None = Field(None, ge=1, le=65535, description="Port of the managed Redis (store: "
                                   "managed); default the port after the routers' (router.port + 1, or + replicas "
                                   "+ 1 with replicas).")
    store_timeout: float = router_field("store_timeout", "Seconds a reuse-store call may take; a slower or "
                                        "failed one serves the turn by recomputing (miss reason "
                                        "store_unavailable).", gt=0)
    drain_timeout: float = router_field(
        "drain_timeout", "Seconds a stopping router (down, restart, up applying a change) lets the turns in flight "
        "finish after it stops accepting connections; then it cuts each one left with a log line (turn outcome "
        "cut). The router gets this plus 10 s before SIGKILL, whatever supervisor.stop_timeout says.", ge=0)
    replicas: int = router_field("replicas", "Router processes, each supervised, all on router.port (SO_REUSEPORT: "

                                 "the kernel spreads connections over them) and each on its own port too "
                                 "(router.port + 1 + i: health, /metrics). More than one needs a shared store.",
                                 ge=1, le=64)

    def replica_port(self, i: int) -> int:
        """Replica i's own port (with one replica, the router's port is its own)."""
        return self.port + 1 + i if self.replicas > 1 else self.port

    @property
    def managed_store_port(self) -> int:
        return self.store_port or self.replica_port(self.replicas - 1) + 1


class ObservabilitySpec(Strict):
    """Traces and request logs (docs/operations.md); metrics need nothing here (`pdserve scrape-config`)."""
    otlp_endpoint: str | None = router_field(
        "otlp_endpoint", "OTLP/HTTP (protobuf) traces URL, e.g. http://127.0.0.1:4318/v1/traces (an OpenTelemetry "
        "Collector, Jaeger, Tempo). The router makes one trace per request and passes W3C traceparent on; the "
        "vLLM servers get --otlp-traces-endpoint with it, so their spans join the router's. Needs the `otel` "
        "extra. Unset: no tracing, and OpenTelemetry is not even imported.", pattern=r"^https?://\S+$")
    trace_sample_ratio: float = router_field(
        "trace_sample_ratio", "Share of requests traced (parent-based: a client's sampled traceparent is "
        "followed).", ge=0, le=1)
    json_logs: bool = router_field(
        "json_logs", "One JSON line per completion request in the router's log: request id, trace id, "
        "conversation key hash, outcome, reuse decision, servers.")
    access_log: bool = router_field(
        "access_log", "One line per request in the router's log (health probes and metric scrapes left out): "
        "method, path, status, time, API, conversation (its key's hash), route plan, reuse outcome, prompt tokens "
        "P computed, pulled from D and computed on D alone, outcome, request id. With json_logs the line is JSON.")


class SupervisorSpec(Strict):
    startup_timeout: float = Field(STARTUP_TIMEOUT_S, gt=0, description="Seconds a server may take to answer /health.")
    health_interval: float = Field(2.0, gt=0)
    unhealthy_grace: float = Field(30.0, ge=0, description="Seconds unhealthy before a live server is restarted.")
    backoff_initial: float = Field(1.0, gt=0)
    backoff_max: float = Field(30.0, gt=0)
    max_restarts: int = Field(5, ge=0, description="Restarts within restart_window before a process is fatal.")
    restart_window: float = Field(600.0, gt=0)
    stop_timeout: float = Field(20.0, gt=0, description="Seconds between SIGTERM and SIGKILL.")
    canary: bool = Field(True, description="Ready only after a canary request through the router moved KV "
                                           "from prefill to decode (checked on the decode servers' /metrics); "
                                           "again after a prefill or decode restart.")
    log_max_mb: float = Field(100.0, gt=0, description="A process log above this size is rotated to NAME.log.1.")
    log_keep: int = Field(3, ge=0, description="Rotated logs kept per process (NAME.log.1 ... NAME.log.N).")


class HostSpec(Strict):
    """One machine of a multi-host cluster, reached over ssh or as a Slurm node of the allocation."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
                      description="Name roles refer to; with launcher slurm, the node name (--nodelist).")
    address: str = Field(..., min_length=1,
                         description="Address the other hosts and the router reach this host at; its servers bind "
                                     "to it and it becomes VLLM_NIXL_SIDE_CHANNEL_HOST. Also the ssh destination "
                                     "unless ssh_host is set.")
    ssh_host: str | None = Field(None, description="ssh destination when it differs from address (e.g. an alias "
                                                   "from ~/.ssh/config).")
    user: str | None = Field(None, description="ssh user (default: ~/.ssh/config's, else yours).")
    port: int | None = Field(None, ge=1, le=65535, description="ssh port (default: ~/.ssh/config's, else 22).")
    identity_file: str | None = Field(None, description="ssh private key (default: agent / ~/.ssh/config).")
    ssh_options: list[str] = Field(
        default_factory=list,
        description="Extra `ssh -o` options, e.g. ['UserKnownHostsFile=/path/known_hosts'].")
    python: str | None = Field(None, description="Python on this host that runs vLLM and pdserve's small "
                                                 "control commands (default: the same path as here).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for servers on this host.")


class SlurmSpec(Strict):
    job_id: str | None = Field(None, pattern=r"^[0-9]+$",
                               description="Allocation to run the steps in (default: $SLURM_JOB_ID).")
    srun_args: list[str] = Field(default_factory=list, description="Extra srun arguments for every step.")


class ClusterSpec(Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    model: str = Field(..., min_length=1, description="Model path or id given to vLLM; `pdserve:tiny` builds one.")
    served_model_name: str | None = None
    server_command: list[str] | None = Field(
        None, min_length=1,
        description="Command that starts one vLLM OpenAI server, before its arguments (default: this "
                    "Python with -m vllm.entrypoints.openai.api_server). For wrappers such as numactl.")
    share_gpus: bool = Field(False, description="Allow prefill and decode servers on the same GPU: each gets a "
                                                "fitting --gpu-memory-utilization and starts after the "
                                                "server before it on that GPU is ready.")
    gpu_sharing: Literal["time_slice", "mps"] = Field(
        "time_slice", description="How servers sharing a GPU (share_gpus) run on it: time_slice = CUDA's default, "
                                  "one context at a time; mps = pdserve runs a CUDA MPS control daemon and the "
                                  "servers run on the GPU at once (this machine's servers only).")
    launcher: Literal[LAUNCHERS] = Field(
        LauncherKind.LOCAL.value, description="How servers start: on this machine, over the system ssh, or as srun steps.")
    hosts: list[HostSpec] | None = Field(
        None, description="The machines servers run on (default: this machine only).")
    platform: Literal["p5en-efa"] | None = Field(
        None, description="Preset: p5en-efa = AWS P5en (8 H200 per host) over EFA: NIXL LIBFABRIC backend and "
                          "EFA environment; explicit settings override it.")
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    prefill: RoleSpec
    decode: RoleSpec
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    supervisor: SupervisorSpec = Field(default_factory=SupervisorSpec)
    observability: ObservabilitySpec = Field(default_factory=ObservabilitySpec)

    @property
    def nixl_progress_delay_us(self) -> int:
        """The NIXL progress-thread delay in effect: the configured one, else 1000 on CPU buffers, else 0."""
        kv = self.kv_transfer
        if kv.nixl_progress_delay_us is not None:
            return kv.nixl_progress_delay_us
        return 1000 if kv.kv_buffer_device == "cpu" else 0

    def host(self, name: str) -> HostSpec | None:
        return next((h for h in self.hosts or [] if h.name == name), None)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def reuse_ttl(self) -> float:
        if self.router.reuse_ttl is not None:
            return self.router.reuse_ttl
        return 0.9 * self.kv_transfer.decoder_kv_blocks_ttl
