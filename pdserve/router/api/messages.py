"""Anthropic Messages (`/v1/messages`): what Claude Code speaks. vLLM translates it to chat inside the server;
D's handles come top-level in a whole answer and, with pdserve's entry, in the stream's `message_stop` event
(engine/patches.py); D's token ids come in its handles (wire.TOKENS_KEY). The prompt's token ids come from P's
`/v1/messages/render` (the entry enables it)."""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.api.base import (
    Collector, HistoryItem, WireFormat, canonical_json, fingerprint_text, no_assistant_message,
)
from pdserve.router.api.inputs import BadInput, check_common, objects

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}
MIN_THINKING_BUDGET = 1024    # thinking.budget_tokens' least (Anthropic's and vLLM's)
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")   # clients drop or keep them; templates mostly drop them


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name if isinstance(name, str) else "",
                                             "arguments": canonical_json(arguments)}}


def blocks_item(role: Any, content: Any) -> HistoryItem:
    """One message (or a whole answer's content) as a history item: text joined, tool_use blocks as tool
    calls, any other block (tool_result, image, ...) as its canonical JSON."""
    if isinstance(content, str) or content is None:
        return {"role": role, "content": content or ""}
    parts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else [content]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(_call(block.get("name"), block.get("input")))
        elif kind not in SKIPPED_BLOCKS:
            parts.append(canonical_json({k: v for k, v in block.items() if k != "cache_control"}
                                        if isinstance(block, dict) else block))
    return {"role": role, "content": "".join(parts), "tool_calls": calls}


class MessagesCollector(Collector):
    end_event = b"event: message_stop"

    def __init__(self, keep_for_client: bool):
        super().__init__(keep_for_client)
        self._blocks: dict[int, dict[str, Any]] = {}    # stream: content block index -> block so far

    def reset_reply(self) -> None:
        self._blocks = {}

    def reply_items(self) -> list[HistoryItem]:
        blocks = []
        for _, block in sorted(self._blocks.items()):
            partial = block.get("partial")
            if isinstance(partial, str):                # a streamed tool_use: its input as JSON text
                block = {k: v for k, v in block.items() if k != "partial"}
                try:
                    block["input"] = json.loads(partial or "{}")
                except ValueError:
                    block["input"] = partial
            blocks.append(block)
        return [blocks_item("assistant", blocks)]

    def scrub(self, obj: dict[str, Any], collect_reply: bool = True) -> bool:
        changed = self.take_params(obj)
        if collect_reply and isinstance(obj.get("content"), list):     # a whole answer
            self._blocks = {i: b for i, b in enumerate(obj["content"]) if isinstance(b, dict)}
        return changed

    def collect_events(self, events: list[dict[str, Any]]) -> None:
        # Text deltas (most of a stream) joined once a run of them, not concatenated one by one; any other
        # event as collect_event.
        texts: dict[int, list[str]] = {}      # block index -> its text so far, in pieces
        for event in events:
            if event.get("type") == "content_block_delta":
                index, delta = event.get("index"), event.get("delta")
                if isinstance(index, int) and type(delta) is dict and delta.get("type") == "text_delta" \
                        and index in self._blocks:
                    pieces = texts.get(index)
                    if pieces is None:
                        pieces = texts[index] = [str(self._blocks[index].get("text", ""))]
                    pieces.append(str(delta.get("text", "")))
                    continue
            if texts:
                self._join(texts)
            self.collect_event(event)
        self._join(texts)

    def _join(self, texts: dict[int, list[str]]) -> None:
        for index, pieces in texts.items():
            self._blocks[index]["text"] = "".join(pieces)
        texts.clear()

    def collect_event(self, event: dict[str, Any]) -> None:
        kind, index = event.get("type"), event.get("index")
        if not isinstance(index, int):
            return
        if kind == "content_block_start" and isinstance(event.get("content_block"), dict):
            block = dict(event["content_block"])
            if block.get("type") == "tool_use":
                block["partial"] = ""
            self._blocks[index] = block
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict) and index in self._blocks:
            delta, block = event["delta"], self._blocks[index]
            if delta.get("type") == "text_delta":
                block["text"] = str(block.get("text", "")) + str(delta.get("text", ""))
            elif delta.get("type") == "input_json_delta" and "partial" in block:
                block["partial"] += str(delta.get("partial_json", ""))


