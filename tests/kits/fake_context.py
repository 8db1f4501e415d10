"""The fake vLLM's context limit (--max-model-len), checked as vLLM 0.32 checks it, with its messages:

- the output cap alone over max_model_len: `TokenizeParams.__post_init__` (vllm/renderers/params.py), the cap
  named as the API's request names it (`build_tok_params`: chat's max_completion_tokens when given, else
  max_tokens; completions max_tokens; responses max_output_tokens; messages become a chat request with both set,
  so max_completion_tokens);
- a prompt over max_model_len: `_token_len_check` (params.py), before anything is computed;
- a prompt of exactly max_model_len: no room for one output token (`_validate_prompt_len`,
  vllm/v1/engine/input_processor.py; Responses' own `_validate_generator_input`);
- otherwise the output is capped at what the prompt leaves (`get_max_tokens`, entrypoints/serve/utils/api_utils.py).

Each refusal is a 400 `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}` (the Anthropic
route reshapes it, as vLLM's does). `GET /v1/models` answers `max_model_len` as vLLM's does.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


def cap_param(route: str, body: dict[str, Any]) -> str:
    if route.startswith("/v1/messages"):
        return "max_completion_tokens"
    if route.startswith("/v1/responses"):
        return "max_output_tokens"
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _refuse(message: str, param: str | None, kind: str = "BadRequestError") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": 400}}, status=400)


def cap(body: dict[str, Any]) -> int | None:
    """The output cap of a chat or completions body (the fake's translation of the other APIs' included)."""
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


def refusal(route: str, body: dict[str, Any], prompt: int, limit: int) -> web.Response | None:
    """vLLM 0.32's 400 for this request on `route`, or None."""
    if not limit:
        return None
    param, cap_ = cap_param(route, body), cap(body)
    if cap_ is not None and cap_ > limit:
        return _refuse(f"{param}={cap_} cannot be greater than max_model_len={limit}. Please request fewer output "
                       "tokens.", param)
    if prompt > limit:
        return _refuse(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                       f"{prompt} input tokens, which exceeds this limit even without any output tokens. Please "
                       "reduce the length of the input prompt.", "input_tokens")
    if prompt == limit and route.startswith("/v1/responses"):
        return _refuse(f"The engine prompt length {prompt} exceeds the max_model_len {limit}. Please reduce prompt.",
                       "input", "invalid_request_error")
    if prompt == limit:
        return _refuse(f"The decoder prompt (length {prompt}) plus the number of requested output tokens (at least 1) "
                       f"is longer than the maximum model length of {limit}. Make sure that `max_model_len` is no "
                       "smaller than the number of text tokens (prompt + requested output tokens).", None)
    return None


def output_tokens(body: dict[str, Any], prompt: int, limit: int, default: int) -> int:
    """The tokens generated: the cap (the fake's `default` without one) within what the prompt leaves. Without
    a limit, max_tokens alone, as the fake always did."""
    if not limit:
        return int(body.get("max_tokens") or default)
    return min(cap(body) or default, limit - prompt)


def thinking_refusal(body: dict[str, Any]) -> web.Response | None:
    """vLLM's Anthropic request check on a leg that decodes: thinking.budget_tokens below max_tokens."""
    thinking = body.get("thinking")
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode") or not isinstance(thinking, dict):
        return None
    if thinking.get("type") == "enabled" and thinking.get("budget_tokens", 0) >= (body.get("max_tokens") or 0):
        return _refuse("thinking.budget_tokens must be less than max_tokens", None)
    return None


def models(model: str, limit: int) -> dict[str, Any]:
    """vLLM's /v1/models answer; without a limit (0) the fake does not say one."""
    return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm", "root": model,
                                        **({"max_model_len": limit} if limit else {})}]}
