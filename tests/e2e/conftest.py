"""The e2e modules share one real cluster (tests/kits/vllm_cluster.py: SharedCluster), in an order that starts
the fewest servers: the embedded default's settings first (router changes at most), then the servers' own
settings (each starts the cluster anew), then modules that need other processes or a cluster of their own,
and last the shipped compiled config."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.kits.otlp_receiver import Receiver
from tests.kits.vllm_cluster import SharedCluster

# Module order (file stem -> rank); unknown modules run in the middle, in name order.
ORDER = [
    # the shared cluster as it starts (every module here changes router or supervisor settings at most)
    "test_real_hostile_inputs", "test_real_openai_stream", "test_real_short_turns",
    "test_real_long_context", "test_real_prometheus",
    "test_real_tracing", "test_real_admission", "test_real_agents", "test_real_coding_agents",
    "test_real_agentic_bench",
    "test_faults",                     # kills each server once; ends with `down`
    # the servers' own settings: each starts the cluster anew (P and D side by side)
    "test_real_engine_check", "test_real_stream_reuse", "test_real_held_kv",
    # other processes, or a cluster of its own; each ends with `down`
    "test_real_2p2d", "test_real_router_replicas", "test_real_bench",
    # the shipped compiled config, from a fresh start
    "test_real_vllm",
]


def pytest_collection_modifyitems(config, items):
    def rank(item) -> tuple[int, str]:
        stem = item.path.stem
        if item.path.parent.name != "e2e":
            return (-1, "")                   # other packages keep their place (sort is stable)
        return (ORDER.index(stem) if stem in ORDER else len(ORDER) // 2, stem)
    e2e = [i for i in items if i.path.parent.name == "e2e"]
    if e2e:
        first = items.index(e2e[0])
        rest = [i for i in items if i.path.parent.name != "e2e"]
        items[:] = rest[:first] + sorted(e2e, key=rank) + rest[first:]


@pytest.fixture(scope="package")
def otlp():
    """An OTLP/HTTP receiver for the whole package: the shared cluster exports its traces here from the
    start (router and engines), so the tracing module needs no restart of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    receiver = asyncio.run_coroutine_threadsafe(Receiver().start(), loop).result(10)
    yield receiver
    asyncio.run_coroutine_threadsafe(receiver.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="package")
def shared_cluster(tmp_path_factory, otlp):
    shared = SharedCluster(tmp_path_factory.mktemp("shared"),
                           extra={"observability": {"otlp_endpoint": otlp.url, "json_logs": True}})
    yield shared
    shared.stop()
