"""OpenAI Chat Completions (`/v1/chat/completions`): the format the router started with."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pdserve.router.api.base import Collector, HistoryItem, WireFormat, no_assistant_message
from pdserve.router.api.inputs import BadInput, check_common, objects

TOKENIZE_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "tools", "mm_processor_kwargs")
TOKEN_FIELDS = ("prompt_token_ids", "token_ids")
# vLLM's stream chunk with return_token_ids (pydantic's compact JSON, fields in the model's order, token_ids the
# choice's last): choice 0 alone, its token ids the line's only router-only field. Cut as bytes, not parsed and
# re-encoded (one chunk a token, and every tracked turn asks for them).
ONE_CHOICE = b'"choices":[{"index":0,'
CHOICE_TOKEN_IDS = re.compile(rb',"token_ids":\[([0-9,]*)\]\}\]')
# A block's lines at a time: a data line ending with choice 0's token ids (the chunk's last field), ...
TOKEN_LINE = re.compile(rb'\ndata: \{[^\n]*,"token_ids":\[([0-9,]*)\]\}\]\}(?=\n)')
# ... the one choice 0 before them in the same line, and the ids as cut.
CHOICE_TO_IDS = re.compile(rb'"choices":\[\{"index":0,[^\n]*,"token_ids":\[[0-9,]*\]\}\]\}(?=\n)')
TOKEN_TAIL = re.compile(rb',"token_ids":\[[0-9,]*\]\}\]\}(?=\n)')
PARSED = re.compile(rb"kv_transfer_params|prompt_token_ids")


def _plain(text: bytes) -> bool:
    """Compact ASCII JSON lines (pydantic's) with no float (no logprobs) and no CR: re-encoding them after a
    parse gives back their bytes, less what was taken out."""
    return text.isascii() and b'": ' not in text and b', "' not in text and b'"logprobs":{' not in text \
        and b"\r" not in text


class ChoicesCollector(Collector):
    """Answers with `choices` (chat and completions): choice 0 only, since one conversation has one
    continuation; the token ids vLLM returns (return_token_ids) removed unless the client asked for them."""

    def __init__(self, keep_for_client: bool):
        super().__init__(keep_for_client)
        self._text: list[str] = []
        self._calls: dict[int, list[str]] = {}    # tool call index -> [name, arguments]

    def reset_reply(self) -> None:
        self._text, self._calls = [], {}

    def reply_items(self) -> list[HistoryItem]:
        calls = [{"type": "function", "function": {"name": n, "arguments": a}}
                 for _, (n, a) in sorted(self._calls.items())]
        return [{"role": "assistant", "content": "".join(self._text), "tool_calls": calls}]

    @property
    def reply(self) -> HistoryItem:
        return self.reply_items()[0]

    def _collect_choice(self, choice: dict[str, Any]) -> None:
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
        elif isinstance(choice.get("text"), str):     # completions
            self._text.append(choice["text"])
            return
        else:
            return
        for index, call in parts:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                slot = self._calls.setdefault(index, ["", ""])
                slot[0] += fn.get("name") or ""
                slot[1] += fn.get("arguments") or ""

    def collect_event(self, event: dict[str, Any]) -> None:
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._collect_choice(choice)

    def collect_events(self, events: list[dict[str, Any]]) -> None:
        # A stream's common chunk (choice 0 alone, a delta of text only) taken here; any other as collect_event.
        text = self._text
        for event in events:
            choices = event.get("choices")
            if type(choices) is list and len(choices) == 1:
                choice = choices[0]
                if type(choice) is dict and "message" not in choice and choice.get("index", 0) == 0:
                    delta = choice.get("delta")
                    if type(delta) is dict and "tool_calls" not in delta:
                        content = delta.get("content")
                        if content is None or type(content) is str:
                            text.append(content or "")
                            continue
            self.collect_event(event)

    def scrub_sse_line(self, line: bytes, collect_reply: bool = True) -> bytes:
        if not collect_reply and _plain(line):
            cut = self._cut(line)
            if cut is not None:
                return cut
        return super().scrub_sse_line(line, collect_reply)

    def scrub_block(self, block: bytes, marked: Callable[[bytes], Any]) -> bytes:
        if not _plain(block):
            return super().scrub_block(block, marked)
        out, pos = [], 0
        found = PARSED.search(block)
        while found is not None:   # a line with D's handles or the prompt's ids is parsed; the lines between,
            at = found.start()     # a run at a time
            start = block.rfind(b"\n", pos, at) + 1 or pos
            end = block.find(b"\n", at) + 1 or len(block)
            out += (self._cut_run(block[pos:start], marked), super().scrub_sse_line(block[start:end], False))
            pos = end
            found = PARSED.search(block, pos)
        out.append(self._cut_run(block[pos:], marked))
        return b"".join(out)

    def _cut_run(self, run: bytes, marked: Callable[[bytes], Any]) -> bytes:
        """Whole plain lines without D's handles: when every mention of token ids and of an index is in a
        line that `_cut` would cut (counted: each TOKEN_LINE holds one CHOICE_TO_IDS, and there are as many
        of each as mentions), all are cut at once; else line by line."""
        n = run.count(b"token_ids")
        if not n:
            return run
        ids = TOKEN_LINE.findall(b"\n" + run)
        if len(ids) == n == run.count(b'"index":') == run.count(ONE_CHOICE) == len(CHOICE_TO_IDS.findall(run)):
            joined = b",".join(filter(None, ids))
            if joined:
                self.generated.extend(map(int, joined.split(b",")))
            return run if self.keep else TOKEN_TAIL.sub(b"}]}", run)
        parse, cut_ids, out = super().scrub_sse_line, self._cut, []
        for line in run.splitlines(keepends=True):
            cut = cut_ids(line) if b"token_ids" in line else None
            out.append(cut if cut is not None else parse(line, False) if marked(line) else line)
        return b"".join(out)

    def _cut(self, line: bytes) -> bytes | None:
        """vLLM's common chunk without its token ids, without a parse (None: not such a line; it is parsed).
        The bytes are those that parsing and re-encoding make: the line is compact ASCII JSON with no float
        (no logprobs: `_plain`). `"index":` and `,"` occur only as JSON's own (a quote in a string is escaped):
        one `"index":` is one choice and no tool call, and the token ids that close the only choice are
        choice 0's."""
        if line.count(b"token_ids") != 1 or line.count(b'"index":') != 1 or ONE_CHOICE not in line \
                or b"kv_transfer_params" in line or not line.startswith(b"data: {") or not line.endswith(b"}\n"):
            return None
        found = CHOICE_TOKEN_IDS.search(line)
        if found is None:
            return None
        if found.group(1):
            self.generated.extend(map(int, found.group(1).split(b",")))
        return line if self.keep else line[:found.start()] + line[found.end() - 2:]

    def scrub(self, obj: dict[str, Any], collect_reply: bool = True) -> bool:
        changed = self.take_params(obj)
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
                self._collect_choice(choice)
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


class ChatFormat(WireFormat):
    api = "chat"
    routes = ("/v1/chat/completions",)
    collector_class = ChoicesCollector
    native_token_ids = True
    forwards_prompt_ids = True
    output_fields = ("max_tokens", "max_completion_tokens")

    def validate(self, body: dict[str, Any]) -> None:
        for i, m in enumerate(objects(body, "messages")):
            if not isinstance(m.get("role", ""), str):
                raise BadInput(400, f"messages[{i}].role must be a string", "messages")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise BadInput(400, f"messages[{i}].content must be a string or a list of parts", "messages")
            calls = m.get("tool_calls")
            if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                raise BadInput(400, f"messages[{i}].tool_calls must be a list of objects", "messages")
        check_common(body, ("max_tokens", "max_completion_tokens", "n", "min_tokens"))

    def history(self, body: dict[str, Any]) -> list[HistoryItem] | None:
        messages = body.get("messages")
        return messages if isinstance(messages, list) else None

    def first_turn(self, body: dict[str, Any]) -> bool:
        return no_assistant_message(body.get("messages"))

    def prefill_body(self, body: dict[str, Any], params: dict[str, Any] | None, request_id: str) -> dict[str, Any]:
        out = super().prefill_body(body, params, request_id)
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        return out

    def tokenize_body(self, body: dict[str, Any], model: str) -> dict[str, Any] | None:
        return {"model": model, **{k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body}}
