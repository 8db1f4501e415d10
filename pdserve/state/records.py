"""Process states and the transitions allowed between them (modelled on supervisord).

    stopped -> starting -> ready <-> unhealthy
                  |          |          |
                  v          v          v
               backoff <-----+----------+      (the process died or was restarted)
                  |
                  +-> starting (retry) | fatal (gave up)
    any running state -> stopping -> stopped
"""

from __future__ import annotations

import enum


class ProcState(str, enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    BACKOFF = "backoff"
    FATAL = "fatal"
    STOPPING = "stopping"

    @property
    def running(self) -> bool:
        """A process exists (or should) in this state."""
        return self in (ProcState.STARTING, ProcState.READY, ProcState.UNHEALTHY)


ALLOWED: dict[ProcState, frozenset[ProcState]] = {
    ProcState.STOPPED: frozenset({ProcState.STARTING}),
    ProcState.STARTING: frozenset({ProcState.READY, ProcState.BACKOFF, ProcState.FATAL, ProcState.STOPPING}),
    ProcState.READY: frozenset({ProcState.UNHEALTHY, ProcState.BACKOFF, ProcState.STOPPING}),
    ProcState.UNHEALTHY: frozenset({ProcState.READY, ProcState.BACKOFF, ProcState.STOPPING}),
    ProcState.BACKOFF: frozenset({ProcState.STARTING, ProcState.FATAL, ProcState.STOPPING}),
    ProcState.FATAL: frozenset({ProcState.STOPPING, ProcState.STARTING}),
    ProcState.STOPPING: frozenset({ProcState.STOPPED}),
}


class InvalidTransition(RuntimeError):
    pass


def check_transition(current: ProcState, new: ProcState) -> ProcState:
    if new not in ALLOWED[current]:
        raise InvalidTransition(f"{current.value} -> {new.value} is not an allowed transition")
    return new
