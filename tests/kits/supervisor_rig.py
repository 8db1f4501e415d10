"""The supervisor driven tick by tick with a fake launcher, clock, probes and canary (fake_supervision.py):
no process, no socket, no sleep."""

from __future__ import annotations

from pathlib import Path

from pdserve.plan.build import build_plan
from pdserve.spec.load import parse_spec
from pdserve.state.folder import ClusterDir
from pdserve.state.records import Phase, ProcState
from pdserve.supervise.services import Services
from pdserve.supervise.supervisor import Supervisor
from tests.kits.fake_supervision import Canary, FakeClock, FakeLauncher, Health, InlineExecutor
from tests.kits.spec_data import GOOD


class Rig:
    def __init__(self, tmp: Path, canary: list[bool] | None = None, spec_text: str = GOOD,
                 memory_held=lambda dead, others: None, **policy):
        spec = parse_spec(spec_text)
        spec.supervisor = spec.supervisor.model_copy(update=policy)
        self.plan = build_plan(spec, python="/py", cluster_dir=tmp, models_dir=tmp)
        self.launcher, self.clock, self.health = FakeLauncher(), FakeClock(), Health()
        self.executor, self.canary = InlineExecutor(), Canary(canary)
        self.cleaned: list[str] = []          # servers whose shared memory was removed after a stop, in order
        self.sup = Supervisor(self.plan, ClusterDir("t", home=tmp), Services(
            launcher_for=lambda plan, proc: self.launcher, probe=self.health, canary=self.canary,
            clock=self.clock, executor=self.executor, memory_held=memory_held,
            after_stop=lambda plan: self.cleaned.append(plan.name) or []))
        self.sup.cdir.logs_dir.mkdir(parents=True, exist_ok=True)

    def url(self, name: str) -> str:
        return self.plan.by_name(name).health_url

    def healthy(self, *names: str) -> None:
        self.health.up.update(self.url(n) for n in names)

    def sick(self, *names: str) -> None:
        self.health.up.difference_update(self.url(n) for n in names)

    def state(self, name: str) -> ProcState:
        return self.sup.by_name(name).state

    def ticks(self, n: int = 1, every: float = 0.25) -> None:
        for _ in range(n):
            self.clock.advance(every)
            self.sup.tick()

    def until(self, cond, limit: int = 2000, every: float = 0.25) -> None:
        for _ in range(limit):
            if cond():
                return
            self.ticks(1, every)
        raise AssertionError("condition never held")

    def running(self) -> "Rig":
        self.sup.begin()
        self.healthy("prefill-0", "decode-0", "router")
        self.until(lambda: self.sup.phase == Phase.RUNNING)
        return self
