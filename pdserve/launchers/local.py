"""Processes on this machine, each the leader of its own session (and so of its own process group).

A server's tree is every live process whose process group or session is the leader's pid, plus whatever
carries its marker variable: vLLM's API server can die (OOM killer, kill -9) while its EngineCore and
workers, retitled and reparented to init, hold memory and ports; they keep the dead leader's group.
The kernel does not reuse a pid while a group or session still names it, so a group id is a safe identity.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from pdserve.errors import PdserveError
from pdserve.launchers.base import Handle, HostHealth, LauncherKind
from pdserve.observe.logfiles import last_lines
from pdserve.plan.records import LOCAL_HOST, MARKER_ENV, ProcessPlan


def same_process(pid: int | None, start_time: float | None) -> psutil.Process | None:
    """The live process with this pid AND start time; None for a dead, zombie or recycled pid."""
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if start_time is not None and abs(proc.create_time() - start_time) > 0.01:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _pid_taken_by_another(pid: int, start_time: float | None) -> bool:
    try:
        return start_time is not None and abs(psutil.Process(pid).create_time() - start_time) > 0.01
    except psutil.Error:
        return False


def _has_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARKER_ENV}={marker}\0".encode() in f.read() + b"\0"
    except OSError:
        return False


def _group_and_session(pid: int) -> tuple[int, int] | None:
    """(process group, session) from /proc/PID/stat; the command name may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[2]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def tree_members(wanted: dict[int, str]) -> dict[int, list[psutil.Process]]:
    """Live, non-zombie processes per leader pid: those in its process group or session, and those whose
    environment carries the leader's marker (leader pid -> marker), in one /proc scan."""
    wanted = {pid: marker for pid, marker in wanted.items() if pid}
    needles = {f"{MARKER_ENV}={m}\0".encode(): pid for pid, m in wanted.items() if m}
    found: dict[int, list[psutil.Process]] = {pid: [] for pid in wanted}
    me = os.getpid()
    for pid in psutil.pids():
        if pid == me:
            continue
        owners = set()
        ids = _group_and_session(pid)
        if ids:
            owners.update(o for o in ids if o in found)
        if needles:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read() + b"\0"
                owners.update(owner for needle, owner in needles.items() if needle in env)
            except OSError:
                pass
        if not owners:
            continue
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        for owner in owners:
            found[owner].append(proc)
    return found


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries this marker (children inherit it)."""
    found = []
    for pid in psutil.pids():
        if _has_marker(pid, marker):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                continue
    return found


class LocalLauncher:
    """The Launcher for this machine. It keeps the Popen of each process it started, to reap it and
    read its exit code; a handle read back from state.json (adopted) has none and is checked by pid."""

    kind = LauncherKind.LOCAL
    plan = None           # this machine needs no plan to reach it

    def __init__(self, base_env: dict[str, str] | None = None):
        self._base_env = base_env
        self._children: dict[int, subprocess.Popen] = {}

    def start(self, plan: ProcessPlan, log_path: Path) -> Handle:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        base = os.environ if self._base_env is None else self._base_env
        env = {**base, **plan.env,
               **{target: base[source] for target, source in plan.env_from.items() if source in base}}
        with open(log_path, "ab") as log:
            log.write(f"\n=== pdserve: starting {plan.name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            log.flush()
            popen = subprocess.Popen(plan.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        self._children[popen.pid] = popen
        try:
            start_time = psutil.Process(popen.pid).create_time()
        except psutil.NoSuchProcess:
            start_time = None
        return Handle(LauncherKind.LOCAL, LOCAL_HOST, popen.pid, start_time, plan.env.get(MARKER_ENV, ""),
                      str(log_path))

    def _reap(self, handle: Handle) -> int | None:
        popen = self._children.get(handle.pid or 0)
        return popen.poll() if popen is not None else None

    def is_alive(self, handle: Handle) -> bool:
        if self._reap(handle) is not None:
            return False
        return same_process(handle.pid, handle.start_time) is not None

    def exit_code(self, handle: Handle) -> int | None:
        return self._reap(handle)

    def _tree(self, handle: Handle) -> list[psutil.Process]:
        pid = handle.pid or 0
        members = tree_members({pid: handle.marker}).get(pid, [])
        if pid and _pid_taken_by_another(pid, handle.start_time):
            # The kernel reuses a pid only once no group or session names it: our group is gone, and
            # what now has that group is another's. Only the marker proves a process ours.
            members = [p for p in members if _has_marker(p.pid, handle.marker)]
        return members

    def tree_alive(self, handle: Handle) -> int:
        self._reap(handle)
        return len(self._tree(handle))

    def signal(self, handle: Handle, sig: int) -> int:
        sent = 0
        for proc in self._tree(handle):
            try:
                proc.send_signal(sig)
                sent += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self._reap(handle)
        return sent

    def adopt(self, handle: Handle) -> Handle | None:
        proc = same_process(handle.pid, handle.start_time)
        if proc is None or not _has_marker(proc.pid, handle.marker):
            return None
        return handle

    def read_log(self, handle: Handle, lines: int) -> list[str]:
        return last_lines(Path(handle.log_path), lines)

    def host_health(self, host: str) -> HostHealth:
        return HostHealth()       # this machine is always reachable

    def probe(self, host_name: str, address: str, ports: list[int], efa: bool) -> dict[str, Any]:
        raise PdserveError("this machine is checked by the machine checks, not probed as a host")
