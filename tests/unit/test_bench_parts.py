"""Benchmark building blocks: deterministic workloads, vLLM's input formats, metric deltas."""

from __future__ import annotations

import json

from pdserve.bench.metrics import prefill_deltas
from pdserve.bench.report import outside_legs_ms
from pdserve.bench.workload import from_generate_config, from_messages, generate, load
from pdserve.observe.promtext import parse, total


def test_generated_workload_is_deterministic_and_grows():
    a, b, c = generate(seed=7), generate(seed=7), generate(seed=8)
    assert [x.user_turns for x in a] == [x.user_turns for x in b]
    assert [x.user_turns for x in a] != [x.user_turns for x in c]
    conv = a[0]
    assert len(a) == 4 and len(conv.user_turns) == 8 and conv.system.startswith("You are agent 0")
    assert conv.user_turns[1].startswith("Tool result for step 0") and len(conv.user_turns[1]) > len(conv.user_turns[0])
    first = conv.messages_for([], 0)
    assert [m["role"] for m in first] == ["system", "user"]
    later = conv.messages_for([*first, {"role": "assistant", "content": "ok"}], 1)
    assert [m["role"] for m in later] == ["system", "user", "assistant", "user"]


def test_vllm_conversation_list_keeps_user_turns_only(tmp_path):
    items = [{"id": "x", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]},
             {"id": "empty", "messages": []}]
    path = tmp_path / "convs.json"
    path.write_text(json.dumps(items))
    convs = load(path)
    assert len(convs) == 1 and convs[0].id == "x" and convs[0].system == "S" and convs[0].user_turns == ["u1", "u2"]
    assert from_messages(items)[0].user_turns == ["u1", "u2"]


def test_vllm_generate_conversations_config(tmp_path):
    cfg = {"filetype": "generate_conversations", "num_conversations": 3,
           "prompt_input": {"num_turns": {"distribution": "uniform", "min": 4, "max": 6},
                            "common_prefix_num_tokens": {"distribution": "constant", "value": 20},
                            "prefix_num_tokens": {"distribution": "constant", "value": 10},
                            "num_tokens": {"distribution": "constant", "value": 30}},
           "prompt_output": {"num_tokens": {"distribution": "constant", "value": 12}}}
    path = tmp_path / "gen.json"
    path.write_text(json.dumps(cfg))
    convs = load(path, seed=1)
    assert len(convs) == 3 and convs == from_generate_config(cfg, seed=1)
    for conv in convs:
        assert 2 <= len(conv.user_turns) <= 3 and conv.max_tokens == [12] * len(conv.user_turns)
        assert len(conv.user_turns[0].split()) == 20 + 10 + 30 and len(conv.user_turns[1].split()) == 30
    common = {" ".join(c.user_turns[0].split()[:20]) for c in convs}
    assert len(common) == 1                      # the common prefix is shared by every conversation


BEFORE = """
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 0.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 1000000.0
"""
AFTER = """
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1400.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1664.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.53
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 2700000.0
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
"""


def test_prefill_deltas_from_recorded_metrics():
    d = prefill_deltas(parse(BEFORE), parse(AFTER))
    assert d["tokens_computed"] == 400 and d["tokens_pulled"] == 1664 and d["kv_transfers"] == 1
    assert abs(d["kv_transfer_s"] - 0.03) < 1e-9 and d["kv_bytes"] == 1_700_000 and d["failed_transfers"] == 0
    assert total(parse(AFTER), "vllm:prompt_tokens_by_source_total") == 3064


def test_time_outside_the_legs_is_the_median_gap():
    rows = [{"latency_s": 1.0, "prefill_s": 0.6, "decode_s": 0.39},      # 10 ms outside the legs
            {"latency_s": 2.0, "prefill_s": 1.5, "decode_s": 0.47},      # 30 ms
            {"latency_s": 3.0, "prefill_s": 2.0, "decode_s": 0.98},      # 20 ms
            {"latency_s": 9.0, "prefill_s": None, "decode_s": None}]     # no Server-Timing: left out
    assert abs(outside_legs_ms(rows) - 20.0) < 1e-6
    assert outside_legs_ms(rows[3:]) is None


def test_host_facts_name_the_cpu_and_the_vector_units_vllm_cpu_uses():
    from pdserve.bench.report import host_facts
    info = "processor: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma\nprocessor: 1\nmodel name\t: AMD EPYC\n"
    facts = host_facts(info)
    assert facts["cpu"] == "AMD EPYC" and facts["isa"] == ["avx2"] and facts["cores"] >= 1
    assert host_facts("flags: avx2 avx512f amx_bf16")["isa"] == ["avx2", "avx512f", "amx_bf16"]


def test_arms_on_and_local_differ_only_in_decode_only():
    from pdserve.bench.arms import arm_config
    data = {"name": "c", "prefill": {"vllm_args": []}, "router": {}}
    on, local, off = (arm_config(data, arm) for arm in ("on", "local", "off"))
    assert on["router"]["decode_only"] is False and local["router"]["decode_only"] is True
    assert off["router"]["decode_only"] is False
    assert on["kv_transfer"] == local["kv_transfer"] == {"bidirectional_kv_xfer": True}
    assert on["prefill"] == local["prefill"]


def test_turns_by_size_split_short_and_long_and_compare_with_on():
    from pdserve.bench.report import by_turn_size
    row = lambda arm, new, ttft, plan, computed: {"arm": arm, "reusable_tokens": 1000, "new_tokens": new,  # noqa: E731
                                                  "ttft_s": ttft, "plan": plan, "tokens_computed": computed,
                                                  "tokens_pulled": 0 if plan == "decode_only" else 1000}
    rows = [row("on", 50, 0.4, "prefill_then_decode", 50), row("local", 50, 0.1, "decode_only", 0),
            row("on", 900, 1.0, "prefill_then_decode", 900), row("local", 900, 1.0, "prefill_then_decode", 900),
            {"arm": "on", "reusable_tokens": 0, "new_tokens": 2000, "ttft_s": 2.0}]    # first turns: left out
    sizes = by_turn_size(rows)
    assert sizes["short"]["local"] == {"turns": 1, "new_tokens_p50": 50, "ttft_p50_ms": 100, "decode_only": 1,
                                       "tokens_computed": 0, "tokens_pulled": 0, "speedup_vs_on": 4.0}
    assert sizes["long"]["local"]["speedup_vs_on"] == 1.0 and sizes["long"]["on"]["turns"] == 1


def test_bench_sizes_reach_the_measured_and_the_warmup_conversations(tmp_path):
    from pdserve.bench.session import Settings, prepare
    s = prepare(Settings(arms="on", conversations=1, turns=2, out=tmp_path, system_words=5, user_words=3,
                         tool_words=7))
    for conv in (*s.workload.convs, *s.workload.warm):
        words = [len(t.split(":", 1)[1].split()) for t in conv.user_turns]
        assert words == [3, 7] and len(conv.system.split()) == len("You are agent 0. Tools: read_file, search, run.".split()) + 5
    assert (s.workload.info["system_words"], s.workload.info["tool_words"]) == (5, 7)
