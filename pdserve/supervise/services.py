"""What the supervisor is given instead of calling the OS: launchers, a health probe, the canary, a GPU
memory check, the removal of what a stopped server left in shared memory, a clock, and an executor for the
calls that wait (probes, canaries, nvidia-smi), so its loop never blocks on one. Tests hand it fakes and drive
it tick by tick in milliseconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.shm_names import owner_prefix, remove_left
from pdserve.launchers import launcher_for
from pdserve.launchers.base import Handle, Launcher
from pdserve.plan.records import LOCAL_HOST, MARKER_ENV, ClusterPlan, ProcessPlan
from pdserve.supervise.canary import plan_canary
from pdserve.supervise.health import probe
from pdserve.supervise.peers import memory_held_by_nobody


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def time(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def remove_server_leftovers(plan: ProcessPlan) -> list[str]:
    """The shared memory a stopped server's processes left on this host (engine/shm_names.py); on another
    host the server's next start removes it."""
    marker = plan.env.get(MARKER_ENV)
    if plan.host_name != LOCAL_HOST or not marker:
        return []
    return remove_left(owner_prefix(marker))


@dataclass
class Services:
    launcher_for: Callable[[ClusterPlan, ProcessPlan], Launcher] = launcher_for
    launcher_for_handle: Callable[[ClusterPlan, Handle], Launcher] | None = None
    probe: Callable[[str], bool] = probe
    canary: Callable[[ClusterPlan], tuple[bool, str]] = plan_canary
    # Whether a dead server's GPUs still hold memory no process owns (its peers then hold it)
    memory_held: Callable[[ProcessPlan, list[ProcessPlan]], bool | None] = memory_held_by_nobody
    # Once every process of a server is gone: unlink what it left in shared memory (the names removed)
    after_stop: Callable[[ProcessPlan], list[str]] = remove_server_leftovers
    clock: Clock = field(default_factory=SystemClock)
    executor: Executor = field(default_factory=lambda: ThreadPoolExecutor(8, thread_name_prefix="pdserve-io"))
