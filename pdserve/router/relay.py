"""Token ids for the continuation check: what D generated (vLLM's `return_token_ids`) and what the next
prompt tokenizes to (P's `/tokenize`), plus scrubbing the fields the client did not ask for."""

from __future__ import annotations

import json
from typing import Any

TOKENIZE_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "tools", "mm_processor_kwargs")
TOKEN_FIELDS = ("prompt_token_ids", "token_ids")


def tokenize_body(route: str, body: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The /tokenize request giving the token ids vLLM will prefill for `body`; None when unsupported."""
    if route.endswith("/chat/completions"):
        return {"model": model, **{k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body}}
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"model": model, "prompt": prompt}
    return None


def prompt_ids_if_given(body: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids needs no tokenization."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


class SequenceCollector:
    """Gathers D's prompt + generated token ids and the reply message from a response or stream chunks
    (choice 0 only: one conversation has one continuation), and removes the ids unless the client asked
    for them."""

    def __init__(self, keep_for_client: bool):
        self.keep = keep_for_client
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        self.kv_params: dict[str, Any] | None = None
        self._text: list[str] = []
        self._calls: dict[int, list[str]] = {}    # tool call index -> [name, arguments]

    @property
    def sequence(self) -> list[int] | None:
        return None if self.prompt is None else self.prompt + self.generated

    @property
    def reply(self) -> dict[str, Any]:
        """The assistant message the client received, as it would send it back next turn."""
        calls = [{"type": "function", "function": {"name": n, "arguments": a}}
                 for _, (n, a) in sorted(self._calls.items())]
        return {"role": "assistant", "content": "".join(self._text), "tool_calls": calls}

    def _collect_reply(self, choice: dict[str, Any]) -> None:
        message = choice.get("message")
        if isinstance(message, dict):            # a whole response
            self._text = [message.get("content") or ""]
            self._calls = {}
            calls = message.get("tool_calls")
            parts = list(enumerate(calls)) if isinstance(calls, list) else []
        elif isinstance(choice.get("delta"), dict):   # a stream chunk
            delta = choice["delta"]
            self._text.append(delta.get("content") or "")
            calls = delta.get("tool_calls")
            parts = [(c.get("index", i), c) for i, c in enumerate(calls if isinstance(calls, list) else [])
                     if isinstance(c, dict)]
        else:
            return
        for index, call in parts:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                slot = self._calls.setdefault(index, ["", ""])
                slot[0] += fn.get("name") or ""
                slot[1] += fn.get("arguments") or ""

    def scrub(self, obj: dict[str, Any], collect_reply: bool = True) -> bool:
        """Take kv_transfer_params and token ids out of one response object; True if it changed."""
        changed = False
        params = obj.pop("kv_transfer_params", None)
        if params is not None:
            self.kv_params, changed = params, True
        if isinstance(obj.get("prompt_token_ids"), list):
            self.prompt = obj["prompt_token_ids"]
            if not self.keep:
                del obj["prompt_token_ids"]
                changed = True
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else []:   # D's output is checked, not trusted
            if not isinstance(choice, dict):
                continue
            first = choice.get("index", 0) == 0
            if first and collect_reply:
                self._collect_reply(choice)
            if first and isinstance(choice.get("prompt_token_ids"), list):
                self.prompt = choice["prompt_token_ids"]
            if first and isinstance(choice.get("token_ids"), list):
                self.generated.extend(choice["token_ids"])
            if not self.keep:
                for f in TOKEN_FIELDS:
                    if f in choice:
                        del choice[f]
                        changed = True
        return changed

    def scrub_sse_line(self, line: bytes, collect_reply: bool = True) -> bytes:
        """One SSE line from D, with router-only fields removed."""
        event = _sse_event(line)
        if event is None or not self.scrub(event, collect_reply):
            return line
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n"

    def collect_reply_from(self, lines: list[bytes]) -> None:
        """Rebuild the reply message from the stream's data lines (done only when it will be stored)."""
        self._text, self._calls = [], {}
        for line in lines:
            event = _sse_event(line)
            for choice in (event or {}).get("choices") or []:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    self._collect_reply(choice)


def _sse_event(line: bytes) -> dict[str, Any] | None:
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return None
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


# Only lines mentioning these can carry something the client must not see.
ROUTER_ONLY_MARKERS = (b"kv_transfer_params", b"token_ids")


class StreamRelay:
    """Relays D's SSE bytes as they arrive, whole lines at a time: one write per upstream read instead of
    one per token, and JSON is parsed only for lines that carry router-only fields. The reply text (for
    automatic conversation detection) is rebuilt from the kept lines after the stream, and only if D
    reported blocks worth remembering."""

    def __init__(self, collector: SequenceCollector, keep_lines: bool):
        self.collector = collector
        self.keep_lines = keep_lines
        self.blocks: list[bytes] = []  # what D sent, split into lines only if the reply is wanted
        self.done = False              # D sent its final `data: [DONE]`
        self._partial = b""

    def feed(self, data: bytes) -> bytes:
        data = self._partial + data
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:]
        return self._process(data[:cut])

    def close(self) -> bytes:
        rest, self._partial = self._partial, b""
        return self._process(rest) if rest else b""

    def _process(self, block: bytes) -> bytes:
        if not block:
            return b""
        if b"data: [DONE]" in block:
            self.done = True
        if self.keep_lines:
            self.blocks.append(block)
        if not any(marker in block for marker in ROUTER_ONLY_MARKERS):
            return block
        return b"".join(self.collector.scrub_sse_line(line, collect_reply=False)
                        for line in block.splitlines(keepends=True))

    def finish(self) -> None:
        if self.keep_lines and self.collector.kv_params is not None:
            self.collector.collect_reply_from([line for line in b"".join(self.blocks).split(b"\n")
                                               if line.startswith(b"data: {")])
