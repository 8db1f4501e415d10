"""The one timed stop of a process's tree, whatever launcher runs it: SIGTERM, then SIGKILL once the deadline
passes (again every KILL_REPEAT s while anything is left), and done when nothing of the tree is left or
KILL_GRACE after the first SIGKILL (what is left then would not die). The supervisor steps it on its ticks
and never waits on it; `down` runs it to the end for what outlived the supervisor (`stop_tree`)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.launchers.base import Handle, Launcher

KILL_GRACE = 10.0     # after SIGKILL, how long to wait for the tree before reporting leftovers
KILL_REPEAT = 1.0     # SIGKILL again this often meanwhile (a process may fork while it is being killed)


@dataclass
class TimedStop:
    launcher: Launcher
    handle: Handle | None             # None: nothing was started, the stop is over at its first step
    deadline: float                   # monotonic time after which SIGKILL goes out
    on_kill: Callable[[int], None] | None = None    # told how many processes were still alive at the SIGKILL
    killed_at: float | None = None

    def terminate(self) -> int:
        """SIGTERM to the whole tree; returns how many processes got it."""
        return self.launcher.signal(self.handle, signal.SIGTERM) if self.handle is not None else 0

    def step(self, now: float) -> int | None:
        """One look at the tree, promptly: None while the stop goes on, else how many processes of it
        would not die (0: all gone)."""
        handle = self.handle
        left = self.launcher.tree_alive(handle) if handle is not None else 0
        if left and self.killed_at is None and now >= self.deadline:
            self.launcher.signal(handle, signal.SIGKILL)
            self.killed_at = now
            if self.on_kill is not None:
                self.on_kill(left)
            left = self.launcher.tree_alive(handle)
        if left and self.killed_at is not None and now - self.killed_at < KILL_GRACE:
            if now - self.killed_at >= KILL_REPEAT:
                self.launcher.signal(handle, signal.SIGKILL)
            return None
        if left and self.killed_at is None:
            return None
        return left


def stop_tree(launcher: Launcher, handle: Handle, timeout: float, poll: float = 0.1,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> bool:
    """The timed stop run to its end (blocking): SIGKILL `timeout` s after SIGTERM. True when anything of
    the tree was alive."""
    if not launcher.tree_alive(handle):
        return False
    stop = TimedStop(launcher, handle, clock() + timeout)
    stop.terminate()
    while stop.step(clock()) is None:
        sleep(poll)
    return True
