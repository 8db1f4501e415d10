"""The built-in models and the embedded default serve coding agents as installed (issue 42): Claude Code's first
turn (11,064 tokens of messages with the tiny tokenizer, plus its tools) and its default max_tokens of 32,000 fit
the default's --max-model-len, which the tiny model's positions and D's KV cache hold; the chat template renders
`tools` and tool results as Qwen2.5's does, and vLLM's hermes parser reads the tool calls it writes."""

from __future__ import annotations

import json

import pytest
import yaml

from pdserve.engine.models import BUILTIN_MODELS, CHAT_TEMPLATE
from pdserve.spec.load import DEFAULT_CONFIG

CLAUDE_CODE_FIRST_TURN = 11_064          # tokens of messages, tiny tokenizer, tools not counted
CLAUDE_CODE_MAX_TOKENS = 32_000          # what `claude` asks by default
GiB = 1 << 30

TOOLS = [{"type": "function", "function": {
    "name": "Read", "description": "Reads a file from the local filesystem.",
    "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}},
    {"type": "function", "function": {
        "name": "Bash", "description": "Runs a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
CALLS = [{"id": "c1", "type": "function", "function": {"name": "Read", "arguments": {"file_path": "a.py"}}},
         {"id": "c2", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls -l"}}}]
AGENT_TURNS = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Look at a.py"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    {"role": "tool", "tool_call_id": "c2", "content": "a.py b.py"},
    {"role": "system", "content": "Reminder: keep it short."},      # Claude Code's inline reminders
    {"role": "user", "content": "Now fix it"},
]


def render(messages: list, tools: list | None = None, add_generation_prompt: bool = True) -> str:
    """As vLLM renders for an HF tokenizer: transformers' own Jinja environment and tojson."""
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=CHAT_TEMPLATE,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


def default_args(role: str) -> list[str]:
    return yaml.safe_load(DEFAULT_CONFIG.read_text())[role]["vllm_args"]


def max_model_len(args: list[str]) -> int:
    return int(args[args.index("--max-model-len") + 1])


def kv_bytes_per_token(spec: dict) -> int:
    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    return spec["num_hidden_layers"] * spec["num_key_value_heads"] * head_dim * 2 * 2     # K and V, bf16


def test_tiny_has_positions_for_agent_sessions():
    assert BUILTIN_MODELS["tiny"]["max_position_embeddings"] >= 65_536
    assert BUILTIN_MODELS["mid"]["max_position_embeddings"] >= 65_536
    assert kv_bytes_per_token(BUILTIN_MODELS["tiny"]) == 1024


def test_the_default_config_holds_claude_codes_first_turn_and_its_max_tokens():
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert cfg["model"] == "pdserve:tiny"
    tiny = BUILTIN_MODELS["tiny"]
    p, d = max_model_len(default_args("prefill")), max_model_len(default_args("decode"))
    assert p == d, "P and D serve the same request: the same --max-model-len"
    assert d >= max(65_536, CLAUDE_CODE_FIRST_TURN + CLAUDE_CODE_MAX_TOKENS)
    assert d <= tiny["max_position_embeddings"]          # past the model's positions the engine crashes
    # D's KV cache holds at least one full-context sequence (vLLM refuses to start otherwise)
    kv_space = float(cfg["decode"]["env"]["VLLM_CPU_KVCACHE_SPACE"]) * GiB
    assert kv_space >= d * kv_bytes_per_token(tiny)


def test_tools_go_into_the_system_turn_as_qwen25_writes_them():
    text = render(AGENT_TURNS, TOOLS)
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n\n")
    inside = system[system.index("<tools>\n") + 8:system.index("\n</tools>")]
    assert [json.loads(line) for line in inside.split("\n")] == TOOLS
    assert system.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert text.count("You are a coding agent.") == 1               # the first system message only there
    # with no system message the tools block stands alone; without tools nothing is added
    assert render([{"role": "user", "content": "hi"}], TOOLS).startswith("<|im_start|>system\n# Tools\n\n")
    assert render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tool_calls_and_grouped_tool_results():
    text = render(AGENT_TURNS, TOOLS)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "Read", "arguments": {"file_path": "a.py"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -l"}}\n</tool_call><|im_end|>\n') in text
    # two consecutive tool results: one user turn, one <tool_response> block each
    assert ("<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response>\n<tool_response>\na.py b.py\n"
            "</tool_response><|im_end|>\n<|im_start|>system\nReminder: keep it short.<|im_end|>\n") in text
    assert "<|im_start|>tool" not in text
    assert text.endswith("<|im_start|>user\nNow fix it<|im_end|>\n<|im_start|>assistant\n")
    # an assistant turn with text before its call
    said = render([{"role": "assistant", "content": "Reading.", "tool_calls": CALLS[:1]}], add_generation_prompt=False)
    assert said.startswith("<|im_start|>assistant\nReading.\n<tool_call>\n{")


def test_plain_chat_renders_as_before():
    """No tools, no tool messages: the ChatML the template always wrote (the router's and the benchmarks'
    token counts stay comparable)."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    assert render(messages) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                                "<|im_start|>assistant\n")


def test_inline_system_messages_render_so_vllm_does_not_merge_them():
    """vLLM's /v1/messages merges a conversation's inline system messages into the first (changing the prompt's
    prefix each turn) only for a template that raises on them: it probes with this environment and turns."""
    from jinja2 import ext, sandbox
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.from_string(CHAT_TEMPLATE).render(messages=[
        {"role": "system", "content": "t"}, {"role": "user", "content": "t"},
        {"role": "system", "content": "t"}, {"role": "user", "content": "t"}], add_generation_prompt=False)


def test_vllms_hermes_parser_reads_what_the_template_writes():
    """The model is told to answer in the format its history renders with; the configs' parser (hermes, added by
    the planner for built-in models) turns that text back into the same calls."""
    manager = pytest.importorskip("vllm.tool_parsers").ToolParserManager     # importing vLLM: ~15 s on 2 cores
    from pdserve.plan.tools import BUILTIN_TOOL_CALL_PARSER
    history = render([{"role": "user", "content": "go"}, {"role": "assistant", "content": "Sure.", "tool_calls": CALLS}],
                     TOOLS, add_generation_prompt=False)
    reply = history.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parser = manager.get_tool_parser(BUILTIN_TOOL_CALL_PARSER)(tokenizer=object())
    found = parser.extract_tool_calls(reply, request=None)
    assert found.tools_called and found.content == "Sure.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in found.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
