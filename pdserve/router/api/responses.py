"""OpenAI Responses (`/v1/responses`): what Codex and the OpenAI Agents SDK speak. D's handles come in the
whole answer and in the stream's final `response.completed` event (inside its `response`); D's token ids in
its handles (wire.TOKENS_KEY); the prompt's token ids from P's `/v1/responses/render`.

Nothing is stored: `store` is off on both legs (a stored response would live on one server only), and
`previous_response_id` / `background` are refused with a 400 that says to send the whole `input`, which is
what Codex does (`store: false`, full input every turn)."""

from __future__ import annotations

import json
import time
from typing import Any

from pdserve.router.api.base import Collector, HistoryItem, WireFormat, canonical_json, fingerprint_text
from pdserve.router.api.inputs import BadInput, check_common

TEXT_PARTS = ("input_text", "output_text", "text")
# Input items the client writes itself; every other item (an assistant message, a function call, reasoning) is
# a model's earlier output, so the request continues a conversation (ResponsesFormat.first_turn).
CLIENT_ROLES = ("user", "system", "developer")
SKIPPED_ITEMS = ("reasoning",)    # clients resend or drop them; templates mostly drop them


def response_id(request_id: str) -> str:
    """The response id vLLM gives a turn's D leg: the request_id the router sends it (see ResponsesFormat._leg)."""
    return f"resp_{request_id.removeprefix('pdserve-')}"


def _text(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    parts = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and part.get("type") in TEXT_PARTS:
            parts.append(str(part.get("text", "")))
        else:
            parts.append(canonical_json(part))
    return "".join(parts)


def history_items(items: Any) -> list[HistoryItem]:
    """Input or output items as history items: messages, function calls (as an assistant's tool call) and
    their outputs (a tool message); reasoning left out; anything else as its canonical JSON."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[HistoryItem] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": str(item.get("name", "")),
                                                  "arguments": canonical_json(item.get("arguments"))}}]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": _text(item.get("output"))})
        elif kind not in SKIPPED_ITEMS:
            out.append({"role": str(kind), "content": canonical_json(
                {k: v for k, v in item.items() if k not in ("id", "status")})})
    return out


class ResponsesCollector(Collector):
    end_event = b"event: response.completed"
    reply_from_lines = False      # response.completed carries the whole response, parsed for D's handles

    def __init__(self, keep_for_client: bool):
        super().__init__(keep_for_client)
        self._output: list[Any] = []

    def reset_reply(self) -> None:
        self._output = []

    def reply_items(self) -> list[HistoryItem]:
        return history_items(self._output)

    def scrub(self, obj: dict[str, Any], collect_reply: bool = True) -> bool:
        response = obj.get("response") if isinstance(obj.get("response"), dict) else obj   # an event, or whole
        changed = self.take_params(response)
        # The reply: a whole answer's output, or the final event's (kept even for a relayed stream: the
        # stream's lines are not kept, reply_from_lines)
        if (response is obj or obj.get("type") == "response.completed") and isinstance(response.get("output"), list):
            self._output = response["output"]
        return changed

    def collect_event(self, event: dict[str, Any]) -> None:
        response = event.get("response")
        if event.get("type") == "response.completed" and isinstance(response, dict):
            self._output = response.get("output") or []


class ResponsesFormat(WireFormat):
    api = "responses"
    routes = ("/v1/responses",)
    collector_class = ResponsesCollector
    render_path = "/v1/responses/render"
    max_tokens_field = "max_output_tokens"
    output_fields = ("max_output_tokens",)

    def validate(self, body: dict[str, Any]) -> None:
        if "input" not in body:
            raise BadInput(400, "'input' is required", "input")
        items = body.get("input")
        if not (isinstance(items, str) or isinstance(items, list) and all(isinstance(i, dict) for i in items)):
            raise BadInput(400, "'input' must be a string or a list of items (objects)", "input")
        if body.get("instructions") is not None and not isinstance(body["instructions"], str):
            raise BadInput(400, "'instructions' must be a string", "instructions")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            raise BadInput(400, "'tools' must be a list", "tools")
        for name in ("prompt_cache_key", "previous_response_id"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise BadInput(400, f"'{name}' must be a string", name)
        check_common(body, ("max_output_tokens",))

    def refuse(self, body: dict[str, Any]) -> tuple[str, str] | None:
        if body.get("previous_response_id"):
            return ("'previous_response_id' is not supported through pdserve's router: responses are not stored "
                    "(a stored response would live on one of its servers); send the whole conversation in "
                    "'input' with store: false, as Codex does", "previous_response_id")
        if body.get("background"):
            return "'background' is not supported through pdserve's router (it needs stored responses)", "background"
        return None

    def history(self, body: dict[str, Any]) -> list[HistoryItem] | None:
        items = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        return items + history_items(body.get("input"))

    def first_turn(self, body: dict[str, Any]) -> bool:
        if body.get("previous_response_id"):
            return False
        items = body.get("input")
        if isinstance(items, str):
            return True
        for item in reversed(items) if isinstance(items, list) else ():
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message" and item.get("role") in CLIENT_ROLES or isinstance(kind, str) and \
                    kind.endswith("_output"):
                continue                 # the client's message, or a tool's output it sends back
            return False
        return isinstance(items, list)

    def fingerprint(self, body: dict[str, Any]) -> str:
        tools = body.get("tools")
        names = sorted(str(t.get("name", t.get("type", ""))) for t in tools if isinstance(t, dict)) if tools else []
        return fingerprint_text(body.get("model") or "", body.get("instructions") or "", names)

    def _leg(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        # vLLM's engine request id and the response id the client sees are the body's request_id: the router's.
        return {**body, "store": False, "request_id": response_id(request_id)}

    def prefill_body(self, body: dict[str, Any], params: dict[str, Any] | None, request_id: str) -> dict[str, Any]:
        return super().prefill_body(self._leg(body, request_id + "-p"), params, request_id)

    def decode_body(self, body: dict[str, Any], params: dict[str, Any] | None, track: bool,
                    request_id: str) -> dict[str, Any]:
        return super().decode_body(self._leg(body, request_id), params, track, request_id)

    def whole_body(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        return self._leg(body, request_id)

    def tokenize_body(self, body: dict[str, Any], model: str) -> dict[str, Any] | None:
        return {**body, "stream": False, "store": False}

    def prompt_tokens(self, data: dict[str, Any]) -> int | None:
        usage = data.get("usage")
        value = usage.get("input_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) else None

    def stream_error(self, message: str, request_id: str = "", model: Any = None) -> bytes:
        # The response the stream began (its id: the openai SDK refuses a lifecycle event naming another).
        event = {"type": "response.failed", "response": {
            "id": response_id(request_id), "object": "response", "created_at": int(time.time()), "model": model,
            "status": "failed", "output": [], "incomplete_details": None,
            "error": {"code": "server_error", "message": message}}}
        return b"event: response.failed\ndata: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def stream_end(self) -> bytes:
        return b""     # response.completed carries the whole response: D's failure lost it, nothing to add