class MessagesFormat(WireFormat):
    api = "messages"
    routes = ("/v1/messages",)
    collector_class = MessagesCollector
    render_path = "/v1/messages/render"
    forwards_prompt_ids = True

    def validate(self, body: dict[str, Any]) -> None:
        for i, m in enumerate(objects(body, "messages")):
            if not isinstance(m.get("role"), str):
                raise BadInput(400, f"messages[{i}].role must be a string", "messages")
            content = m.get("content")
            if not (isinstance(content, str) or isinstance(content, list)
                    and all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in content)):
                raise BadInput(400, f"messages[{i}].content must be a string or a list of blocks with a type",
                               "messages")
        system = body.get("system")
        if system is not None and not isinstance(system, (str, list)):
            raise BadInput(400, "'system' must be a string or a list of text blocks", "system")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            raise BadInput(400, "'tools' must be a list", "tools")
        check_common(body, ("max_tokens",))

    def history(self, body: dict[str, Any]) -> list[HistoryItem] | None:
        items = [blocks_item("system", body["system"])] if body.get("system") else []
        items += [blocks_item(m.get("role"), m.get("content")) for m in body.get("messages") or []]
        return items

    def first_turn(self, body: dict[str, Any]) -> bool:
        return no_assistant_message(body.get("messages"))

    def fingerprint(self, body: dict[str, Any]) -> str:
        tools = body.get("tools")      # names as strings: sorting mixed types failed (a 500)
        names = sorted(str(t.get("name", "")) for t in tools if isinstance(t, dict)) if tools else []
        system = body.get("system")
        if system and not isinstance(system, str):
            system = blocks_item("system", system)["content"]
        return fingerprint_text(body.get("model") or "", system or "", names)

    def tokenize_body(self, body: dict[str, Any], model: str) -> dict[str, Any] | None:
        return {**body, "stream": False}

    def prompt_tokens(self, data: dict[str, Any]) -> int | None:
        usage = data.get("usage")
        value = usage.get("input_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) else None

    def fit_output(self, body: dict[str, Any], room: int, fill: bool = False) -> dict[str, Any] | None:
        """max_tokens fitted, and an extended-thinking budget with it: vLLM (as Anthropic) wants
        `thinking.budget_tokens` below `max_tokens` and at least 1024. A budget that no longer fits is lowered
        below the new max_tokens, or dropped where that leaves less than 1024 (max_tokens still bounds the
        thinking). Neither is part of the prompt vLLM renders."""
        out = super().fit_output(body, room, fill)
        thinking = out.get("thinking") if out is not None else None
        if out is not None and isinstance(thinking, dict) and thinking.get("type") == "enabled" \
                and isinstance(thinking.get("budget_tokens"), int) and thinking["budget_tokens"] >= room:
            if room - 1 >= MIN_THINKING_BUDGET:
                out["thinking"] = {**thinking, "budget_tokens": room - 1}
            else:
                del out["thinking"]
        return out

    def error(self, status: int, message: str, err_type: str = "invalid_request_error",
              param: str | None = None) -> dict[str, Any]:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def client_error(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        err = body.get("error") if isinstance(body, dict) else None
        if body.get("type") == "error" or not isinstance(err, dict):
            return body                               # vLLM's own answer is already in this shape
        return self.error(status, str(err.get("message", "error")))

    def stream_error(self, message: str, request_id: str = "", model: Any = None) -> bytes:
        data = json.dumps(self.error(502, message), separators=(",", ":")).encode()
        return b"event: error\ndata: " + data + b"\n\n"

    def stream_end(self) -> bytes:
        return b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
