"""Config validation: each broken file gives one clear line naming the field, as ConfigError (exit 2)."""

from __future__ import annotations

import pytest
import yaml

from pdserve.errors import EXIT_BAD_INPUT, ConfigError
from pdserve.spec.load import load_spec, parse_spec
from tests.kits.spec_data import DELETE, GOOD, with_


BROKEN = [
    (with_("prefill.bogus", 1), "prefill.bogus: unknown field"),
    (with_("kv_transfer.kv_role", "kv_both"), "kv_transfer.kv_role: unknown field"),
    (with_("decode.port", "eighty"), "decode.port: Input should be a valid integer"),
    (with_("decode.port", 70000), "decode.port: Input should be less than or equal to 65535"),
    (with_("model", DELETE), "model: required field is missing"),
    (with_("decode", DELETE), "decode: required field is missing"),
    (with_("decode.port", 8100), "decode.port: 8100 is already used by prefill[0]"),
    (with_("router.port", 8200), "decode.port: 8200 is already used by router"),
    (with_("decode.nixl_side_channel_port", 5600),
     "decode.nixl_side_channel_port: 5600 is already used by prefill[0] (nixl side channel)"),
    (with_("decode.cpus", [0]), "decode.cpus: CPU 0 is already used by prefill[0]"),
    (with_("decode.gpus", [0, 1]), "decode.gpus: 2 given, need replicas x tensor_parallel_size = 1"),
    (with_("prefill.gpus", [3], with_("decode.gpus", [3])), "decode.gpus: GPU 3 is already used by prefill[0]"),
    (with_("prefill.vllm_args", ["--port", "9"]), "prefill.vllm_args: --port is set by pdserve"),
    (with_("prefill.vllm_args", ["--kv-transfer-config={}"]), "prefill.vllm_args: --kv-transfer-config is set"),
    (with_("model", "/no/such/model/dir"), "model: path /no/such/model/dir does not exist"),
    (with_("model", "pdserve:huge"), "model: unknown built-in model 'pdserve:huge'"),
    (with_("router.reuse_ttl", 500), "router.reuse_ttl: 500 must be below kv_transfer.decoder_kv_blocks_ttl"),
    (with_("kv_transfer.kv_buffer_device", "tpu"), "kv_transfer.kv_buffer_device: Input should be 'cuda' or 'cpu'"),
    (with_("name", "bad name!"), "name: String should match pattern"),
    (with_("prefill.replicas", 0), "prefill.replicas: Input should be greater than or equal to 1"),
    (with_("prefill.replicas", 2), "prefill.cpus: 1 cores do not split evenly over 2 replicas"),
    (with_("decode.vllm_args", ["--api-key", "k"]), "decode.vllm_args: --api-key is set by pdserve"),
    (with_("router.api_key_env", "MY-KEY"), "router.api_key_env: String should match pattern"),
    (with_("router.breaker_failures", 0), "router.breaker_failures: Input should be greater than or equal to 1"),
    (with_("router.tenant_rate", -1), "router.tenant_rate: Input should be greater than or equal to 0"),
    (with_("router.max_in_flight", "many"), "router.max_in_flight: Input should be a valid integer"),
    (with_("router.queue_timeout", 0), "router.queue_timeout: Input should be greater than 0"),
    (with_("router.queue_size", 8), "router.queue_size: 8 needs router.max_in_flight"),
    (with_("router.tenant_burst", 4), "router.tenant_burst: needs router.tenant_rate"),
    (with_("router.max_buffered_mb", 8), "router.max_buffered_mb: 8 is below router.max_body_mb (16)"),
    (with_("prefill.tensor_parallel_size", 2), "decode.tensor_parallel_size: 1 is below prefill's 2"),
    (with_("prefill.gpus", [0], with_("prefill.cpus", DELETE)),
     "kv_transfer.kv_buffer_device: cpu with bidirectional_kv_xfer on GPUs is not supported"),
    (with_("router.replicas", 2), "router.replicas: 2 routers cannot share the memory store"),
    (with_("router.store", "memcached://x"), "router.store: 'memcached://x' is not managed, memory or a URL of"),
    (with_("router.replicas", 2, with_("router.store", "managed", with_("decode.port", 8002))),
     "decode.port: 8002 is already used by router[1]"),
    (with_("router.store", "managed", with_("decode.port", 8001)), "decode.port: 8001 is already used by the managed Redis"),
    (with_("kv_transfer.kv_recompute_threshold", 9000, with_("decode.vllm_args", ["--max-model-len", "8192"])),
     "kv_transfer.kv_recompute_threshold: 9000 is not below decode's --max-model-len 8192"),
    (with_("kv_transfer.kv_recompute_threshold", 8000, with_("decode.vllm_args", ["--max-model-len", "8192"])),
     "kv_transfer.kv_recompute_threshold: 8000 leaves the canary no room to prove the D->P pull within decode's"),
]


@pytest.mark.parametrize("data,message", BROKEN, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in enumerate(BROKEN)])
def test_broken_config_names_the_field(data, message):
    with pytest.raises(ConfigError) as exc:
        parse_spec(data, "c.yaml")
    assert exc.value.exit_code == EXIT_BAD_INPUT
    assert any(p.startswith(message) for p in exc.value.problems), exc.value.problems
    assert exc.value.message.startswith("c.yaml: ")


def test_good_config_and_defaults():
    spec = parse_spec(GOOD)
    assert spec.router.host == "127.0.0.1"          # safe by default
    assert spec.kv_transfer.bidirectional_kv_xfer is True
    assert spec.reuse_ttl == pytest.approx(0.9 * 480)
    assert spec.model_name == "org/some-model"


def test_a_threshold_the_canary_can_pass_or_no_canary_is_accepted():
    # the canary's second turn (a first past 3000 tokens + a follow-up past decode_only_max_tokens) fits 8192
    parse_spec(with_("kv_transfer.kv_recompute_threshold", 3000, with_("decode.vllm_args", ["--max-model-len", "8192"])))
    parse_spec(with_("supervisor.canary", False, with_("kv_transfer.kv_recompute_threshold", 8000,
                                                       with_("decode.vllm_args", ["--max-model-len", "8192"]))))


def test_second_replica_clashes_with_other_role():
    data = with_("prefill.replicas", 2, with_("prefill.cpus", [0, 1], with_("decode.port", 8101,
                 with_("decode.cpus", [2]))))
    with pytest.raises(ConfigError) as exc:
        parse_spec(data)
    assert "decode.port: 8101 is already used by prefill[1]" in exc.value.problems


def test_every_problem_is_reported_at_once():
    data = with_("decode.port", 8100, with_("decode.cpus", [0]))
    with pytest.raises(ConfigError) as exc:
        parse_spec(data)
    assert len(exc.value.problems) == 2


def test_yaml_syntax_error_has_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: t\nprefill: [unclosed\n")
    with pytest.raises(ConfigError) as exc:
        load_spec(f)
    assert "line 3" in exc.value.message or "line 2" in exc.value.message
    assert exc.value.exit_code == EXIT_BAD_INPUT


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec(tmp_path / "nope.yaml")


def test_relative_model_path_is_relative_to_the_file(tmp_path):
    (tmp_path / "m").mkdir()
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(with_("model", "./m")))
    assert load_spec(f).model == str(tmp_path / "m")


def test_embedded_default_is_valid():
    from pdserve.spec.load import DEFAULT_CONFIG
    spec = load_spec(DEFAULT_CONFIG)
    assert spec.model.startswith("pdserve:")
    assert spec.kv_transfer.kv_buffer_device == "cpu"
