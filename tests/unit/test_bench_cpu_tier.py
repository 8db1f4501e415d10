"""`pdserve bench` with a CPU KV tier on P (issue 43, items 3 and 5): the router's count of the tokens P loaded
from its tier (X-PDServe-Tier-Tokens) reaches each turn's row, a turn whose KV came from the tier counts as
`p_tier`, the agentic report adds those tokens to the achieved reuse, and the arms keep the config's tier only
where P's prefix cache is on (vLLM's tier needs it); arm `both` is D->P reuse with P's prefix cache and tier."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from pdserve.bench.agentic import kv_source
from pdserve.bench.agentic_report import agentic_report
from pdserve.bench.arms import ARMS, PREFIX_CACHE_ARMS, arm_config
from pdserve.bench.run import Endpoints, chat
from pdserve.router.wire import PULLED_HEADER, TIER_HEADER
from pdserve.spec.load import SHIPPED_CONFIGS, parse_spec


class TierRouter(BaseHTTPRequestHandler):
    """Answers every chat turn at once, saying P loaded 96 tokens from its CPU tier and pulled none from D."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        usage = {"prompt_tokens": 130, "completion_tokens": 2}
        if body.get("stream"):
            data = (b'data: {"choices": [{"delta": {"content": " the"}}]}\n\n'
                    b'data: {"choices": [], "usage": ' + json.dumps(usage).encode() + b"}\n\ndata: [DONE]\n\n")
        else:
            data = json.dumps({"choices": [{"message": {"content": " the of"}}], "usage": usage}).encode()
        self.send_response(200)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), TIER_HEADER: "96",
                     PULLED_HEADER: "0", "X-PDServe-Plan": "prefill_then_decode"}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def router_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), TierRouter)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_reads_the_tokens_p_loaded_from_its_cpu_tier(router_url, stream):
    ep = Endpoints(router_url, [router_url], "m", stream=stream)
    result = chat(ep, [{"role": "user", "content": "hi"}], 4, timeout=10)
    assert (result["tier_tokens"], result["pulled"], result["prompt_tokens"]) == (96, 0, 130)
    assert kv_source(result) == "p_tier"


def test_where_a_turns_kv_came_from():
    assert kv_source({"pulled": 0, "tier_tokens": 0, "plan": "prefill_then_decode"}) == "p"
    assert kv_source({"pulled": None, "tier_tokens": None, "plan": ""}) == "p"           # no router headers
    assert kv_source({"pulled": 0, "tier_tokens": 64, "plan": "prefill_then_decode"}) == "p_tier"
    assert kv_source({"pulled": 80, "tier_tokens": 64, "plan": "prefill_then_decode"}) == "d_pull"
    assert kv_source({"pulled": 0, "tier_tokens": 0, "plan": "decode_only"}) == "d_alone"


def row(arm: str, source: str, pulled: int | None, tier: int | None, reusable: int = 0) -> dict:
    return {"arm": arm, "conversation": "s", "turn": 1, "agent": "", "prompt_tokens": 2000, "ttft_s": 0.1,
            "latency_s": 0.2, "theoretical_tokens": 1500, "reusable_tokens": reusable, "kv_source": source,
            "pulled": pulled, "tier_tokens": tier}


def test_the_report_counts_the_cpu_tier_as_achieved_reuse_and_as_a_source():
    rows = [row("both", "p", 0, 0), row("both", "p_tier", 0, 1024), row("both", "p_tier", 0, 512),
            row("both", "d_pull", 900, 0), row("both", "d_alone", 0, 0, reusable=700)]
    a = agentic_report(rows, {"both": {"tokens_prefix_cache": 300.0, "tokens_computed": 50.0,
                                       "tokens_pulled": 2436.0}})["both"]     # P's connector counter: both kinds
    assert a["reuse_tokens_by_source"] == {"p_prefix_cache": 300.0, "p_cpu_tier": 1536, "d_pull": 900,
                                           "d_alone": 700, "computed_on_p": 50.0}
    assert a["achieved_reuse_tokens"] == 300 + 1536 + 900 + 700
    assert a["turns_by_kv_source"] == {"p": 1, "p_tier": 2, "d_pull": 1, "d_alone": 1}


