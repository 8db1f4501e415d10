"""The transitions allowed between process states (modelled on supervisord).

    stopped -> starting -> ready <-> unhealthy
                  |          |          |
                  +----------+----------+--> stopping --> stopped | backoff | fatal
    backoff -> starting (retry) | fatal (gave up) | stopping
    fatal -> starting (a requested restart) | stopping
    stopped, fatal -> backoff (the launcher could not start it)

Stopping is timed: SIGTERM to the process's whole tree when it is entered, SIGKILL on a later tick once the
deadline passes, and it ends only when nothing of the tree is left.
"""

from __future__ import annotations

from pdserve.state.records import ProcState

S = ProcState
ALLOWED: dict[ProcState, frozenset[ProcState]] = {
    S.STOPPED: frozenset({S.STARTING, S.BACKOFF}),
    S.STARTING: frozenset({S.READY, S.STOPPING}),
    S.READY: frozenset({S.UNHEALTHY, S.STOPPING}),
    S.UNHEALTHY: frozenset({S.READY, S.STOPPING}),
    S.STOPPING: frozenset({S.STOPPED, S.BACKOFF, S.FATAL}),
    S.BACKOFF: frozenset({S.STARTING, S.FATAL, S.STOPPING}),
    S.FATAL: frozenset({S.STARTING, S.BACKOFF, S.STOPPING}),
}


class InvalidTransition(RuntimeError):
    pass


def check_transition(current: ProcState, new: ProcState) -> ProcState:
    if new not in ALLOWED[current]:
        raise InvalidTransition(f"{current.value} -> {new.value} is not an allowed transition")
    return new
