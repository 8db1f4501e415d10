"""`pdserve up` with launcher slurm on a real one-node Slurm: prefill and decode are srun steps of one
allocation, named after the cluster and process; KV reuse shows on P's /metrics; `down` cancels the steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.kits.vllm_cluster import converse, metric, pdserve, up
from tests.kits.slurm_rig import NODE

pytestmark = pytest.mark.e2e
NAME = "mh-slurm"
REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def cluster(slurm, tmp_path_factory):
    def in_allocation(cfg, ports):
        cfg["launcher"] = "slurm"
        cfg["slurm"] = {"job_id": slurm.job_id}
        cfg["hosts"] = [{"name": NODE, "address": "127.0.0.1", "python": sys.executable, "env": {"PYTHONPATH": REPO}}]
        cfg["prefill"]["host"] = cfg["decode"]["host"] = NODE

    c = up(tmp_path_factory.mktemp("mhs"), NAME, in_allocation)
    yield c
    pdserve("down", NAME, timeout=300)


def test_servers_are_named_steps_and_reuse_works(cluster, slurm):
    assert sorted(slurm.steps()) == [f"pdserve.{NAME}.decode-0", f"pdserve.{NAME}.prefill-0"]
    st = json.loads(pdserve("status", NAME, "--json").stdout)
    assert all(p["state"] == "ready" for p in st["processes"]), st
    rows = converse(cluster, "mhs-conv", 3, [])
    print("turns:", rows)
    assert rows[0]["tokens_from_d"] == 0 and all(r["tokens_from_d"] > 0 for r in rows[1:]), rows
    assert metric(cluster["prefill"][0], "vllm:nixl_num_failed_transfers_total") == 0


def test_down_cancels_the_steps(cluster, slurm):
    res = pdserve("down", NAME, timeout=300)
    assert res.returncode == 0, res.stderr
    assert slurm.steps() == []
    assert pdserve("status", NAME).returncode == 3
