"""One supervised process: its plan, its launcher and handle, and its walk through the state machine.

As in supervisord, each process steps itself through its own transitions (`step`): it notices its exit,
runs its timed stop, probes its health, counts failed probes and its backoff. What it cannot decide
alone, because it depends on the cluster (the phase, its peers, the others it waits for, restart
requests), it reports as an Event, and the supervisor decides.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pdserve.launchers.base import Handle, HostUnreachable, Launcher
from pdserve.launchers.stop import TimedStop
from pdserve.plan.records import ProcessPlan
from pdserve.spec.schema import SupervisorSpec
from pdserve.state.records import ProcessRecord, ProcState
from pdserve.supervise.transitions import check_transition

log = logging.getLogger("pdserve.supervisor")

STARTUP_PROBE_INTERVAL = 0.5
FAILED_PROBES_BEFORE_UNHEALTHY = 3
# SIGTERM -> SIGKILL for what outlived a leader that already died. A dead vLLM API server's engine core never
# ends on SIGTERM (it waits for work it can no longer report: every CPU and H200 crash run, logs in
# benchmarks/results/2026-12-05-gpu-mps-60a3f3b), so a longer grace only delays the restart.
ORPHAN_GRACE = 1.0


class Prober(Protocol):
    """What a step needs of the supervisor's services (Services has both): where probes run, and the probe."""
    executor: Executor
    probe: Callable[[str], bool]


# -- what a step reports to the supervisor ---------------------------------------------------------
@dataclass(frozen=True)
class Exited:
    """The process died (`orphans`: its leader is gone, what is left of the tree has nothing to finish)
    or must go (not ready in time, unhealthy too long)."""
    why: str
    orphans: bool = False


@dataclass(frozen=True)
class Stopped:
    """Its timed stop ended: nothing of the tree is left (or what is left would not die)."""
    then: ProcState
    restart: bool


class Notice(enum.Enum):
    READY = "its health check passed: it is ready (again)"
    START_DUE = "its backoff is over"
    IDLE = "stopped, and nothing of it was started yet"


Event = Exited | Stopped | Notice


@dataclass
class Teardown:
    """A stop in progress: the timed stop of the tree, and what comes after it."""
    stop: TimedStop
    then: ProcState                  # stopped, backoff or fatal once nothing of the tree is left
    message: str
    restart: bool = False            # a requested restart: start again once stopped


