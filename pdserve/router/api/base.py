"""What the router needs to know about one wire format (an HTTP API vLLM serves), in one place.

The turn flow, the legs, the route policy, the store and the metrics take a `WireFormat` and never look inside a
body: this module and one file per format (chat.py, completions.py, messages.py, responses.py) do. A format
says how to check a request, what conversation it continues (its history as chat-like items), how to make the
P-leg and D-leg bodies, how to learn the prompt's token ids, where D's block handles and token ids are in an
answer or a stream event (taken out before the client), where a stream ends, and how errors look to its
clients.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pdserve.router import fastjson
from pdserve.router.errors import error_body
from pdserve.router.wire import TOKENS_KEY, WANT_PROMPT_IDS_KEY, WANT_TOKENS_KEY

# kv_transfer_params that make P prefill for a remote decode (turn 1, or a turn with nothing to read).
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
# Fields only the router sets on a backend request; taken out of every client body.
ROUTER_ONLY = ("kv_transfer_params", "conversation_id")


def strip_router_only(body: dict[str, Any]) -> None:
    """Take the router's fields out of a client body, `vllm_xargs.kv_transfer_params` too: vLLM copies
    vllm_xargs into the request's extra args, where its connector reads kv_transfer_params whenever the body
    has none at top level (a degraded turn, a request that is no turn), so a client's would reach the engine:
    a block id of another tenant's turn read, or a non-object one failing the server."""
    for field in ROUTER_ONLY:
        body.pop(field, None)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_transfer_params"}
HistoryItem = dict[str, Any]     # {"role", "content", "tool_calls"?}: what identity.py hashes
# vLLM's Responses events before the last each carry the response so far with a null kv_transfer_params
# (pydantic's compact JSON): taken out as bytes, no parse.
NULL_PARAMS = b',"kv_transfer_params":null'
# A stream's data lines that hold a JSON object (the line's end, a \r, is JSON whitespace; `.` stops at \n)
DATA_OBJECT = re.compile(rb"^data: ?(\{.*)$", re.MULTILINE)


class Collector:
    """D's answer as the router needs it: its block handles (kv_params), its sequence (prompt + generated
    token ids, for the next turn's continuation check) and the reply as the client will send it back
    (history items). `scrub` takes the router-only fields out of one answer object or stream event; the
    format's subclass knows where they are."""

    # Stream lines mentioning none of these carry nothing the client must not see (not parsed).
    markers: tuple[bytes, ...] = (b"kv_transfer_params", b"token_ids")
    # A line starting with this says D has finished the answer ...
    end_line: bytes = b"data: [DONE]"
    # ... or, for formats of named events, the data line after this event line (it carries D's handles).
    end_event: bytes | None = None
    # The reply is rebuilt from the stream's lines (kept while it streams); False: the event with D's handles
    # carries the whole reply, taken when the handles are (Responses' response.completed).
    reply_from_lines = True

    def __init__(self, keep_for_client: bool):
        self.keep = keep_for_client
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        self.tokens: list[int] | None = None      # D's whole sequence from the entry's patch (TOKENS_KEY)
        self.kv_params: dict[str, Any] | None = None
        self._ending = False      # end_event seen, its data line not yet

    @property
    def sequence(self) -> list[int] | None:
        if self.tokens is not None:
            return self.tokens
        return None if self.prompt is None else self.prompt + self.generated

    def take_params(self, holder: dict[str, Any]) -> bool:
        """Pop `holder`'s kv_transfer_params (and the token ids the entry put in them); True if the field was
        there (a null one too: vLLM's Responses events carry `"kv_transfer_params": null`, no client's business)."""
        if "kv_transfer_params" not in holder:
            return False
        params = holder.pop("kv_transfer_params")
        if params is None:
            return True
        if isinstance(params, dict):
            tokens = params.pop(TOKENS_KEY, None)
            if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
                self.tokens = tokens
        self.kv_params = params
        return True

    def scrub(self, obj: dict[str, Any], collect_reply: bool = True) -> bool:
        """Take router-only fields out of one answer object or event; True if it changed."""
        raise NotImplementedError

    def reply_items(self) -> list[HistoryItem]:
        """The reply as history items, as the client will send it back next turn."""
        raise NotImplementedError

    def collect_event(self, event: dict[str, Any]) -> None:
        """Add one stream event's part of the reply (called only when the reply will be stored)."""
        raise NotImplementedError

    def reset_reply(self) -> None:
        raise NotImplementedError

    def ends(self, block: bytes) -> bool:
        """Does this block of whole SSE lines (a stream's blocks in order) end D's answer?"""
        if self.end_event is None:
            return _line_at(block, self.end_line) >= 0
        at = 0 if self._ending else _line_at(block, self.end_event)
        if at < 0:
            return False
        self._ending = True
        return _line_at(block[at:], b"data:") >= 0

    def scrub_sse_line(self, line: bytes, collect_reply: bool = True) -> bytes:
        """One SSE line from D, with router-only fields removed."""
        if NULL_PARAMS in line and line.count(b"kv_transfer_params") == 1 and b"token_ids" not in line:
            return line.replace(NULL_PARAMS, b"", 1)     # nothing to take: no parse, no new JSON text
        event = sse_event(line)
        if event is None or not self.scrub(event, collect_reply):
            return line
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n"

    def scrub_block(self, block: bytes, marked: Callable[[bytes], Any]) -> bytes:
        """A block of whole lines with router-only fields taken out of the lines `marked` finds (SSE's line
        ends: CR, LF, CRLF)."""
        scrub = self.scrub_sse_line
        return b"".join([scrub(line, False) if marked(line) else line for line in block.splitlines(keepends=True)])

    def collect_reply_from(self, lines: list[bytes]) -> None:
        """Rebuild the reply from the stream's data lines (done only when it will be stored)."""
        self.collect_reply_from_stream(b"\n".join(lines))

    def collect_reply_from_stream(self, stream: bytes) -> None:
        """Rebuild the reply from the stream's bytes as D sent them (done only when it will be stored)."""
        self.reset_reply()
        self.collect_events(stream_events(stream))

    def collect_events(self, events: list[dict[str, Any]]) -> None:
        """collect_event for each event in order (a format may take its common events faster)."""
        for event in events:
            self.collect_event(event)


