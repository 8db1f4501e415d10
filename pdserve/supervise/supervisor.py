"""The supervision loop: ordered start, readiness by health probe, restarts with backoff, ordered stop.

It never renders anything: it records each process's state in state.json, which the CLI reads.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from typing import Any

import psutil

from pdserve.launchers import local
from pdserve.observe.logfiles import rotate_if_large
from pdserve.plan.records import ClusterPlan
from pdserve.spec.schema import SupervisorSpec
from pdserve.state.folder import ClusterDir, read_json
from pdserve.state.records import ProcState
from pdserve.supervise.canary import run_canary
from pdserve.supervise.health import probe
from pdserve.supervise.process import ManagedProcess

log = logging.getLogger("pdserve.supervisor")

TICK = 0.25
LOG_CHECK_INTERVAL = 5.0
CANARY_TRIES = 3
STARTUP_PROBE_INTERVAL = 0.5
FAILED_PROBES_BEFORE_UNHEALTHY = 3


class Supervisor:
    def __init__(self, plan: ClusterPlan, cdir: ClusterDir, adopt: bool = False):
        self.plan = plan
        self.cdir = cdir
        self.policy = SupervisorSpec.model_validate(plan.supervisor)
        self.procs = [ManagedProcess(p, self.policy) for p in plan.processes]
        self.phase = "starting"
        self.error: str | None = None
        self.stop_requested = False
        self._failed_probes: dict[str, int] = {}
        self._own_create_time = psutil.Process().create_time()
        self._next_log_check = 0.0
        self.adopt = adopt
        self._verify: set[str] = set()        # restarted servers whose P->D path is not yet verified
        self._canary_failures = 0
        self._next_canary = 0.0
        self.restart_queue: deque[str] = deque()
        self._restarting: ManagedProcess | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self.stop_requested = True

    def run(self, install_signals: bool = True) -> int:
        if install_signals:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        try:
            previous = (self.cdir.read_state() or {}).get("processes") or {} if self.adopt else {}
            for proc in self.procs:
                if not self._adopt(proc, previous.get(proc.name) or {}):
                    self._start(proc)
            self.write_state()
            while not self.stop_requested:
                self.tick()
                self.write_state()
                time.sleep(TICK)
        finally:
            self.shutdown()
        return 1 if self.phase == "failed" else 0

    def shutdown(self) -> None:
        if self.phase != "failed":
            self.phase = "stopping"
        self.write_state()
        order = {p.name: i for i, p in enumerate(self.plan.stop_order())}
        for proc in sorted(self.procs, key=lambda p: order[p.name]):
            if proc.state == ProcState.STOPPED:
                continue
            proc.to(ProcState.STOPPING)
            self.write_state()
            h = proc.handle
            local.stop(h.pid if h else None, h.create_time if h else None, proc.marker,
                       self.policy.stop_timeout, h.popen if h else None)
            proc.to(ProcState.STOPPED)
            proc.handle = None
            self.write_state()
        if self.phase != "failed":
            self.phase = "stopped"
        self.write_state()

    # -- one pass over every process ---------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        self._take_requests()
        self._restart_next()
        if now >= self._next_log_check:
            self._next_log_check = now + LOG_CHECK_INTERVAL
            for path in self.cdir.logs_dir.glob("*.log"):
                if rotate_if_large(path, int(self.policy.log_max_mb * 1024 * 1024), self.policy.log_keep):
                    log.info("rotated %s", path.name)
        for proc in self.procs:
            self._step(proc, now)
            if self.stop_requested:
                return
        fatal = [p for p in self.procs if p.state == ProcState.FATAL]
        if self.phase == "starting" and fatal:
            # gave up on a process before the cluster was ever fully up: `up` fails and stops the rest
            self.phase = "failed"
            self.error = f"{fatal[0].name}: {fatal[0].message}"
            self.stop_requested = True
        elif self.phase == "starting" and all(p.state == ProcState.READY for p in self.procs):
            if self._canary_passes(now):
                self.phase = "running"
                log.info("all processes ready")
        elif self._verify and all(p.state == ProcState.READY for p in self.procs):
            self._verify_restarted(now)
        elif self.phase == "running" and fatal:
            self.phase = "degraded"
        elif self.phase == "degraded" and not fatal:
            self.phase = "running"

    def _step(self, proc: ManagedProcess, now: float) -> None:
        st = proc.state
        if st.running and not local.is_alive(proc.handle):
            self._on_exit(proc, now)
        elif st == ProcState.STARTING:
            if now - proc.last_probe >= STARTUP_PROBE_INTERVAL:
                proc.last_probe = now
                if probe(proc.plan.health_url):
                    proc.ever_ready = True
                    proc.to(ProcState.READY, "health check passed")
                    log.info("%s ready", proc.name)
                    if self.phase in ("running", "degraded") and proc.plan.role != "router":
                        self._verify.add(proc.name)
                elif now - proc.state_since > self.policy.startup_timeout:
                    self._on_exit(proc, now, f"not ready after {self.policy.startup_timeout:g}s")
        elif st in (ProcState.READY, ProcState.UNHEALTHY):
            if now - proc.last_probe >= self.policy.health_interval:
                proc.last_probe = now
                self._check_health(proc, now)
        elif st == ProcState.BACKOFF and now >= proc.next_start:
            if len(proc.failures) > self.policy.max_restarts:
                proc.to(ProcState.FATAL, f"crash loop: {len(proc.failures)} failures within "
                                         f"{self.policy.restart_window:g}s; last: {proc.message}")
                log.error("%s fatal: %s", proc.name, proc.message)
            else:
                proc.restarts += 1
                self._start(proc)

    def _check_health(self, proc: ManagedProcess, now: float) -> None:
        if probe(proc.plan.health_url):
            self._failed_probes[proc.name] = 0
            if proc.state == ProcState.UNHEALTHY:
                proc.to(ProcState.READY, "health check passed again")
            return
        fails = self._failed_probes[proc.name] = self._failed_probes.get(proc.name, 0) + 1
        if proc.state == ProcState.READY and fails >= FAILED_PROBES_BEFORE_UNHEALTHY:
            proc.to(ProcState.UNHEALTHY, f"{fails} health checks failed while the process lives")
            log.warning("%s unhealthy", proc.name)
        elif proc.state == ProcState.UNHEALTHY and now - proc.state_since > self.policy.unhealthy_grace:
            self._on_exit(proc, now, f"unhealthy for {self.policy.unhealthy_grace:g}s; restarted")

    def _on_exit(self, proc: ManagedProcess, now: float, why: str | None = None) -> None:
        if why is None:
            rc = proc.handle.popen.poll() if proc.handle and proc.handle.popen else None
            why = f"exited with code {rc}" if rc is not None else "process disappeared"
        # Stop the whole group: the API server may be gone (or hung) while its engine children hold memory.
        self._kill(proc)
        if self.phase == "starting" and not proc.ever_ready:
            proc.to(ProcState.FATAL, why)
            self.phase = "failed"
            self.error = f"{proc.name} {why} before it became ready"
            log.error(self.error)
            self.stop_requested = True
            return
        proc.record_failure(now)
        proc.next_start = now + proc.backoff_delay()
        proc.to(ProcState.BACKOFF, why)
        log.warning("%s %s; restart in %.1fs", proc.name, why, proc.next_start - now)

    def _start(self, proc: ManagedProcess) -> None:
        proc.handle = local.start(proc.plan, self.cdir.log_path(proc.name))
        proc.started_at = time.time()
        proc.last_probe = 0.0
        self._failed_probes[proc.name] = 0
        proc.to(ProcState.STARTING, f"pid {proc.handle.pid}")
        log.info("%s started, pid %d", proc.name, proc.handle.pid)

    # -- canary: the P->D KV path really works ------------------------------------------------------
    def _canary(self) -> tuple[bool, str]:
        cfg = self.plan.router_config
        decode = [p.url for p in self.plan.processes if p.role == "decode"]
        return run_canary(self.plan.router.url, decode, cfg.get("model", ""), cfg.get("api_key_env"),
                          timeout=min(float(cfg.get("request_timeout", 120.0)), 120.0))

    def _canary_try(self, now: float) -> tuple[bool, str, bool] | None:
        """One canary, at most every 2 s after a failure: None while waiting, else (passed, what happened,
        out of tries). CANARY_TRIES failures in a row are out of tries, and the count starts over."""
        if now < self._next_canary:
            return None
        ok, detail = self._canary()
        if ok:
            self._canary_failures = 0
            return True, detail, False
        self._canary_failures += 1
        self._next_canary = time.monotonic() + 2.0
        out_of_tries = self._canary_failures >= CANARY_TRIES
        if out_of_tries:
            self._canary_failures = 0
        return False, detail, out_of_tries

    def _canary_passes(self, now: float) -> bool:
        """At start-up: a few tries (backends may still be warming up), then `up` fails with the reason."""
        if not self.policy.canary:
            return True
        tried = self._canary_try(now)
        if tried is None:
            return False
        ok, detail, out_of_tries = tried
        log.info("%s", detail)
        if out_of_tries:
            self.phase, self.error, self.stop_requested = "failed", detail, True
        return ok

    def _verify_restarted(self, now: float) -> None:
        """After a prefill or decode restart, check the pair with a canary. Decode servers that keep failing
        to read from a restarted prefill server hold stale NIXL agent state: restart them too."""
        if not self.policy.canary:
            self._verify.clear()
            return
        tried = self._canary_try(now)
        if tried is None:
            return
        ok, detail, out_of_tries = tried
        restarted = ", ".join(sorted(self._verify))
        if ok:
            log.info("after restarting %s: %s", restarted, detail)
            self._verify.clear()
            return
        log.warning("after restarting %s: %s", restarted, detail)
        if out_of_tries:
            roles = {p.plan.role for p in self.procs if p.name in self._verify}
            self._verify.clear()
            if "prefill" in roles:
                decode = [p.name for p in self.procs if p.plan.role == "decode" and p.name not in self.restart_queue]
                log.warning("restarting %s: KV reads keep failing after a prefill restart", ", ".join(decode))
                self.restart_queue.extend(decode)

    # -- restarts asked for by `pdserve restart` -----------------------------------------------------
    def _take_requests(self) -> None:
        for path in sorted(self.cdir.requests_dir.glob("*.json")):
            request = read_json(path) or {}
            path.unlink(missing_ok=True)
            if request.get("reload"):
                self._reload_plan()
            known = {p.name for p in self.procs}
            names = [n for n in request.get("restart") or [] if n in known]
            log.info("restart requested for %s", ", ".join(names) or "nothing known")
            self.restart_queue.extend(n for n in names if n not in self.restart_queue)

    def _reload_plan(self) -> None:
        """`up` with a changed config wrote a new plan: the next start of each process uses it."""
        data = self.cdir.read_plan()
        if not data:
            return
        new = ClusterPlan.from_dict(data)
        self.plan = new
        self.policy = SupervisorSpec.model_validate(new.supervisor)
        for proc in self.procs:
            proc.plan = new.by_name(proc.name)
            proc.policy = self.policy
        log.info("reloaded the plan")

    def _restart_next(self) -> None:
        """One process at a time, the next only once the previous is ready again (or gave up), so a role
        with several replicas keeps serving through a full restart."""
        if self._restarting is not None:
            if self._restarting.state not in (ProcState.READY, ProcState.FATAL):
                return
            self._restarting = None
        if not self.restart_queue:
            return
        name = self.restart_queue.popleft()
        proc = next(p for p in self.procs if p.name == name)
        if proc.state.running:
            proc.to(ProcState.STOPPING, "restart requested")
            self._kill(proc)
            proc.to(ProcState.STOPPED)
        proc.restarts += 1
        self._start(proc)
        self._restarting = proc

    def _adopt(self, proc: ManagedProcess, before: dict[str, Any]) -> bool:
        """Take over a process the previous (dead) supervisor started, if it is provably the same one;
        it is ready again once its health endpoint answers."""
        handle = local.adopt(before.get("pid"), before.get("create_time"), proc.marker)
        if handle is None:
            return False
        proc.handle = handle
        proc.started_at = before.get("started_at")
        proc.restarts = int(before.get("restarts") or 0)
        proc.ever_ready = True     # it served before: dying now means restart, not a failed `up`
        proc.last_probe = 0.0
        proc.to(ProcState.STARTING, f"adopted pid {handle.pid}")
        log.info("%s adopted, pid %d", proc.name, handle.pid)
        return True

    def _kill(self, proc: ManagedProcess) -> None:
        h = proc.handle
        if h is not None:
            local.stop(h.pid, h.create_time, proc.marker, self.policy.stop_timeout, h.popen)

    # -- state file --------------------------------------------------------------------------------
    def write_state(self) -> None:
        self.cdir.write_state({
            "cluster": self.plan.name, "phase": self.phase, "error": self.error, "updated_at": time.time(),
            "supervisor": {"pid": os.getpid(), "create_time": self._own_create_time},
            "router_url": self.plan.router.url,
            "processes": {p.name: p.snapshot() for p in self.procs},
        })
