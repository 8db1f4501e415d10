"""`down` (and a failed `up`, and Ctrl-C): stop a cluster whole, with or without its supervisor, and say what
is left of it (processes, bound ports, GPU memory)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from pdserve.errors import PdserveError
from pdserve.launchers import close_connections, launcher_for_handle
from pdserve.launchers.base import HostUnreachable
from pdserve.launchers.stop import stop_tree
from pdserve.observe.resources import GpuLeft, gpus_still_holding, process_gpus
from pdserve.orchestrate.lookup import busy_ports, live_processes, stored_plan, supervisor_process
from pdserve.plan.records import ClusterPlan
from pdserve.state.folder import ClusterDir, write_json_atomic
from pdserve.state.records import Phase, ProcState


def stop_cluster(cdir: ClusterDir, timeout: float) -> StopReport:
    """Stop everything: the supervisor (which stops its processes in order, with this timeout), then any
    survivor, in the same order (router, decode, prefill), its whole tree each; then check that nothing
    of the cluster is left. Works when the supervisor is gone; never signals a recycled pid."""
    state = cdir.read_state()
    sup = supervisor_process(state)
    if sup is not None:
        write_json_atomic(cdir.requests_dir / f"{time.time_ns()}.json", {"stop_timeout": timeout})
        sup.send_signal(signal.SIGTERM)
        graces = stored_plan(cdir)
        try:
            sup.wait(timeout=sum(max(timeout, p.stop_grace) for p in graces.processes) + timeout + 15 if graces
                     else timeout * (len(state.processes) + 1) + 15)
        except psutil.TimeoutExpired:
            sup.kill()
        state = cdir.read_state() or state
    if state is None:
        return StopReport([], [], [])
    plan = stored_plan(cdir)
    grace = {p.name: p.stop_grace for p in plan.processes} if plan else {}

    order = [p.name for p in plan.stop_order()] if plan else []
    killed = []
    for name in sorted(state.processes, key=lambda n: order.index(n) if n in order else len(order)):
        rec = state.processes[name]
        try:
            if rec.handle is not None and stop_tree(launcher_for_handle(plan, rec.handle), rec.handle,
                                                    max(timeout, grace.get(name, 0.0))):

                killed.append(name)
        except HostUnreachable as err:      # reported below as left: `down` again once the host is back
            rec.message = f"{err.message}: may still run there"
    left = [name for name, alive in live_processes(cdir, state).items() if alive]
    busy = busy_ports(plan) if plan else []
    if plan:
        close_connections(plan)      # last: the checks above used them
    for name, rec in state.processes.items():
        if name not in left:
            rec.state, rec.handle = ProcState.STOPPED, None
    if state.phase != Phase.FAILED:
        state.phase = Phase.STOPPED
    cdir.write_state(state)
    return StopReport(killed, left, busy, gpu_memory_left(plan) if plan else [])


DOWN_GPU_SETTLE_S = 15.0   # before `down` reports a GPU still holding memory (gpus_still_holding says why)


def gpu_memory_left(plan: ClusterPlan, settle_s: float = DOWN_GPU_SETTLE_S, run=None,
                    sleep: Callable[[float], None] = time.sleep) -> list[GpuLeft]:
    """GPUs of the plan's servers on this machine (their CUDA_VISIBLE_DEVICES; nvidia-smi here sees no other
    host's) that still hold memory once settle_s has passed; [] when nothing is over the threshold or
    nvidia-smi is absent."""
    devices = sorted({d for p in plan.processes if not plan.is_remote(p)
                      for d in process_gpus(p.env.get("CUDA_VISIBLE_DEVICES"))})
    if not devices:
        return []
    return gpus_still_holding(devices, settle_s, run=run, sleep=sleep) or []


@dataclass
class StopReport:
    killed: list[str]       # processes that were still alive without a supervisor and had to be stopped here
    left: list[str]         # processes with something of their tree still alive after the stop
    busy_ports: list[str]   # the plan's ports still bound afterwards
    gpu_left: list[GpuLeft] = field(default_factory=list)   # the servers' GPUs still holding memory

    @property
    def clean(self) -> bool:
        return not self.left and not self.busy_ports and not self.gpu_left

    def raise_if_unclean(self, name: str) -> None:
        """`down`'s verdict: an error naming what is left of cluster `name`."""
        if self.left or self.busy_ports:
            raise PdserveError(f"{name} did not stop cleanly: "
                               + "; ".join([f"{p} still has live processes" for p in self.left] +
                                           [f"{b} still bound" for b in self.busy_ports] +
                                           [g.describe() for g in self.gpu_left]),
                               hint=f"`pdserve down {name}` again; `pdserve status {name}` shows what is left")
        if self.gpu_left:
            # Every process of the cluster is gone, yet its GPUs are not free: another program's, or memory
            # that a dead server's peer imported over CUDA IPC (freed only when that holder exits).
            raise PdserveError(f"{name} stopped, but " + "; ".join(g.describe() for g in self.gpu_left),
                               hint="`nvidia-smi` shows who holds it; memory that no process lists is held by a "
                                    "process that imported it over CUDA IPC or by a leftover engine: stop it "
                                    "before the next `pdserve up`")
