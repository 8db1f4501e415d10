"""One supervised process: its plan, its launcher and handle, and its walk through the state machine."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.launchers.base import Handle, Launcher
from pdserve.launchers.stop import TimedStop
from pdserve.plan.records import ProcessPlan
from pdserve.spec.schema import SupervisorSpec
from pdserve.state.records import ProcessRecord, ProcState
from pdserve.supervise.transitions import check_transition


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
                             restarts=self.restarts, message=self.message)
