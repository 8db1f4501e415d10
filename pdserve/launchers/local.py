"""Start and stop processes on this machine, each in its own process group (session).

vLLM's API server can die while its EngineCore and worker children live on and hold memory, so a server is
always signalled as a whole group, and stragglers are found by the marker variable they inherited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from pdserve.plan.records import MARKER_ENV, ProcessPlan


@dataclass
class Handle:
    pid: int
    create_time: float
    popen: subprocess.Popen | None = None   # set when this process is the parent (lets us reap it)


def start(plan: ProcessPlan, log_path: Path, base_env: dict[str, str] | None = None) -> Handle:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = os.environ if base_env is None else base_env
    env = {**base, **plan.env, **{target: base[source] for target, source in plan.env_from.items() if source in base}}
    with open(log_path, "ab") as log:
        log.write(f"\n=== pdserve: starting {plan.name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
        log.flush()
        popen = subprocess.Popen(plan.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.NoSuchProcess:
        create_time = 0.0
    return Handle(popen.pid, create_time, popen)


def same_process(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The live process with this pid AND start time; None for a dead or recycled pid."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.01:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def adopt(pid: int | None, create_time: float | None, marker: str) -> Handle | None:
    """A handle on a live process started earlier (by a supervisor that has since died), only if it is
    the same process (pid + start time) and still carries this cluster's marker for that process."""
    proc = same_process(pid, create_time)
    if proc is None:
        return None
    try:
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            environ = b"\0" + f.read() + b"\0"
    except OSError:
        return None
    if b"\0" + f"{MARKER_ENV}={marker}".encode() + b"\0" not in environ:
        return None
    return Handle(proc.pid, proc.create_time())


def is_alive(handle: Handle) -> bool:
    if handle.popen is not None and handle.popen.poll() is not None:
        return False
    return same_process(handle.pid, handle.create_time) is not None


def processes_by_marker(markers: Iterable[str]) -> dict[str, list[psutil.Process]]:
    """Live processes whose environment carries each marker (children inherit it), in one /proc scan.

    Reads /proc/PID/environ directly: psutil's parser returns nothing for processes that rewrote their
    title (vLLM's `VLLM::EngineCore` does), which is exactly the orphan this search exists to find.
    """
    needles = {f"{MARKER_ENV}={m}\0".encode(): m for m in markers if m}
    found: dict[str, list[psutil.Process]] = {m: [] for m in needles.values()}
    if not needles:
        return found
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            hits = [m for needle, m in needles.items() if needle in env]
            if not hits:
                continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                for m in hits:
                    found[m].append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def marked_processes(marker: str) -> list[psutil.Process]:
    return processes_by_marker([marker]).get(marker, [])


def _signal_all(leader: psutil.Process | None, members: list[psutil.Process], sig: int) -> None:
    if leader is not None:
        try:
            os.killpg(leader.pid, sig)   # we started it with start_new_session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass
    for proc in members:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def stop(pid: int | None, create_time: float | None, marker: str, timeout: float,
         popen: subprocess.Popen | None = None) -> bool:
    """SIGTERM the group, SIGKILL after `timeout`; returns True when something had to be killed."""
    leader = same_process(pid, create_time)
    members = marked_processes(marker)
    if leader is None and not members:
        _reap(popen)
        return False
    _signal_all(leader, members, signal.SIGTERM)
    everyone = ([leader] if leader else []) + members
    _, alive = psutil.wait_procs(everyone, timeout=timeout)
    _reap(popen)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] + marked_processes(marker)
    if alive:
        _signal_all(leader if leader and leader.is_running() else None, alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    _reap(popen)
    return True


def _reap(popen: subprocess.Popen | None) -> None:
    if popen is not None:
        try:
            popen.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