def _line_at(block: bytes, start: bytes) -> int:
    """Where a line starting with `start` begins in `block`, or -1 (JSON strings hold no raw newline, so
    text inside an event never matches)."""
    if block.startswith(start):
        return 0
    at = block.find(b"\n" + start)
    return at + 1 if at >= 0 else -1


def stream_events(stream: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a stream's data lines, in order: parsed as one JSON array (one call of the C
    parser, not one a line); a line that is not one JSON object is left out, as sse_event leaves it out."""
    payloads = DATA_OBJECT.findall(stream)
    try:
        events = fastjson.loads(b"[" + b",".join(payloads) + b"]")
    except ValueError:
        events = None
    if not isinstance(events, list) or len(events) != len(payloads):   # a bad line (or lines that only parse
        events = [_object(p) for p in payloads]                         # when joined): one by one
    return [e for e in events if isinstance(e, dict)]


def _object(payload: bytes) -> Any:
    """One data line's JSON, None when it is not JSON (a stream's first chunk carries the prompt's ids)."""
    try:
        return fastjson.loads(payload)
    except fastjson.DecodeError:
        return None


def sse_event(line: bytes) -> dict[str, Any] | None:
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == b"[DONE]":
        return None
    event = _object(payload)
    return event if isinstance(event, dict) else None


