"""Processes on this machine, each the leader of its own session (and so of its own process group).

A server's tree is every live process whose process group or session is the leader's pid, plus whatever
carries its marker variable (observe/proctree.py, which `status --watch` samples too): vLLM's API server
can die (OOM killer, kill -9) while its EngineCore and workers, retitled and reparented to init, hold
memory and ports; they keep the dead leader's group.
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
from pdserve.observe import proctree
from pdserve.observe.logfiles import last_lines
from pdserve.observe.proctree import same_process
from pdserve.plan.records import LOCAL_HOST, MARKER_ENV, ProcessPlan


def environ_mark(marker: str) -> str:
    """The environment entry that marks a process of this handle's tree ("" when it has no marker)."""
    return f"{MARKER_ENV}={marker}" if marker else ""


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries this marker (children inherit it)."""
    return proctree.marked_processes(f"{MARKER_ENV}={marker}")


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
        return proctree.process_tree(handle.pid, handle.start_time, environ_mark(handle.marker))

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
        if proc is None or not proctree.has_mark(proc.pid, f"{MARKER_ENV}={handle.marker}"):
            return None
        return handle

    def read_log(self, handle: Handle, lines: int) -> list[str]:
        return last_lines(Path(handle.log_path), lines)

    def host_health(self, host: str) -> HostHealth:
        return HostHealth()       # this machine is always reachable

    def probe(self, host_name: str, address: str, ports: list[int], efa: bool) -> dict[str, Any]:
        raise PdserveError("this machine is checked by the machine checks, not probed as a host")
