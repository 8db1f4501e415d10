"""The router processes of a plan: one, or `router.replicas` sharing one port; and the managed Redis that
`router.store: managed` asks for.

Replicas share router.port through SO_REUSEPORT, so clients, load balancers and the canary keep one URL and
the kernel spreads connections over the live replicas (a dead one's socket leaves the group at once). Each
replica also listens on its own port (router.port + 1 + i): the supervisor's health probe, `status` and the
tests must reach one replica, which the shared port cannot promise.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import quote

from pdserve.engine.names import CONTROL_TOKEN_ENV
from pdserve.plan.records import (BIND, LOOPBACK_ONLY, MARKER, MARKER_ENV, PROGRAM, REPLICA, SECRET, STATE,
                                  ProcessPlan, argv_slot, connect_host, env_slot)
from pdserve.roles import ROUTER, STORE
from pdserve.spec.schema import MANAGED_STORE, ClusterSpec

REDIS_SERVER = "redis-server"
STORE_NAME = "redis"
MEMORY_STORE = "memory"
# The cluster's store secret in its state folder (`up` makes it: state/secret.py), a Redis config line
# (`requirepass ...`): the managed Redis includes it, the routers read it (router/kv/store_redis.py).
SECRET_FILE = "store-secret.conf"
REUSE_FILE = "reuse-store.json"       # the memory store a drained router left (router/kv/store_file.py)
ROUTER_STOP_MARGIN_S = 10.0           # a router's SIGKILL comes this long after its drain limit at the earliest



def store_url(spec: ClusterSpec, cluster_dir: Path | None = None) -> str:
    """router.store as the router reads it: `managed` becomes the managed Redis's URL. A Redis URL names the
    cluster's store secret (SECRET_FILE), whose hash namespaces the cluster's keys: every replica reads the one
    file, which outlives restarts, and no other cluster has it, whatever its name (issue 35, item 10). The
    managed Redis's password is that secret too, read from the file: never in a file of the plan nor on a
    command line. A URL that names its own deployment keeps it."""
    if cluster_dir is None:      # a plan of no state folder: the store as given
        return f"redis://127.0.0.1:{spec.router.managed_store_port}/0" if spec.router.store == MANAGED_STORE \
            else spec.router.store
    secret = quote(str(Path(cluster_dir) / SECRET_FILE))
    if spec.router.store == MANAGED_STORE:
        return (f"redis://127.0.0.1:{spec.router.managed_store_port}/0"
                f"?deployment_file={secret}&password_file={secret}")
    url = spec.router.store
    if url == MEMORY_STORE or re.search(r"[?&]deployment(_file)?=", url):
        return url
    return url + ("&" if "?" in url else "?") + f"deployment_file={secret}"


def reuse_file(spec: ClusterSpec, cluster_dir) -> str | None:
    """Where a drained router keeps the memory store for the next one (router/kv/store_file.py): the cluster
    folder (routers run on this machine). A shared store keeps its entries itself."""
    return str(Path(cluster_dir) / REUSE_FILE) if spec.router.store == MEMORY_STORE else None


def router_plans(spec: ClusterSpec, python: str, config_path: str, marker) -> list[ProcessPlan]:
    """`marker(name)`: the environment marker that finds the process's tree again (plan/records.py)."""
    r = spec.router
    # SIGTERM -> SIGKILL: the drain, then what the router does after it (the memory store written)
    grace = r.drain_timeout + ROUTER_STOP_MARGIN_S

    rhost = connect_host(r.host)
    base = [python, "-m", "pdserve.router", "--config", config_path]
    # the router's bind address is in its config (router.json), not in argv
    where = {PROGRAM: argv_slot(0), STATE: argv_slot(4), MARKER: env_slot(MARKER_ENV)}
    # The key's value comes from the environment of whoever starts the router (`up` hands it to a running
    # supervisor: orchestrate/secrets.py), under its own name, which router.json names.
    key = {r.api_key_env: r.api_key_env} if r.api_key_env else {}
    if spec.kv_transfer.bidirectional_kv_xfer:    # D's held-KV routes answer only it (the supervisor's token)
        key[CONTROL_TOKEN_ENV] = CONTROL_TOKEN_ENV
    if r.replicas == 1:
        return [ProcessPlan(name="router", role=ROUTER, argv=base, env={MARKER_ENV: marker("router")},
                            host=r.host, port=r.port, health_url=f"http://{rhost}:{r.port}/health",
                            env_from=key, host_specific=where, stop_grace=grace)]

    out = []
    for i in range(r.replicas):
        name, own = f"router-{i}", r.replica_port(i)
        out.append(ProcessPlan(name=name, role=ROUTER, argv=[*base, "--replica", name, "--own-port", str(own)],
                               env={MARKER_ENV: marker(name)}, host=r.host, port=own,
                               health_url=f"http://{rhost}:{own}/health", env_from=key, stop_grace=grace,

                               host_specific={**where, REPLICA: argv_slot(len(base) + 1)}))
    return out


def store_plans(spec: ClusterSpec, cluster_dir, marker) -> list[ProcessPlan]:
    """The managed Redis: loopback only, the cluster folder as its working directory, memory bounded by
    reuse_max_mb (entries nearest their expiry evicted first), nothing written there (an entry is worth
    at most reuse_ttl seconds, and D's blocks may be gone after a restart anyway), and a password: it includes
    the cluster's store secret (SECRET_FILE, mode 0600), so no command line shows the password."""
    if spec.router.store != MANAGED_STORE:
        return []
    port = spec.router.managed_store_port
    argv = [shutil.which(REDIS_SERVER) or REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(port),
            "--protected-mode", "yes", "--dir", str(cluster_dir), "--save", "", "--appendonly", "no",
            "--maxmemory", f"{max(1, int(spec.router.reuse_max_mb))}mb", "--maxmemory-policy", "volatile-ttl",
            "--daemonize", "no", "--logfile", "", "--include", str(Path(cluster_dir) / SECRET_FILE)]
    where = {PROGRAM: argv_slot(0), BIND: argv_slot(2), LOOPBACK_ONLY: argv_slot(6), STATE: argv_slot(8),
             SECRET: argv_slot(len(argv) - 1), MARKER: env_slot(MARKER_ENV)}
    return [ProcessPlan(name=STORE_NAME, role=STORE, argv=argv, env={MARKER_ENV: marker(STORE_NAME)},
                        host="127.0.0.1", port=port, health_url=f"redis://127.0.0.1:{port}", host_specific=where)]
