"""The e2e modules share one real cluster (tests/kits/vllm_cluster.py: SharedCluster), in an order that restarts
the fewest servers: the embedded default's settings first, then settings that restart one or both servers,
then modules that stop the cluster or need a fresh one, and last the shipped compiled config."""

from __future__ import annotations

import pytest

from tests.kits.vllm_cluster import SharedCluster

# Module order (file stem -> rank); unknown modules run in the middle, in name order.
ORDER = [
    # the shared cluster as it starts (router settings only)
    "test_real_hostile_inputs", "test_real_openai_stream", "test_real_short_turns", "test_real_prometheus",
    "test_real_admission", "test_real_agents",
    # settings that restart P, or P and D
    "test_real_engine_check", "test_real_stream_reuse", "test_real_tracing", "test_real_held_kv",
    # destructive or a new set of processes: each ends with `down`
    "test_faults", "test_real_2p2d", "test_real_router_replicas", "test_real_bench",
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
def shared_cluster(tmp_path_factory):
    shared = SharedCluster(tmp_path_factory.mktemp("shared"))
    yield shared
    shared.stop()
