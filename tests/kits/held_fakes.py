"""Fakes for the held-KV policy's unit tests (router/kv/held.py, held_ledger.py, held_control.py): a clock, D's
control routes and /metrics, a turn, and a HeldKV wired to a memory table."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.config import RouterConfig
from pdserve.router.kv.held import HeldKV
from pdserve.router.kv.held_control import CONTROL
from pdserve.router.kv.store_memory import MemoryTable
from pdserve.router.telemetry.metrics import RouterMetrics

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def params(rid: str, tokens: int, engine: str = "e1", deadline: float = 5000.0) -> dict:
    return {"remote_request_id": rid, "remote_engine_id": engine, "remote_num_tokens": tokens,
            "remote_block_ids": [list(range(-(-tokens // BLOCK)))], "remote_blocks_expiry_time": deadline,
            "do_remote_decode": True}


@dataclass
class FakeTurn:
    request_id: str
    plan: str = "prefill_then_decode"
    prefill_ms: float | None = None
    pulled: int | None = None
    reuse: tuple[str, str] | None = None
    conversation: object = None


class FakeControl:
    """D's control routes and /metrics: answers what a real D would, records every call."""

    def __init__(self, capacity: int = 1024, status: int = 200):
        self.capacity = capacity
        self.status = status
        self.calls: list[tuple[str, str, str, dict | None]] = []
        self.held: set[str] = set()      # what D still holds (renew answers "unknown" for the rest)
        self.now = 100.0                 # D's clock

    async def call(self, decode, method, path, body=None):
        self.calls.append((decode, method, path, body))
        if path == "/metrics":
            return 200, (f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",'
                         f'num_gpu_blocks="{self.capacity // BLOCK}"}} 1.0\n')
        if self.status != 200:
            return self.status, None
        if path == CONTROL:
            return 200, {"now": self.now, "held": []}
        ids = body["request_ids"]
        if path.endswith("/release"):
            self.held -= set(ids)
            return 200, {"now": self.now, "results": {rid: {"status": "released"} for rid in ids}}
        return 200, {"now": self.now, "results": {
            rid: {"status": "renewed", "deadline": self.now + body["ttl"]} if rid in self.held
            else {"status": "unknown"} for rid in ids}}

    def released(self) -> list[tuple[list[str], float]]:
        return [(body["request_ids"], body["grace"]) for _, _, path, body in self.calls if path.endswith("/release")]


def cfg(**kw) -> RouterConfig:
    base = {"prefill": [], "decode": [{"name": "d0", "url": "http://x"}], "model": "m", "reuse_ttl": 432.0}
    return RouterConfig.from_dict({**base, **kw})


async def rig(capacity: int = 1024, **kw) -> tuple[HeldKV, MemoryTable, FakeControl, Clock, RouterMetrics]:
    clock, control, metrics = Clock(), FakeControl(capacity), RouterMetrics()
    c = cfg(**kw)
    table = MemoryTable(c.reuse_ttl, clock)
    held = HeldKV(c, ["d0", "d1"], metrics, control, clock)

    class Store:        # what attach looks for: a memory store's table
        pass
    store = Store()
    store.table = table
    assert held.attach(store)
    await held.learn("d0")
    await held.learn("d1")
    return held, table, control, clock, metrics


def put(table: MemoryTable, control: FakeControl, clock: Clock, conv: str, rid: str, tokens: int,
        decode: str = "d0", engine: str = "e1", continued: bool = False, tenant: str = "t") -> None:
    """A finished turn stored (`continued`: its conversation came back, so the lease may keep it)."""
    clock.t += 1
    control.held.add(rid)
    table.put((tenant, conv), params(rid, tokens, engine), decode, 0, None, alias=(tenant, "prompt-" + conv),
              continued=continued)


def sample(metrics: RouterMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0