def test_without_router_headers_ps_loaded_tokens_count_as_the_tier_in_an_arm_without_d_to_p():
    """vllm-router sends no pdserve headers: P's counter of tokens its connectors loaded is all the CPU tier's
    when the arm never pulls from D, and D's in an arm that does (no tier there)."""
    totals = {"tokens_prefix_cache": 100.0, "tokens_pulled": 800.0}
    vr = agentic_report([row("vllm-router", "p", None, None)], {"vllm-router": totals})["vllm-router"]
    assert (vr["reuse_tokens_by_source"]["p_cpu_tier"], vr["reuse_tokens_by_source"]["d_pull"]) == (800.0, 0)
    on = agentic_report([row("on", "p", None, None)], {"on": totals})["on"]
    assert (on["reuse_tokens_by_source"]["p_cpu_tier"], on["reuse_tokens_by_source"]["d_pull"]) == (0, 800.0)
    assert vr["achieved_reuse_tokens"] == on["achieved_reuse_tokens"] == 900.0


AGENT_CONFIG = {"name": "agent", "prefill": {"vllm_args": ["--max-model-len", "131072"], "kv_offloading_size": 64},
                "decode": {"vllm_args": [], "kv_offloading_size": 32}, "router": {}}


def test_arm_both_is_on_with_ps_prefix_cache_and_the_configs_cpu_tier():
    both, on = arm_config(AGENT_CONFIG, "both"), arm_config(AGENT_CONFIG, "on")
    assert "both" in ARMS and both["kv_transfer"]["bidirectional_kv_xfer"] is True
    assert both["prefill"]["vllm_args"] == ["--max-model-len", "131072", "--enable-prefix-caching"]
    assert both["prefill"]["kv_offloading_size"] == 64 and both["decode"]["kv_offloading_size"] == 32
    assert both["router"] == on["router"] and both["router"]["decode_only"] is False
    assert AGENT_CONFIG["prefill"]["kv_offloading_size"] == 64        # the user's file is not changed


@pytest.mark.parametrize("arm", ["on", "timer", "local", "off"])
def test_arms_with_ps_prefix_cache_off_drop_the_cpu_tier(arm):
    cfg = arm_config(AGENT_CONFIG, arm)
    assert cfg["prefill"]["vllm_args"][-1] == "--no-enable-prefix-caching"
    assert "kv_offloading_size" not in cfg["prefill"] and "kv_offloading_size" not in cfg["decode"]


@pytest.mark.parametrize("arm", ["prefix-cache", "affinity", "vllm-router"])
def test_arms_with_ps_prefix_cache_on_keep_the_cpu_tier(arm):
    cfg = arm_config(AGENT_CONFIG, arm)
    assert cfg["kv_transfer"]["bidirectional_kv_xfer"] is False
    assert cfg["prefill"]["vllm_args"][-1] == "--enable-prefix-caching"
    assert (cfg["prefill"]["kv_offloading_size"], cfg["decode"]["kv_offloading_size"]) == (64, 32)


def test_a_config_without_a_tier_gets_none_in_any_arm():
    for arm in ARMS:
        cfg = arm_config({"name": "c", "prefill": {"vllm_args": []}}, arm)
        assert "kv_offloading_size" not in cfg["prefill"] and "kv_offloading_size" not in cfg.get("decode", {})


def test_every_arm_of_the_shipped_agent_config_is_a_config_pdserve_accepts():
    """configs/gpu-1p1d-agent-128k.yaml keeps a CPU tier on P: the arms that turn P's prefix cache off must
    drop it, or the spec check refuses the arm's file (a tier needs P's prefix cache)."""
    data = yaml.safe_load((SHIPPED_CONFIGS / "gpu-1p1d-agent-128k.yaml").read_text())
    assert data["prefill"]["kv_offloading_size"]
    for arm in ARMS:
        spec = parse_spec(arm_config(data, arm), f"{arm}.yaml")
        assert bool(spec.prefill.kv_offloading_size) is (arm in PREFIX_CACHE_ARMS), arm
