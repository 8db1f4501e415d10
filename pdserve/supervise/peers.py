"""Peers that may hold a dead server's GPU memory, and when to restart them.

A P that imported a crashed D's KV cache over CUDA IPC keeps that memory, listed under no process on D's
GPU, and every restart of D dies for want of memory until P restarts (docs/operations.md). Two signs lead
to that reset: the dead server's GPUs still hold memory once its whole tree is gone, or, on a GPU it shares
with a peer, less is free than its own share of it (vLLM refuses to start on less); both asked of
nvidia-smi on the executor, before the restart, so the doomed starts are never made. Else, it failed to
start twice in a row (a GPU that cannot be checked: on another host, no nvidia-smi). The dead server then
starts only once the peers reset for it have been stopped and started again: their stop is what frees its
memory.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from pdserve.observe.resources import gpu_free_memory, gpus_still_holding, process_gpus
from pdserve.plan.records import LOCAL_HOST, ProcessPlan
from pdserve.roles import SERVER_ROLES
from pdserve.supervise.process import ManagedProcess

log = logging.getLogger("pdserve.supervisor")

FAILED_STARTS_BEFORE_PEER_RESET = 2
PEER_GPU_SETTLE_S = 8.0     # before a dead server's memory counts as held (gpus_still_holding says why)


def _gpus(plan: ProcessPlan) -> set[str]:
    return set(process_gpus(plan.env.get("CUDA_VISIBLE_DEVICES")))


def memory_held_by_nobody(dead: ProcessPlan, others: list[ProcessPlan], settle_s: float = PEER_GPU_SETTLE_S,
                          run: Callable[[list[str]], str | None] | None = None,
                          sleep: Callable[[float], None] = time.sleep) -> bool | None:
    """True when the GPUs of a server whose tree is gone still hold memory after settle_s with no process
    listed on them (on a GPU shared with a peer: less than the dead server's share is free); False when
    they emptied; None when it cannot be told here (another host, no pinned GPUs, someone's process on
    it, no nvidia-smi, a shared GPU without a known share)."""
    mine = _gpus(dead)
    if dead.host_name != LOCAL_HOST or not mine:
        return None
    if any(o.host_name == dead.host_name and mine & _gpus(o) for o in others):
        return _share_not_free(dead, sorted(mine), settle_s, run, sleep)   # the peer's own memory is there too
    left = gpus_still_holding(sorted(mine), settle_s, run=run, sleep=sleep, step=1.0)
    if left is None:
        return None
    if not left:
        return False
    return None if any(g.pids for g in left) else True    # someone's process: not a leak to name


def _share_not_free(dead: ProcessPlan, gpus: list[str], settle_s: float,
                    run: Callable[[list[str]], str | None] | None, sleep: Callable[[float], None]) -> bool | None:
    share = gpu_memory_utilization(dead.argv)
    if share is None:
        return None
    waited = 0.0
    while True:
        free = gpu_free_memory(gpus, run=run)
        if not free:
            return None
        short = [g for g in free if g.free_mib < share * g.total_mib]
        if not short:
            return False
        if waited >= settle_s:
            log.info("GPU %s: %d of %d MiB free, %s needs %.0f%% to start", short[0].index, short[0].free_mib,
                     short[0].total_mib, dead.name, 100 * share)
            return True
        sleep(1.0)
        waited += 1.0


def gpu_memory_utilization(argv: list[str]) -> float | None:
    """The --gpu-memory-utilization a server was started with (the planner sets it on shared GPUs)."""
    flag = "--gpu-memory-utilization"
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            return float(value)
        except ValueError:
            return None
    return None


@dataclass
class PeerReset:
    executor: Executor
    memory_held: Callable[[ProcessPlan, list[ProcessPlan]], bool | None]
    checks: dict[str, Future] = field(default_factory=dict)           # dead server -> GPU check in flight
    waits: dict[str, dict[str, int]] = field(default_factory=dict)    # dead server -> peer -> its restarts then

    def after_crash_stop(self, proc: ManagedProcess, procs: list[ManagedProcess]) -> None:
        """The crashed server's tree is gone: look at its GPUs before it starts again."""
        if proc.role in SERVER_ROLES:
            others = [p.plan for p in procs if p is not proc and p.role in SERVER_ROLES]
            self.checks[proc.name] = self.executor.submit(self.memory_held, proc.plan, others)

    def after_failed_start(self, proc: ManagedProcess, procs: list[ManagedProcess], queue: deque[str]) -> None:
        if proc.role in SERVER_ROLES and proc.failed_starts == FAILED_STARTS_BEFORE_PEER_RESET:
            self._reset(proc, procs, queue, f"failed to start {proc.failed_starts} times in a row")

    def may_start(self, proc: ManagedProcess, procs: list[ManagedProcess], queue: deque[str]) -> bool:
        """False while its GPU check runs, or until the peers reset for it have been restarted."""
        check = self.checks.get(proc.name)
        if check is not None:
            if not check.done():
                return False
            del self.checks[proc.name]
            if check.exception() is None and check.result() is True:
                self._reset(proc, procs, queue, "left GPU memory held with no process on it")
        waits = self.waits.get(proc.name)
        if waits:
            by_name = {p.name: p for p in procs}
            if any(by_name[n].restarts <= count for n, count in waits.items()):
                return False
            del self.waits[proc.name]
        return True

    def _reset(self, proc: ManagedProcess, procs: list[ManagedProcess], queue: deque[str], why: str) -> None:
        peers = [p for p in procs if p.role in SERVER_ROLES and p.role != proc.role and p.name not in queue]
        if peers:
            log.warning("%s %s: restarting %s, which may hold its memory", proc.name, why,
                        ", ".join(p.name for p in peers))
            queue.extend(p.name for p in peers)
            self.waits[proc.name] = {p.name: p.restarts for p in peers}
