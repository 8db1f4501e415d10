"""Requests from the CLI, and the order restarts run in.

`pdserve restart`, `up` of a changed config (a restart with the plan reloaded) and `down --timeout` each
write one request file into the state folder; the supervisor takes them on its next tick. Restarts, asked
for there, by a peer reset or after a failed canary, run one process at a time: the next only once the
previous is ready again (or gave up), so a role with several replicas keeps serving through a full restart.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.plan.records import ClusterPlan
from pdserve.spec.schema import SupervisorSpec
from pdserve.state.folder import ClusterDir, read_json
from pdserve.state.records import ProcState
from pdserve.supervise.process import ManagedProcess

log = logging.getLogger("pdserve.supervisor")


def take_requests(cdir: ClusterDir) -> Iterator[dict[str, Any]]:
    """Each request in the order it was written, its file removed once read."""
    for path in sorted(cdir.requests_dir.glob("*.json")):
        request = read_json(path) or {}
        path.unlink(missing_ok=True)
        yield request


def reload_plan(cdir: ClusterDir, procs: list[ManagedProcess]) -> tuple[ClusterPlan, SupervisorSpec] | None:
    """`up` with a changed config wrote a new plan: the next start of each process uses it. The plan and
    its supervisor policy, or None when there is no plan to read."""
    data = cdir.read_plan()
    if not data:
        return None
    new = ClusterPlan.from_dict(data)
    policy = SupervisorSpec.model_validate(new.supervisor)
    for proc in procs:
        proc.plan = new.by_name(proc.name)
        proc.policy = policy
    log.info("reloaded the plan")
    return new, policy


@dataclass
class RestartQueue:
    names: deque[str] = field(default_factory=deque)    # waiting, in order (peer resets add to it too)
    current: ManagedProcess | None = None               # restarting now

    def add(self, names: Iterable[str]) -> None:
        self.names.extend(n for n in names if n not in self.names)

    def request(self, names: Iterable[str], procs: list[ManagedProcess]) -> None:
        """Restarts the CLI asked for; a name of no process is left out."""
        names = [n for n in names if any(p.name == n for p in procs)]
        if names:
            log.info("restart requested for %s", ", ".join(names))
        self.add(names)

    def start_next(self, by_name: Callable[[str], ManagedProcess], stop: Callable[[ManagedProcess], None],
                   start: Callable[[ManagedProcess], None]) -> None:
        """Restart the next process if its turn has come: stop it (a restart after the stop), or start it
        when nothing of it runs."""
        proc = self.next(by_name)
        if proc is None:
            return
        if proc.state == ProcState.STOPPING:
            proc.teardown.restart = True
        elif proc.state.has_process or proc.handle is not None:
            stop(proc)
        else:
            proc.restarts += 1
            start(proc)

    def next(self, by_name: Callable[[str], ManagedProcess]) -> ManagedProcess | None:
        """The process to restart now, if its turn has come."""
        if self.current is not None:
            # BACKOFF: it died again after the restart; its own backoff takes it from here, and the queue
            # must move (it may hold that server's peer reset, which the server waits for)
            if self.current.state not in (ProcState.READY, ProcState.FATAL, ProcState.BACKOFF):
                return None
            self.current = None
        if not self.names:
            return None
        self.current = by_name(self.names.popleft())
        return self.current
