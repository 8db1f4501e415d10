"""`down`'s GPU-memory check: which GPUs of the plan still hold memory, from canned nvidia-smi output."""

from __future__ import annotations

from pdserve.observe.resources import GpuLeft, gpus_holding_memory, physical_gpus
from pdserve.orchestrate.stop import StopReport, gpu_memory_left
from pdserve.plan.records import ClusterPlan, ProcessPlan

GPUS = "0, GPU-aaa, 3\n1, GPU-bbb, 71574\n2, GPU-ccc, 80000\n"


def smi(gpus: str, apps: str = ""):
    calls = []

    def run(args):
        calls.append(args)
        return gpus if args[0].startswith("--query-gpu") else apps
    run.calls = calls
    return run


def test_only_the_plan_s_gpus_above_the_threshold_are_reported_with_their_listed_processes():
    # GPU 2 holds more but is no GPU of this cluster; GPU 0 holds a bare 3 MiB
    left = gpus_holding_memory(["0", "1"], run=smi(GPUS, "GPU-bbb, 4242\nGPU-ccc, 7\n"))
    assert left == [GpuLeft(1, 71574, [4242])]
    assert left[0].describe() == "GPU 1 still holds 71574 MiB (processes 4242)"


def test_memory_no_process_lists_is_named_so_and_uuids_match_too():
    left = gpus_holding_memory(["GPU-bbb"], run=smi(GPUS))
    assert [g.describe() for g in left] == ["GPU 1 still holds 71574 MiB (no process listed)"]
    assert gpus_holding_memory(["1"], threshold_mib=80000, run=smi(GPUS)) == []


def test_no_nvidia_smi_is_no_finding():
    assert gpus_holding_memory(["0"], run=lambda args: None) is None


def test_plan_indices_go_through_the_launching_environment_s_own_visible_devices():
    assert physical_gpus(["0", "1"], None) == ["0", "1"]
    assert physical_gpus(["1"], "4,5") == ["5"]
    assert physical_gpus(["0"], "GPU-bbb") == ["GPU-bbb"]
    assert physical_gpus(["3"], "4,5") == []      # names nothing the environment lets it see


def _plan(*gpu_envs: str) -> ClusterPlan:
    procs = [ProcessPlan(f"p{i}", "prefill", [], {"CUDA_VISIBLE_DEVICES": g} if g else {}, "127.0.0.1", 1, "")
             for i, g in enumerate(gpu_envs)]
    return ClusterPlan("c", procs, {}, "", None, "", {})


def test_gpu_memory_left_waits_for_the_driver_then_reports(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    readings = iter(["1, GPU-bbb, 70000\n", "1, GPU-bbb, 512\n"])
    slept = []
    freed = gpu_memory_left(_plan("0", "1", ""), run=lambda a: next(readings) if a[0].startswith("--query-gpu") else "",
                            sleep=slept.append)
    assert freed == [] and slept == [0.5]        # freed after one pause: not reported
    held = gpu_memory_left(_plan("1"), settle_s=2.0, run=smi(GPUS), sleep=slept.append)
    assert held == [GpuLeft(1, 71574, [])]
    assert gpu_memory_left(_plan("", ""), run=smi(GPUS)) == []      # no GPUs in the plan: nothing asked


def test_only_this_machine_s_servers_gpus_are_checked_here():
    remote = _server("decode-0", "1", host_name="b")
    plan = ClusterPlan("c", [_server("prefill-0", "0"), remote], {}, "", None, "", {}, launcher="ssh")
    asked = smi("0, GPU-aaa, 3\n1, GPU-bbb, 71574\n")
    assert gpu_memory_left(plan, run=asked, sleep=lambda s: None) == []   # GPU 1 here is not host b's GPU 1
    assert gpu_memory_left(_plan("1"), run=asked, sleep=lambda s: None) == [GpuLeft(1, 71574, [])]


def test_a_gpu_left_makes_the_stop_unclean():
    assert StopReport([], [], []).clean
    assert not StopReport([], [], [], [GpuLeft(1, 71574, [])]).clean


def _server(name: str, gpus: str, host_name: str = "local") -> ProcessPlan:
    return ProcessPlan(name, name.split("-")[0], ["vllm"], {"CUDA_VISIBLE_DEVICES": gpus}, "127.0.0.1", 1,
                       "http://127.0.0.1:1/health", host_name=host_name)


def test_a_dead_server_s_gpu_held_by_no_process_after_the_settle_time_is_reported_held(monkeypatch):
    from pdserve.supervise.peers import memory_held_by_nobody
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slept = []
    d, p = _server("decode-0", "1"), _server("prefill-0", "0")
    assert memory_held_by_nobody(d, [p], settle_s=3, run=smi(GPUS), sleep=slept.append) is True
    assert len(slept) == 3                                   # it waited for the driver before saying so
    assert memory_held_by_nobody(d, [p], settle_s=3, run=smi("1, GPU-bbb, 300\n"), sleep=slept.append) is False
    # someone's process is listed on it: not a leak this check can name
    assert memory_held_by_nobody(d, [p], settle_s=0, run=smi(GPUS, "GPU-bbb, 99\n")) is None


def test_a_gpu_check_that_cannot_tell_says_none():
    from pdserve.supervise.peers import memory_held_by_nobody
    d = _server("decode-0", "0")
    assert memory_held_by_nobody(d, [_server("prefill-0", "0")], settle_s=0, run=smi(GPUS)) is None   # shared
    assert memory_held_by_nobody(_server("decode-0", "1", "gpu-b"), [], settle_s=0, run=smi(GPUS)) is None
    assert memory_held_by_nobody(_server("decode-0", ""), [], settle_s=0, run=smi(GPUS)) is None
    assert memory_held_by_nobody(d, [], settle_s=0, run=lambda args: None) is None             # no nvidia-smi


def test_on_a_shared_gpu_a_dead_server_whose_share_is_not_free_resets_its_peer():
    """With CUDA-IPC GET zero-copy the peer maps the dead server's KV cache: its restart finds less free
    than its share and fails (docs/gpu.md), so the peer is reset before that start."""
    from pdserve.supervise.peers import memory_held_by_nobody
    d = ProcessPlan("decode-0", "decode", ["vllm", "--gpu-memory-utilization", "0.46"],
                    {"CUDA_VISIBLE_DEVICES": "0"}, "127.0.0.1", 1, "http://127.0.0.1:1/health")
    p = _server("prefill-0", "0")
    slept: list = []
    held = "0, GPU-aaa, 143771, 24637\n"                        # the dead server's memory still mapped
    assert memory_held_by_nobody(d, [p], settle_s=3, run=smi(held), sleep=slept.append) is True
    assert len(slept) == 3                                      # the driver had its time to free it
    freed = "0, GPU-aaa, 143771, 77000\n"                       # only the peer's own share in use
    assert memory_held_by_nobody(d, [p], settle_s=3, run=smi(freed), sleep=slept.append) is False
    unknown_share = _server("decode-0", "0")                    # no --gpu-memory-utilization: cannot tell
    assert memory_held_by_nobody(unknown_share, [p], settle_s=0, run=smi(held)) is None
