"""A server's process tree on this machine, the one definition that stop, `down` and `status --watch` use.

The tree is every live process whose process group or session is the leader's pid, plus whatever carries
the leader's mark (an environment entry, NAME=value) in its environment: vLLM's API server can die (OOM
killer, kill -9) while its EngineCore and workers, retitled and reparented to init, hold memory and ports;
they keep the dead leader's group. The kernel does not reuse a pid while a group or session still names
it, so a group id is a safe identity. Parentage is not: a reparented process is no longer a child.
"""

from __future__ import annotations

import os

import psutil


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


def pid_taken_by_another(pid: int, start_time: float | None) -> bool:
    try:
        return start_time is not None and abs(psutil.Process(pid).create_time() - start_time) > 0.01
    except psutil.Error:
        return False


def has_mark(pid: int, mark: str) -> bool:
    """Whether the process's environment holds the entry `mark` (NAME=value)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{mark}\0".encode() in f.read() + b"\0"
    except OSError:
        return False


def group_and_session(pid: int) -> tuple[int, int] | None:
    """(process group, session) from /proc/PID/stat; the command name may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[2]), int(fields[3])
    except (OSError, IndexError, ValueError):
        return None


def tree_members(wanted: dict[int, str]) -> dict[int, list[psutil.Process]]:
    """Live, non-zombie processes per leader pid: those in its process group or session, and those whose
    environment carries the leader's mark (leader pid -> mark, "" for none), in one /proc scan."""
    wanted = {pid: mark for pid, mark in wanted.items() if pid}
    needles = {f"{m}\0".encode(): pid for pid, m in wanted.items() if m}
    found: dict[int, list[psutil.Process]] = {pid: [] for pid in wanted}
    me = os.getpid()
    for pid in psutil.pids():
        if pid == me:
            continue
        owners = set()
        ids = group_and_session(pid)
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


def process_tree(pid: int | None, start_time: float | None, mark: str) -> list[psutil.Process]:
    """The tree of the leader started as (pid, start_time) with this mark."""
    if not pid:
        return []
    members = tree_members({pid: mark}).get(pid, [])
    if pid_taken_by_another(pid, start_time):
        # The kernel reuses a pid only once no group or session names it: our group is gone, and
        # what now has that group is another's. Only the mark proves a process ours.
        members = [p for p in members if mark and has_mark(p.pid, mark)]
    return members


def marked_processes(mark: str) -> list[psutil.Process]:
    """Live processes whose environment carries this mark (children inherit it); none for no mark."""
    found: list[psutil.Process] = []
    if not mark:
        return found
    for pid in psutil.pids():
        if has_mark(pid, mark):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                continue
    return found
