"""OpenAI Completions (`/v1/completions`): a prompt, no conversation history (explicit ids only)."""

from __future__ import annotations

from typing import Any

from pdserve.router.api.base import WireFormat
from pdserve.router.api.chat import ChoicesCollector
from pdserve.router.api.inputs import BadInput, check_common


def prompt_ids_if_given(body: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids needs no tokenization."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


class CompletionsFormat(WireFormat):
    api = "completions"
    routes = ("/v1/completions",)
    collector_class = ChoicesCollector
    native_token_ids = True
    # vLLM's own ids, per choice: a completions request may hold several prompts, each its own engine request
    sequence_from_entry = False

    def validate(self, body: dict[str, Any]) -> None:
        if "prompt" not in body:
            raise BadInput(400, "'prompt' is required", "prompt")
        if not isinstance(body.get("prompt"), (str, list)):
            raise BadInput(400, "'prompt' must be a string or a list", "prompt")
        check_common(body, ("max_tokens", "n", "min_tokens"))

    def tokenize_body(self, body: dict[str, Any], model: str) -> dict[str, Any] | None:
        prompt = body.get("prompt")
        return {"model": model, "prompt": prompt} if isinstance(prompt, str) else None
