"""`restart` (and `up` of a running cluster): ask the running supervisor to restart processes one at a time,
and wait until each is ready again."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.errors import NotRunningError, PdserveError, UsageError
from pdserve.orchestrate.lookup import supervisor_process
from pdserve.roles import ROLE_ORDER
from pdserve.state.folder import ClusterDir, write_json_atomic
from pdserve.state.records import ProcState


def request_restart(cdir: ClusterDir, names: list[str] | None, reload: bool = False,
                    env: dict[str, str] | None = None) -> dict[str, int]:
    """Ask the running supervisor to restart some processes (None: all), one at a time in start order
    (prefill replicas, then decode, then the router); with `reload`, from the plan now on disk; `env`: the
    secrets the plan copies from this environment (secrets.py), for the supervisor to start them with.
    Returns each one's restart count before the request."""
    state = cdir.read_state()
    if supervisor_process(state) is None:
        raise NotRunningError(f"cluster {cdir.name} has no running supervisor",
                              hint=f"`pdserve up` re-attaches to live processes; `pdserve status {cdir.name}`")
    procs = state.processes
    unknown = [n for n in names or [] if n not in procs]
    if unknown:
        raise UsageError(f"no process {unknown[0]!r} in cluster {cdir.name}", hint=f"processes: {', '.join(procs)}")
    order = sorted(names if names is not None else procs, key=lambda n: ROLE_ORDER.get(procs[n].role, 9))
    # write_json_atomic's file is the user's alone (mkstemp: 0600) until the supervisor removes it
    write_json_atomic(cdir.requests_dir / f"{time.time_ns()}.json",
                      {"restart": order, "reload": reload, **({"env": env} if env else {})})
    return {n: procs[n].restarts for n in order}


def wait_restarted(cdir: ClusterDir, before: dict[str, int], timeout: float,
                   on_ready: Callable[[str], None]) -> None:
    """Until each process has restarted and is ready again; a fatal one or the timeout is an error."""
    deadline = time.monotonic() + timeout
    pending = dict(before)
    while pending:
        state = cdir.read_state()
        procs = state.processes if state else {}
        for name in list(pending):
            p = procs.get(name)
            if p is None or p.restarts <= pending[name]:
                continue                          # the supervisor has not restarted it yet
            if p.state == ProcState.READY:
                del pending[name]
                on_ready(name)
            elif p.state == ProcState.FATAL:
                raise PdserveError(f"{name} did not come back: {p.message}",
                                   hint=f"`pdserve logs {cdir.name} {name}`")
        if pending and time.monotonic() > deadline:
            raise PdserveError(f"not ready again after {timeout:g}s: {', '.join(pending)}",
                               hint=f"`pdserve status {cdir.name}`")
        time.sleep(0.25)
