"""The supervision loop: ordered start, readiness by health probe, restarts with backoff, timed stops.

Each tick looks at every process and returns at once: probes and canaries run on the executor and are
read on a later tick; a stop sends SIGTERM to the process's whole tree, SIGKILL once its deadline passes,
and ends when nothing of the tree is left. It never renders: it writes state.json, which the CLI reads.

Each process steps itself through its own transitions (process.py) and reports what it cannot decide
alone; the supervisor keeps what concerns the cluster: the order, the phase, peer resets, canaries,
requests from the CLI, the plan's reload and the state file.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from pdserve.launchers.base import HostUnreachable
from pdserve.observe.logfiles import rotate_if_large
from pdserve.plan.records import ClusterPlan
from pdserve.roles import SERVER_ROLES
from pdserve.spec.schema import SupervisorSpec
from pdserve.state.folder import ClusterDir
from pdserve.state.records import ClusterState, Phase, ProcessRecord, ProcState, SupervisorRecord
from pdserve.supervise.canary import CanaryGate
from pdserve.supervise.peers import PeerReset
from pdserve.supervise.process import ORPHAN_GRACE, Exited, ManagedProcess, Notice, Stopped
from pdserve.supervise.restarts import RestartQueue, reload_plan, take_requests
from pdserve.supervise.services import Services

log = logging.getLogger("pdserve.supervisor")

TICK = 0.25
LOG_CHECK_INTERVAL = 5.0


class Supervisor:
    def __init__(self, plan: ClusterPlan, cdir: ClusterDir, services: Services | None = None,
                 adopt: bool = False):
        self.plan = plan
        self.cdir = cdir
        self.services = services or Services()
        self.clock = self.services.clock
        self.policy = SupervisorSpec.model_validate(plan.supervisor)
        self.stop_timeout = self.policy.stop_timeout
        self.procs = [ManagedProcess(p, self.policy, self.services.launcher_for(plan, p),
                                     state_since=self.clock.monotonic()) for p in plan.processes]
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.stop_requested = False
        self.adopt = adopt
        self._next_log_check = 0.0
        self._verify: set[str] = set()        # restarted servers whose P->D path is not yet verified
        self.canary = CanaryGate(self.services.executor, self.services.canary)
        self.restarts = RestartQueue()
        self.restart_queue = self.restarts.names     # peer resets and the canary queue restarts too
        self.peers = PeerReset(self.services.executor, self.services.memory_held)
        self._record = SupervisorRecord(os.getpid(), _own_start_time())

    def by_name(self, name: str) -> ManagedProcess:
        return next(p for p in self.procs if p.name == name)

    # -- lifecycle ---------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self.stop_requested = True

    def run(self, install_signals: bool = True) -> int:
        if install_signals:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        try:
            self.begin()
            while not self.stop_requested:
                self.tick()
                self.write_state()
                self.clock.sleep(TICK)
        finally:
            self.shutdown()
            self.services.executor.shutdown(wait=False, cancel_futures=True)
        return 1 if self.phase == Phase.FAILED else 0

    def begin(self) -> None:
        """Adopt what a dead predecessor left running (when asked), start the rest in order."""
        previous = self.cdir.read_state() if self.adopt else None
        for proc in self.procs:
            before = previous.processes.get(proc.name) if previous else None
            if not (before and self._adopt(proc, before)):
                self._start_when_due(proc)
        self.write_state()

    def shutdown(self) -> None:
        """Stop every process in stop order (router, decode, prefill), each a timed stop; the next starts
        once the previous is gone. Ticks the clock, never blocks on a process."""
        if self.phase != Phase.FAILED:
            self.phase = Phase.STOPPING
        self._take_requests()          # `down --timeout` writes its timeout just before it signals us
        for plan in self.plan.stop_order():
            proc = self.by_name(plan.name)
            if proc.state in (ProcState.STOPPED, ProcState.FATAL, ProcState.BACKOFF) and proc.handle is None:
                continue
            try:
                if proc.state != ProcState.STOPPING:
                    self._begin_stop(proc, ProcState.STOPPED, "stopped by request")
                while proc.state == ProcState.STOPPING:
                    self._step_stopping(proc, self.clock.monotonic())
                    self.write_state()
                    if proc.state == ProcState.STOPPING:
                        self.clock.sleep(TICK / 5)
            except HostUnreachable as err:      # `down` reports what is left there; do not hang on it
                proc.abandon(err)
        if self.phase != Phase.FAILED:
            self.phase = Phase.STOPPED
        self.write_state()

    # -- one pass over every process ---------------------------------------------------------------
    def tick(self) -> None:
        now = self.clock.monotonic()
        self._take_requests()
        self._restart_next()
        if now >= self._next_log_check:
            self._next_log_check = now + LOG_CHECK_INTERVAL
            _rotate_logs(self.cdir, self.policy)
        for proc in self.procs:
            self._step(proc, now)
            if self.stop_requested:
                return
        self._update_phase(now)

    def _update_phase(self, now: float) -> None:
        fatal = [p for p in self.procs if p.state == ProcState.FATAL]
        all_ready = all(p.state == ProcState.READY for p in self.procs)
        if self.phase == Phase.STARTING:
            if fatal:
                # gave up on a process before the cluster was ever up: `up` fails and stops the rest
                self._fail(f"{fatal[0].name}: {fatal[0].message}")
            elif all_ready and self._canary_passes(now):
                self.phase = Phase.RUNNING
                log.info("all processes ready")
            return
        if self._verify and all_ready:
            self._verify_restarted(now)
        short = self.roles_without_ready_server()
        if self.phase == Phase.RUNNING and (fatal or short):
            self.phase = Phase.DEGRADED
            log.warning("degraded: %s", "; ".join([f"no ready {r} server" for r in short] +
                                                   [f"{p.name} gave up" for p in fatal]))
        elif self.phase == Phase.DEGRADED and not fatal and not short:
            self.phase = Phase.RUNNING
            log.info("running again: every role has a ready server")

    def roles_without_ready_server(self) -> list[str]:
        roles = dict.fromkeys(p.role for p in self.procs)
        return [r for r in roles if not any(p.role == r and p.state == ProcState.READY for p in self.procs)]

    def _step(self, proc: ManagedProcess, now: float) -> None:
        """One process's turn. A host that cannot be reached is news, not a crash: its processes may still
        run there, so nothing is restarted; the router has marked them down by its own probes, and the
        next tick asks again (the launcher backs off between tries)."""
        try:
            self._step_process(proc, now)
        except HostUnreachable as err:
            if proc.message != err.message:
                log.warning("%s: %s", proc.name, err.message)
            proc.message = err.message

    def _step_process(self, proc: ManagedProcess, now: float) -> None:
        """The process takes its own transitions; what depends on the cluster is decided here."""
        for event in proc.step(now, self.services):
            match event:
                case Stopped():
                    self._stopped(proc, event, now)
                case Exited(why=why, orphans=orphans):
                    # What is left of a dead leader is orphans with nothing to finish: a short grace.
                    self._on_exit(proc, now, why, grace=min(self.stop_timeout, ORPHAN_GRACE) if orphans else None)
                case Notice.READY:
                    if self.phase in (Phase.RUNNING, Phase.DEGRADED) and proc.role in SERVER_ROLES:
                        self._verify.add(proc.name)
                case Notice.START_DUE:
                    if not self.peers.may_start(proc, self.procs, self.restart_queue):
                        return
                    if proc.crash_looping:
                        proc.give_up(now)
                    else:
                        # a restart waits like a first start: on a shared GPU, D's backoff may run out while
                        # P is being reset, and both would then start on the GPU at once
                        self._start_when_due(proc, restart=True)
                case Notice.IDLE:
                    if self.phase == Phase.STARTING:
                        self._start_when_due(proc)

    def _on_exit(self, proc: ManagedProcess, now: float, why: str, grace: float | None = None) -> None:
        """The process died or must go: stop its whole tree (its children may outlive it), then back off
        or, before the cluster was ever up, fail `up`."""
        if self.phase == Phase.STARTING and not proc.ever_ready:
            self._begin_stop(proc, ProcState.FATAL, why, grace=grace)
            self._fail(f"{proc.name} {why} before it became ready")
            return
        proc.record_failure(now)
        proc.failed_starts += 0 if proc.state in (ProcState.READY, ProcState.UNHEALTHY) else 1
        self._begin_stop(proc, ProcState.BACKOFF, why, grace=grace)
        log.warning("%s %s", proc.name, why)
        self.peers.after_failed_start(proc, self.procs, self.restart_queue)

    def _fail(self, error: str) -> None:
        self.phase, self.error, self.stop_requested = Phase.FAILED, error, True
        log.error(error)

    # -- timed stop (the process runs it; what comes after depends on the cluster) ----------------------
    def _begin_stop(self, proc: ManagedProcess, then: ProcState, message: str, restart: bool = False,
                    grace: float | None = None) -> None:
        now = self.clock.monotonic()
        # a router's drain (router.drain_timeout) gets its time whatever stop_timeout or `down --timeout` say
        grace = max(self.stop_timeout, proc.plan.stop_grace) if grace is None else grace
        proc.begin_stop(now, then, message, restart, grace)

        self._step_stopping(proc, now)

    def _step_stopping(self, proc: ManagedProcess, now: float) -> None:
        stopped = proc.step_stop(now)
        if stopped is not None:
            self._stopped(proc, stopped, now)

    def _stopped(self, proc: ManagedProcess, stopped: Stopped, now: float) -> None:
        if proc.role in SERVER_ROLES and (left := self.services.after_stop(proc.plan)):
            log.info("%s: unlinked %d shared-memory segment(s) its processes left", proc.name, len(left))
        if stopped.then == ProcState.BACKOFF:
            self.peers.after_crash_stop(proc, self.procs)
        if stopped.restart and not self.stop_requested:
            proc.restarts += 1
            self._start(proc, now)

    # -- starting ----------------------------------------------------------------------------------
    def _start_when_due(self, proc: ManagedProcess, restart: bool = False) -> None:
        """Start now, unless its plan says to wait for others to be ready (servers sharing a GPU)."""
        waiting = [n for n in proc.plan.start_after if self.by_name(n).state != ProcState.READY]
        if not waiting:
            proc.restarts += 1 if restart else 0
            self._start(proc, self.clock.monotonic())
        elif proc.message != f"waiting for {', '.join(waiting)}":
            proc.message = f"waiting for {', '.join(waiting)}"

    def _start(self, proc: ManagedProcess, now: float) -> None:
        proc.start(now, self.cdir.log_path(proc.name), self.clock.time)

    def _adopt(self, proc: ManagedProcess, before: ProcessRecord) -> bool:
        return proc.adopt(before, self.clock.monotonic())

    # -- canary: the P->D KV path really works ------------------------------------------------------
    def _canary_passes(self, now: float) -> bool:
        """At start-up: a few tries (backends may still be warming up), then `up` fails with the reason."""
        if not self.policy.canary:
            return True
        ok, failed = self.canary.at_start(now, self.plan)
        if failed:
            self._fail(failed)
        return ok

    def _verify_restarted(self, now: float) -> None:
        """After a prefill or decode restart, check the pair with a canary (CanaryGate.after_restart)."""
        if not self.policy.canary:
            self._verify.clear()
            return
        self.canary.after_restart(now, self.plan, self._verify, self.procs, self.restart_queue)

    # -- requests from the CLI (`pdserve restart`, `up` with a changed config, `down --timeout`) ------
    def _take_requests(self) -> None:
        for request in take_requests(self.cdir):
            # `up` of a running cluster hands over the secrets its plan copies from the environment (a key
            # added or changed since this supervisor started): the processes it starts from now on get them
            os.environ.update(request.get("env") or {})
            if request.get("stop_timeout"):
                self.stop_timeout = float(request["stop_timeout"])
            if request.get("reload") and (reloaded := reload_plan(self.cdir, self.procs)):
                self.plan, self.policy = reloaded
                self.stop_timeout = self.policy.stop_timeout
            self.restarts.request(request.get("restart") or [], self.procs)

    def _restart_next(self) -> None:
        self.restarts.start_next(
            self.by_name, stop=lambda p: self._begin_stop(p, ProcState.STOPPED, "restart requested", restart=True),
            start=lambda p: self._start(p, self.clock.monotonic()))

    # -- state file --------------------------------------------------------------------------------
    def state(self) -> ClusterState:
        return ClusterState(cluster=self.plan.name, phase=self.phase, router_url=self.plan.router_url,
                            processes={p.name: p.record() for p in self.procs}, supervisor=self._record,
                            error=self.error)

    def write_state(self) -> None:
        self.cdir.write_state(self.state())


def _rotate_logs(cdir: ClusterDir, policy: SupervisorSpec) -> None:
    for path in cdir.logs_dir.glob("*.log"):
        if rotate_if_large(path, int(policy.log_max_mb * 1024 * 1024), policy.log_keep):
            log.info("rotated %s", path.name)


def _own_start_time() -> float:
    import psutil
    return psutil.Process().create_time()
