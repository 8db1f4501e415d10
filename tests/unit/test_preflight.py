"""Machine checks: each has a failing case with its message and hint."""

from __future__ import annotations

import subprocess

from pdserve.checks.preflight import check_devices, check_fabric, check_ports, check_software
from pdserve.spec.load import parse_spec
from tests.kits.spec_data import DELETE, GOOD, plan_of, with_


def levels(findings):
    return [(f.level, f.check) for f in findings]


def test_software_versions():
    spec = parse_spec(GOOD)
    ok = check_software(spec, lambda names: {"vllm": ("vllm", "0.26.0"), "nixl": ("nixl", "0.7.1")}.get(names[0]))
    assert levels(ok) == [("ok", "vllm"), ("ok", "nixl")]
    old = check_software(spec, lambda names: ("vllm", "0.20.1") if "vllm" in names else ("nixl", "1"))
    assert old[0].level == "fail" and "needs >= 0.21" in old[0].message
    none = check_software(spec, lambda names: None)
    assert [f.level for f in none] == ["fail", "fail"] and none[0].hint
    custom = check_software(parse_spec(with_("server_command", ["my-server"])), lambda names: None)
    assert [f.level for f in custom] == ["ok"]


def test_devices_must_exist():
    spec = parse_spec(with_("decode.cpus", [7]))
    bad = check_devices(spec, cpu_count=2)
    assert bad[0].level == "fail" and bad[0].message == "CPU 7 does not exist (this machine has 2)"
    gpu = parse_spec(with_("prefill.gpus", [0], with_("decode.gpus", [5], with_("kv_transfer.kv_buffer_device", "cuda",
                     with_("prefill.cpus", DELETE, with_("decode.cpus", DELETE))))))
    assert check_devices(gpu, gpu_count=lambda: None)[0].message.startswith("GPUs are configured but nvidia-smi")
    assert check_devices(gpu, gpu_count=lambda: 4)[0].message == "GPU 5 does not exist (nvidia-smi lists 4)"
    assert check_devices(gpu, gpu_count=lambda: 8)[0].level == "ok"


def test_efa_needs_libfabric_and_the_provider():
    spec = parse_spec(with_("kv_transfer.backends", ["LIBFABRIC"]))
    assert check_fabric(parse_spec(GOOD)) == []
    assert "fi_info is not on PATH" in check_fabric(spec, which=lambda _: None)[0].message

    def fi_info(rc):
        return lambda *a, **k: subprocess.CompletedProcess(a, rc, "", "")
    assert check_fabric(spec, which=lambda _: "/x", run=fi_info(1))[0].message == "fi_info -p efa finds no EFA provider"
    assert check_fabric(spec, which=lambda _: "/x", run=fi_info(0))[0].level == "ok"


def test_ports():
    plan = plan_of(GOOD)
    assert check_ports(plan, ["router: port 8000"])[0].level == "fail"
    assert check_ports(plan, [])[0].level == "ok"


def test_open_file_limit_below_the_router_caps_is_a_warning():
    from pdserve.checks.preflight import check_open_files
    spec = parse_spec(GOOD)
    low = check_open_files(spec, (1024, 1024))
    assert low[0].level == "warn" and "1024" in low[0].message and "max_connections" in low[0].hint
    assert check_open_files(spec, (1024, 1048576))[0].level == "ok"


def test_a_model_without_chat_template_is_refused_before_start(tmp_path):
    import json
    from pdserve.checks.preflight import check_chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    bare = parse_spec(with_("model", str(tmp_path)))
    [f] = check_chat_template(bare)
    assert f.level == "fail" and "no chat template" in f.message and "canary" in f.message
    assert check_chat_template(parse_spec(with_("prefill.vllm_args", ["--chat-template", "t.jinja"],
                                                with_("model", str(tmp_path))))) == []
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert levels(check_chat_template(bare)) == [("ok", "chat_template")]



def test_open_file_limit_hint_names_the_settings_that_help():
    from pdserve.checks.preflight import check_open_files
    [low] = check_open_files(parse_spec(GOOD), (1024, 1024))
    assert "split 960" in low.message, low.message
    assert "router.upstream_max_connections to at most 960" in low.hint and "LimitNOFILE=" in low.hint
