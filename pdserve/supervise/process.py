"""One supervised process: its plan, its live handle and its walk through the state machine."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.launchers import local
from pdserve.plan.records import MARKER_ENV, ProcessPlan
from pdserve.spec.schema import SupervisorSpec
from pdserve.state.records import ProcState, check_transition


@dataclass
class ManagedProcess:
    plan: ProcessPlan
    policy: SupervisorSpec
    state: ProcState = ProcState.STOPPED
    handle: local.Handle | None = None
    started_at: float | None = None       # wall clock, for uptime shown to people
    state_since: float = field(default_factory=time.monotonic)
    ever_ready: bool = False
    restarts: int = 0
    failures: deque = field(default_factory=deque)   # monotonic times of unplanned exits
    next_start: float = 0.0
    last_probe: float = 0.0
    message: str = ""

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def marker(self) -> str:
        return self.plan.env[MARKER_ENV]

    def to(self, new: ProcState, message: str = "") -> None:
        self.state = check_transition(self.state, new)
        self.state_since = time.monotonic()
        if message:
            self.message = message

    def backoff_delay(self) -> float:
        p = self.policy
        return min(p.backoff_max, p.backoff_initial * 2 ** max(0, len(self.failures) - 1))

    def record_failure(self, now: float) -> bool:
        """Count an unplanned exit; True when the crash-loop limit is reached (-> fatal)."""
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.restart_window:
            self.failures.popleft()
        return len(self.failures) > self.policy.max_restarts

    def snapshot(self) -> dict[str, Any]:
        h = self.handle
        return {
            "role": self.plan.role, "state": self.state.value,
            "pid": h.pid if h else None, "create_time": h.create_time if h else None,
            "host": self.plan.host, "port": self.plan.port, "started_at": self.started_at,
            "restarts": self.restarts, "message": self.message, "marker": self.marker,
        }
