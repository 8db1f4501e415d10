"""Fakes the supervisor is given in policy tests: a launcher of pretend processes, a clock that moves only
when told, an executor that runs calls at once (or holds them), scripted probes and canaries."""

from __future__ import annotations

import signal
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.launchers.base import Handle, LauncherKind
from pdserve.plan.records import ProcessPlan


@dataclass
class FakeProcess:
    name: str
    leader: bool = True            # the leader lives
    children: int = 1              # processes of its tree besides the leader
    stubborn: bool = False         # ignores SIGTERM (only SIGKILL ends it)
    exit_code: int | None = None
    signals: list[int] = field(default_factory=list)


class FakeLauncher:
    def __init__(self):
        self.procs: dict[int, FakeProcess] = {}
        self.started: list[str] = []
        self.fail_start: set[str] = set()
        self.stubborn: set[str] = set()
        self._next_pid = 1000

    def start(self, plan: ProcessPlan, log_path: Path) -> Handle:
        if plan.name in self.fail_start:
            raise OSError(f"cannot start {plan.name}")
        self._next_pid += 1
        self.procs[self._next_pid] = FakeProcess(plan.name, stubborn=plan.name in self.stubborn)
        self.started.append(plan.name)
        return Handle(LauncherKind.LOCAL, "local", self._next_pid, float(self._next_pid), f"m#{plan.name}",
                      str(log_path))

    def live(self, name: str) -> FakeProcess:
        return next(p for pid, p in sorted(self.procs.items(), reverse=True) if p.name == name)

    def crash(self, name: str, code: int = -9, leave_children: bool = True) -> None:
        """What the OOM killer does: SIGKILL the leader pid only."""
        p = self.live(name)
        p.leader, p.exit_code = False, code
        if not leave_children:
            p.children = 0

    def is_alive(self, h: Handle) -> bool:
        return self.procs[h.pid].leader

    def exit_code(self, h: Handle) -> int | None:
        return self.procs[h.pid].exit_code

    def tree_alive(self, h: Handle) -> int:
        p = self.procs[h.pid]
        return int(p.leader) + p.children

    def signal(self, h: Handle, sig: int) -> int:
        p = self.procs[h.pid]
        n = self.tree_alive(h)
        p.signals.append(sig)
        if sig == signal.SIGKILL or not p.stubborn:
            p.leader, p.children = False, 0
        return n

    def adopt(self, h: Handle) -> Handle | None:
        p = self.procs.get(h.pid)
        return h if p and p.leader else None

    def read_log(self, h: Handle, lines: int) -> list[str]:
        return []


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start
        self.slept = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


class InlineExecutor(Executor):
    """Runs each call at once, unless `hold` names its function: then the future stays pending until
    release() (a canary or probe that takes minutes)."""

    def __init__(self):
        self.hold: set[str] = set()
        self.pending: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args, **kwargs) -> Future:
        f: Future = Future()
        if getattr(fn, "__name__", type(fn).__name__) in self.hold:
            self.pending.append((f, fn, args))
            return f
        f.set_result(fn(*args, **kwargs))
        return f

    def release(self) -> None:
        for f, fn, args in self.pending:
            f.set_result(fn(*args))
        self.pending.clear()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class Health:
    """Scripted health: a set of URLs that answer 200."""

    def __init__(self):
        self.up: set[str] = set()
        self.asked: list[str] = []

    def __call__(self, url: str) -> bool:
        self.asked.append(url)
        return url in self.up


class Canary:
    def __init__(self, outcomes: list[bool] | None = None):
        self.outcomes = list(outcomes or [])
        self.calls = 0

    def __call__(self, plan) -> tuple[bool, str]:
        self.calls += 1
        ok = self.outcomes.pop(0) if self.outcomes else True
        return ok, "moved 128 tokens" if ok else "no KV reached a decode server"