@dataclass
class ManagedProcess:
    plan: ProcessPlan
    policy: SupervisorSpec
    launcher: Launcher
    state: ProcState = ProcState.STOPPED
    state_since: float = 0.0
    handle: Handle | None = None
    started_at: float | None = None       # wall clock, for uptime shown to people
    ever_ready: bool = False
    restarts: int = 0
    failures: deque = field(default_factory=deque)   # monotonic times of unplanned exits
    failed_starts: int = 0                # exits before ready since the last time it was ready
    next_start: float = 0.0
    last_probe: float = 0.0
    failed_probes: int = 0
    probe: Future | None = None           # a health probe in flight
    teardown: Teardown | None = None
    message: str = ""

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def role(self) -> str:
        return self.plan.role

    def to(self, new: ProcState, now: float, message: str = "") -> None:
        self.state = check_transition(self.state, new)
        self.state_since = now
        if message:
            self.message = message

    def backoff_delay(self) -> float:
        p = self.policy
        return min(p.backoff_max, p.backoff_initial * 2 ** max(0, len(self.failures) - 1))

    def record_failure(self, now: float) -> None:
        """Count an unplanned exit within the restart window."""
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.restart_window:
            self.failures.popleft()

    @property
    def crash_looping(self) -> bool:
        return len(self.failures) > self.policy.max_restarts

    def record(self) -> ProcessRecord:
        return ProcessRecord(name=self.name, role=self.role, state=self.state, host=self.plan.host,
                             port=self.plan.port, handle=self.handle, started_at=self.started_at,
                             restarts=self.restarts, message=self.message, host_name=self.plan.host_name,
                             url=self.plan.url)

    # -- one step ----------------------------------------------------------------------------------
    def step(self, now: float, services: Prober) -> list[Event]:
        """Look at the process once, promptly, and take its own transitions; report what the cluster
        must decide. Raises HostUnreachable when its host cannot be asked."""
        st = self.state
        if st == ProcState.STOPPING:
            stopped = self.step_stop(now)
            return [stopped] if stopped else []
        if st.has_process and not self.launcher.is_alive(self.handle):
            rc = self.launcher.exit_code(self.handle) if self.handle else None
            return [Exited(f"exited with code {rc}" if rc is not None else "process disappeared", orphans=True)]
        if st == ProcState.STARTING:
            healthy = self._probe_result(now, STARTUP_PROBE_INTERVAL, services)
            if healthy:
                self._became_ready(now)
                return [Notice.READY]
            if now - self.state_since > self.policy.startup_timeout:
                return [Exited(f"not ready after {self.policy.startup_timeout:g}s")]
        elif st in (ProcState.READY, ProcState.UNHEALTHY):
            healthy = self._probe_result(now, self.policy.health_interval, services)
            if healthy is not None:
                return self._after_probe(now, healthy)
        elif st == ProcState.BACKOFF and now >= self.next_start:
            return [Notice.START_DUE]
        elif st == ProcState.STOPPED and self.handle is None:
            return [Notice.IDLE]
        return []

    def _probe_result(self, now: float, interval: float, services: Prober) -> bool | None:
        """The result of a probe that finished (None while none has): one in flight per process, the next
        submitted `interval` after the previous was."""
        if self.probe is not None:
            if not self.probe.done():
                return None
            result, self.probe = bool(self.probe.result()), None
            return result
        if now - self.last_probe >= interval:
            self.last_probe = now
            self.probe = services.executor.submit(services.probe, self.plan.health_url)
            if self.probe.done():              # an inline executor (tests) answers at once
                result, self.probe = bool(self.probe.result()), None
                return result
        return None

    def _became_ready(self, now: float) -> None:
        self.ever_ready = True
        self.failed_starts = 0
        self.failed_probes = 0
        self.to(ProcState.READY, now, "health check passed")
        log.info("%s ready", self.name)

    def _after_probe(self, now: float, healthy: bool) -> list[Event]:
        if healthy:
            self.failed_probes = 0
            if self.state == ProcState.UNHEALTHY:
                self.to(ProcState.READY, now, "health check passed again")
            return []
        self.failed_probes += 1
        if self.state == ProcState.READY and self.failed_probes >= FAILED_PROBES_BEFORE_UNHEALTHY:
            self.to(ProcState.UNHEALTHY, now, f"{self.failed_probes} health checks failed while the process lives")
            log.warning("%s unhealthy", self.name)
        elif self.state == ProcState.UNHEALTHY and now - self.state_since > self.policy.unhealthy_grace:
            return [Exited(f"unhealthy for {self.policy.unhealthy_grace:g}s; restarted")]
        return []

    def give_up(self, now: float) -> None:
        """A crash loop: fatal, not restarted again."""
        self.to(ProcState.FATAL, now, f"crash loop: {len(self.failures)} failures within "
                                      f"{self.policy.restart_window:g}s; last: {self.message}")
        log.error("%s fatal: %s", self.name, self.message)

    # -- timed stop --------------------------------------------------------------------------------
    def begin_stop(self, now: float, then: ProcState, message: str, restart: bool, grace: float) -> None:
        """SIGTERM to the whole tree; SIGKILL `grace` s later (step_stop goes on from here)."""
        self.to(ProcState.STOPPING, now, message)
        self.probe = None
        stop = TimedStop(self.launcher, self.handle, now + grace,
                         lambda left: log.warning("%s: %d process(es) still alive %gs after SIGTERM: SIGKILL",
                                                  self.name, left, grace))
        self.teardown = Teardown(stop, then, message, restart)
        if self.handle is not None:
            sent = stop.terminate()
            log.info("%s: SIGTERM to %d process(es) (%s)", self.name, sent, message)

    def step_stop(self, now: float) -> Stopped | None:
        td = self.teardown
        assert td is not None
        left = td.stop.step(now)
        if left is None:
            return None
        message = td.message + (f"; {left} process(es) would not die" if left else "")
        if left:
            log.error("%s: %s", self.name, message)
        self.handle, self.teardown = None, None
        self.to(td.then, now, message)
        if td.then == ProcState.BACKOFF:
            self.next_start = now + self.backoff_delay()
            log.info("%s stopped; restart in %.1fs", self.name, self.backoff_delay())
        return Stopped(td.then, td.restart)

    def abandon(self, err: HostUnreachable) -> None:
        """Its host cannot be reached while stopping: stopped as far as this supervisor can tell."""
        self.handle, self.teardown, self.state = None, None, ProcState.STOPPED
        self.message = f"{err.message}: its processes may still run there"
        log.error("%s: %s", self.name, self.message)

    # -- starting ----------------------------------------------------------------------------------
    def start(self, now: float, log_path: Path, wall_time: Callable[[], float]) -> None:
        """Start it through its launcher; a start that fails is a failure with backoff."""
        try:
            self.handle = self.launcher.start(self.plan, log_path)
        except (OSError, HostUnreachable) as err:
            self.handle = None
            if self.state != ProcState.BACKOFF:
                self.to(ProcState.BACKOFF, now)
            self.record_failure(now)
            self.next_start = now + self.backoff_delay()
            self.message = f"could not start: {err}"
            log.error("%s could not start: %s", self.name, err)
            return
        self.started_at = wall_time()
        self.last_probe = 0.0
        self.failed_probes = 0
        self.to(ProcState.STARTING, now, f"pid {self.handle.pid}")
        log.info("%s started, pid %s", self.name, self.handle.pid)

    def adopt(self, before: ProcessRecord, now: float) -> bool:
        """Take over a process the previous (dead) supervisor started, if it is provably the same one;
        it is ready again once its health endpoint answers."""
        handle = self.launcher.adopt(before.handle) if before.handle else None
        if handle is None:
            return False
        self.handle = handle
        self.started_at = before.started_at
        self.restarts = before.restarts
        self.ever_ready = True     # it served before: dying now means restart, not a failed `up`
        self.last_probe = 0.0
        self.to(ProcState.STARTING, now, f"adopted pid {handle.pid}")
        log.info("%s adopted, pid %s", self.name, handle.pid)
        return True