class WireFormat:
    api: str = ""                    # the API label of metrics and status: chat, completions, messages, responses
    routes: tuple[str, ...] = ()
    collector_class: type[Collector] = Collector
    # Where P's /tokenize-equivalent is (None: /tokenize, which reads chat and completions bodies).
    render_path: str | None = None
    max_tokens_field = "max_tokens"  # the output cap set to 1 on the P leg
    # Every output-token cap the format has (chat has two): fitted on D's request to what the context leaves.
    output_fields: tuple[str, ...] = ("max_tokens",)
    # The format takes vLLM's return_token_ids (chat, completions): a client may ask for them, the body may carry
    # the prompt's ids, and a turn's stamp applies (book.py, plan.py).
    native_token_ids = False
    # A tracked turn's D sequence asked of the entry's patch (WANT_TOKENS_KEY: once, beside D's handles at the
    # answer's end) where D has handles to answer with, not through return_token_ids: that puts the prompt's ids
    # in the first chunk, on the way to the first token (37.8k ids at 36k tokens), and each token's id in its
    # chunk, cut out of every chunk by the router. True for every format but completions.
    sequence_from_entry = True
    # D takes P's prompt ids instead of rendering and tokenizing the prompt again (wire.PROMPT_IDS_KEY): vLLM's
    # chat path, which /v1/messages goes through too; not /v1/responses or /v1/completions.
    forwards_prompt_ids = False

    def collector(self, keep_for_client: bool = False) -> Collector:
        return self.collector_class(keep_for_client)

    # -- requests ---------------------------------------------------------------------------------
    def validate(self, body: dict[str, Any]) -> None:
        """Field types the router relies on; raises inputs.BadInput. Finer checks are vLLM's."""
        raise NotImplementedError

    def refuse(self, body: dict[str, Any]) -> tuple[str, str] | None:
        """(message, param) when the request asks for what P-D cannot serve (a 400), else None."""
        return None

    def history(self, body: dict[str, Any]) -> list[HistoryItem] | None:
        """The conversation so far as history items (for automatic detection), None when not a chat."""
        return None

    def first_turn(self, body: dict[str, Any]) -> bool:
        """The request's history holds no earlier model output: a conversation's first turn, counted apart from
        the reuse hit rate (reuse.FIRST). False where a format carries no history the router can read
        (completions: its prompt is one text, so a session's first completions request counts no_entry)."""
        return False

    def fingerprint(self, body: dict[str, Any]) -> str:
        """What tells a session's side requests (another system prompt, tools or model) from its main
        chain under one session id: folded into the explicit conversation key. Empty: nothing."""
        return ""

    def prefill_body(self, body: dict[str, Any], params: dict[str, Any] | None, request_id: str) -> dict[str, Any]:
        """P's request: one output token, not streamed, with `params` (None: turn 1's REMOTE_DECODE)."""
        kv = params if params is not None else REMOTE_DECODE
        if self.forwards_prompt_ids:
            kv = {**kv, WANT_PROMPT_IDS_KEY: True}    # P returns its prompt ids with its params, for D
        out = {**body, self.max_tokens_field: 1, "stream": False, "kv_transfer_params": dict(kv)}
        for field in ("stream_options", "min_tokens", "return_token_ids"):
            out.pop(field, None)
        return out

    def decode_body(self, body: dict[str, Any], params: dict[str, Any] | None, track: bool,
                    request_id: str) -> dict[str, Any]:
        """D's request: the client's, with P's handles (or a D-alone turn's params); asking for D's token
        ids when the turn will be remembered."""
        out = dict(body)
        if params is not None:
            out["kv_transfer_params"] = params
        if track:
            if params is not None and self.sequence_from_entry:
                out["kv_transfer_params"] = {**params, WANT_TOKENS_KEY: True}
            elif self.native_token_ids:
                out["return_token_ids"] = True
        return out

    def fit_output(self, body: dict[str, Any], room: int, fill: bool = False) -> dict[str, Any] | None:
        """`body` with each output-token cap over `room` (>= 1) lowered to it, and with `fill` the format's
        first cap set to `room` where the body sends none; None when nothing changes. Only fields that are no
        part of the prompt change: P's KV stays D's prompt."""
        over = {f: room for f in self.output_fields
                if isinstance(body.get(f), int) and not isinstance(body[f], bool) and body[f] > room}
        if fill and not any(body.get(f) is not None for f in self.output_fields):
            over[self.output_fields[0]] = room
        return {**body, **over} if over else None

    def whole_body(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """A request served whole on one server (degraded): the client's as it is."""
        return body

    def tokenize_body(self, body: dict[str, Any], model: str) -> dict[str, Any] | None:
        """The body of P's /tokenize (or render_path) request for this prompt; None when unsupported."""
        return None

    def prompt_ids(self, data: dict[str, Any]) -> list[int] | None:
        """The token ids in P's /tokenize (or render) answer."""
        tokens = data.get("token_ids" if self.render_path else "tokens")
        return tokens if isinstance(tokens, list) else None

    def prompt_tokens(self, data: dict[str, Any]) -> int | None:
        """The prompt's token count in a whole answer's usage."""
        usage = data.get("usage")
        value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) else None

    # -- errors -----------------------------------------------------------------------------------
    def error(self, status: int, message: str, err_type: str = "invalid_request_error",
              param: str | None = None) -> dict[str, Any]:
        """An error body in this format's clients' shape."""
        return error_body(message, err_type, status, param)

    def client_error(self, body: dict[str, Any], status: int) -> dict[str, Any]:
        """An error answer (the router's, OpenAI-shaped, or a backend's) in the client's shape."""
        return body

    def stream_error(self, message: str, request_id: str = "", model: Any = None) -> bytes:
        """The event that ends a stream broken after bytes reached the client, end marker included
        (`request_id`, `model`: the turn's, for a format whose events name the response they end)."""
        return b"data: " + json.dumps(error_body(message, "server_error", 502)).encode() + b"\n\ndata: [DONE]\n\n"

    def stream_end(self) -> bytes:
        """What ends a stream whose end marker D's failure kept from the client (D had finished)."""
        return b"data: [DONE]\n\n"


def no_assistant_message(messages: Any) -> bool:
    """No message of role `assistant` (chat, Anthropic Messages): scanned from the end, where a follow-up's
    last reply is, so a long history costs a step or two."""
    if not isinstance(messages, list):
        return False
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "assistant":
            return False
    return True


def fingerprint_text(model: str, prompt: str, tools: list[str]) -> str:
    """Model, system prompt and tool names as one text (the strings length-prefixed): what tells a session's
    side requests from its main chain. Made for every request, session id or not: no JSON encoding of a long
    system prompt (canonical_json of a 3 kB prompt cost more than the rest of the format's work)."""
    return f"{len(model)}:{model}{len(prompt)}:{prompt}{len(tools)}:" + "\x00".join(tools)


def canonical_json(value: Any) -> str:
    """One text for equal JSON values (tool arguments a client re-serialised, blocks with keys reordered);
    a string that holds JSON counts as that JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
