"""Run a multi-turn workload through a deployment's router and measure every request.

Each turn's chat history is sent as one wire format (`Endpoints.api`): chat completions, Anthropic Messages
(system prompt as `system`, the replies as text blocks) or OpenAI Responses (`instructions`, message items,
`store` off). Requests are non-streaming unless `Endpoints.stream`: the router reports each request's P-leg
and D-leg durations in a `Server-Timing` header, and time to first token is then estimated as the client's
latency minus the D leg's share of the tokens after the first one; a streamed turn's TTFT is its first
content event. A request that fails or times out (`request_timeout`) becomes a row with its `error`, and
its conversation goes on with no reply in the history, as a client that gives up on a turn does. With one
conversation at a time (`concurrency` 1, the default)
each request's own P-side metric deltas are exact: tokens computed vs pulled from D, and KV transfer time
and bytes. With more, the deltas of overlapping requests mix, so they are reported per arm only.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.metrics import prefill_deltas
from pdserve.bench.workload import Conversation
from pdserve.observe.promtext import Samples, auth_headers, parse
from pdserve.router.wire import PLAN_HEADER, PULLED_HEADER, REUSE_HEADER, TIER_HEADER

TIMING_RE = re.compile(r"(\w+);dur=([0-9.]+)")
REQUEST_TIMEOUT_S = 60.0     # `--request-timeout`: a turn stalled on D fails instead of hanging the bench
NO_REPLY = "(no answer)"     # a failed turn's place in its conversation's history


@dataclass
class Endpoints:
    router: str
    prefill: list[str]
    model: str
    api_key: str | None = None
    decode: list[str] = field(default_factory=list)
    # Stream, and time the first chunk of the answer: a router that reports no Server-Timing (vllm-router), or
    # `--stream` (a turn served on D alone has no P leg: its first token is inside the D leg).
    stream: bool = False
    api: str = "chat"                 # the wire format each turn is sent as (API_PATHS)


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode(errors="replace")


def summed_metrics(urls: list[str]) -> Samples:
    """All prefill servers' metrics, summed sample by sample."""
    out: Samples = {}
    for url in urls:
        for key, value in parse(_get(url + "/metrics")).items():
            out[key] = out.get(key, 0.0) + value
    return out


def verbatim_token_ids(ep: Endpoints, words: tuple[str, ...] | list[str]) -> list[int]:
    """Token ids that are one whole word each (" the"), by P's own tokenizer. A reply sampled only from
    these re-tokenizes to itself when sent back (the pre-tokenizer splits at each leading space), so D's
    KV of the reply stays valid for the next prompt, as a real model's replies do."""
    headers = {"Content-Type": "application/json", **auth_headers(ep.api_key)}
    ids: list[int] = []
    for word in words:
        body = json.dumps({"model": ep.model, "prompt": " " + word, "add_special_tokens": False}).encode()
        req = urllib.request.Request(ep.prefill[0] + "/tokenize", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            tokens = json.loads(resp.read()).get("tokens") or []
        if len(tokens) == 1 and tokens[0] not in ids:
            ids.append(tokens[0])
    return ids


# The wire formats a workload can be sent as (`--api`), and each one's path on the router.
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
# Stream events that carry the answer's content (vLLM emits them with the first text it decodes); the
# first one times TTFT. Chat: any chunk with choices (vLLM's first, the role, comes with the first token).
CONTENT_EVENTS = {"messages": ("content_block_start", "content_block_delta"),
                  "responses": ("response.output_item.added", "response.content_part.added",
                                "response.output_text.delta")}


def request_body(api: str, model: str, messages: list[dict[str, Any]], max_tokens: int, stream: bool,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A turn's chat history as the API's request body. Messages: system messages -> `system`, an assistant's
    text -> one text block (as the SDK sends a reply back). Responses: system -> `instructions`, the others as
    message items, `store` off (the router refuses stored ones); an assistant message is the answer's own
    output items when it has them (`items`, as a client appends them: none for an answer without output),
    else its text as one output_text part."""
    if api == "chat":
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return {**body, **(extra or {})}
    system = "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    rest = [m for m in messages if m.get("role") != "system"]
    if api == "messages":
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]
                              if m["role"] == "assistant" and m.get("content") else m.get("content") or ""}
                             for m in rest]}
        if system:
            body["system"] = system
    elif api == "responses":
        body = {"model": model, "max_output_tokens": max_tokens, "temperature": 0, "store": False,
                "input": [item for m in rest for item in _items(m)]}
        if system:
            body["instructions"] = system
    else:
        raise ValueError(f"unknown api {api!r} (known: {', '.join(API_PATHS)})")
    return {**body, "stream": True, **(extra or {})} if stream else {**body, **(extra or {})}


def _items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One chat message as Responses input items."""
    if message["role"] != "assistant":
        return [{"type": "message", "role": message["role"], "content": message.get("content") or ""}]
    if isinstance(message.get("items"), list):      # as the SDK's model_dump(exclude_none=True) sends them back
        return [_no_nulls(item) for item in message["items"]]
    return [{"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": message.get("content") or ""}]}]


def _no_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    return [_no_nulls(v) for v in value] if isinstance(value, list) else value


def _usage(api: str, usage: Any) -> tuple[int, int] | None:
    """(prompt tokens, completion tokens) of a usage object; Anthropic's input_tokens leave out cached ones."""
    if not isinstance(usage, dict):
        return None
    if api == "chat":
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0)
    if api == "messages":
        prompt += int(usage.get("cache_read_input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0)
    return prompt, int(usage.get("output_tokens") or 0)


def read_answer(api: str, data: dict[str, Any]) -> tuple[str, int, int]:
    """(reply text, prompt tokens, completion tokens) of a whole (non-streamed) answer."""
    if api == "chat":
        text = data["choices"][0]["message"].get("content") or ""
    elif api == "messages":
        text = "".join(b.get("text") or "" for b in data.get("content") or [] if b.get("type") == "text")
    else:
        text = "".join(part.get("text") or "" for item in data.get("output") or [] if item.get("type") == "message"
                       for part in item.get("content") or [] if part.get("type") == "output_text")
    prompt, completion = _usage(api, data.get("usage")) or (0, 0)
    return text, prompt, completion


@dataclass
class StreamReader:
    """One streamed answer, event by event: its text, usage and whether an event carried content."""
    api: str
    parts: list[str] = field(default_factory=list)
    output: list[dict[str, Any]] | None = None     # Responses: the completed response's output items
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def feed(self, event: dict[str, Any]) -> bool:
        """Take one `data:` event; True when it is a content event (the first one times TTFT)."""
        kind = event.get("type")
        if self.api == "chat":
            for choice in event.get("choices") or []:
                self.parts.append((choice.get("delta") or {}).get("content") or "")
            self._take(event.get("usage"))
            return bool(event.get("choices"))
        if self.api == "messages":
            delta = event.get("delta") or {}
            if kind == "content_block_delta" and delta.get("type") == "text_delta":
                self.parts.append(delta.get("text") or "")
            # message_start's usage may have no prompt count yet; message_delta's (at the end) has it
            self._take((event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage"))
        elif self.api == "responses":
            if kind == "response.output_text.delta":
                self.parts.append(event.get("delta") or "")
            elif kind == "response.completed":
                self._take((event.get("response") or {}).get("usage"))
                self.output = (event.get("response") or {}).get("output")
        return kind in CONTENT_EVENTS.get(self.api, ())

    def _take(self, usage: Any) -> None:
        counts = _usage(self.api, usage)
        if counts:
            self.prompt_tokens = counts[0] or self.prompt_tokens
            self.completion_tokens = counts[1] or self.completion_tokens

    @property
    def reply(self) -> str:
        return "".join(self.parts)


def _pulled(headers: Any, name: str = PULLED_HEADER) -> int | None:
    """The tokens P read from D on this turn (or, `name` TIER_HEADER, loaded from its CPU tier), as pdserve's
    router reports them (None: no such header)."""
    value = headers.get(name)
    return int(value) if value and value.isdigit() else None


def _router_facts(headers: Any) -> dict[str, Any]:
    """What pdserve's router says of a turn in its answer's headers (docs/router.md, "Metrics"): the decision's,
    the P leg's and, on a whole answer, the D leg's times (Server-Timing, in seconds; None where not reported),
    the plan, the reuse outcome, the tokens P pulled from D and loaded from its CPU tier. Another router sends
    none: empty and None."""
    timing = dict((k, float(v) / 1000) for k, v in TIMING_RE.findall(headers.get("Server-Timing", "")))
    return {"prefill_s": timing.get("prefill"), "decode_s": timing.get("decode"), "decide_s": timing.get("decide"),
            "reuse": headers.get(REUSE_HEADER, ""), "plan": headers.get(PLAN_HEADER, ""),
            "pulled": _pulled(headers), "tier_tokens": _pulled(headers, TIER_HEADER)}


def chat(ep: Endpoints, messages: list[dict[str, Any]], max_tokens: int, timeout: float = 600.0,
         extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One turn (a chat history), sent as `ep.api`'s request (with `headers`: an agent's session headers).
    `timeout` bounds the connection and every read; a streamed answer also fails once `timeout` has passed
    since the request was sent."""
    headers = {"Content-Type": "application/json", **auth_headers(ep.api_key), **(headers or {})}
    payload = request_body(ep.api, ep.model, messages, max_tokens, ep.stream, extra)
    req = urllib.request.Request(ep.router + API_PATHS[ep.api], data=json.dumps(payload).encode(), headers=headers)
    if ep.stream:
        return _streamed(ep.api, req, timeout)
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
        facts = _router_facts(resp.headers)
    latency = time.perf_counter() - started
    reply, prompt, completion = read_answer(ep.api, data)
    decode_s = facts["decode_s"]
    # The D leg reads P's KV, produces the first token, then the rest: the first token arrived about
    # (completion - 1) / completion of the D leg before the response ended.
    ttft = latency - decode_s * (completion - 1) / completion if decode_s and completion else latency
    return {"reply": reply, "latency_s": latency, "ttft_s": ttft, **facts,
            "prompt_tokens": prompt, "completion_tokens": completion,
            **({"items": data.get("output")} if ep.api == "responses" else {})}


def _streamed(api: str, req: urllib.request.Request, timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    ttft, reader = None, StreamReader(api)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        facts = _router_facts(resp.headers)
        for raw in resp:
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"no whole answer within {timeout:g} s")
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue            # named events' `event:` lines: their data line says the type again
            # The first content event: a random-weight model's first tokens are often partial UTF-8, which
            # vLLM holds back, so text may come tokens later; chat's role chunk comes with the first token.
            if reader.feed(json.loads(line[5:])) and ttft is None:
                ttft = time.perf_counter() - started
    latency = time.perf_counter() - started
    return {"reply": reader.reply, "latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
            **facts, "decode_s": None,      # its first token is timed here, not derived from the D leg
            "prompt_tokens": reader.prompt_tokens,
            "completion_tokens": reader.completion_tokens,
            **({"items": reader.output} if api == "responses" else {})}


def failure(exc: BaseException) -> str:
    """What became of a request that got no whole answer, in a word or two (results' `error`)."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"http {exc.code}"
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timeout"
    if isinstance(reason, (ConnectionError, http.client.HTTPException)):
        return "connection"
    return type(reason).__name__


def run_arm(arm: str, ep: Endpoints, conversations: list[Conversation], max_tokens: int, concurrency: int = 1,
            on_request: Callable[[dict[str, Any]], None] = lambda row: None,
            extra: dict[str, Any] | None = None,
            pause: tuple[int, Callable[[], None]] | None = None,
            request_timeout: float = REQUEST_TIMEOUT_S, give_up_after: int = 0) -> tuple[list[dict], dict]:
    """Every conversation's turns in order (conversations in parallel up to `concurrency`); returns the
    per-request rows and the arm's P-side totals. A request with no whole answer within `request_timeout`
    (or an error answer) is a row with `error` and its seconds, and the conversation goes on without it;
    after `give_up_after` such turns (0: never) it ends there, as a user who gives up (its later turns are
    not sent: a stalled server costs the arm one timeout per conversation, not one per turn).

    `pause` (turn, action): once every conversation has run that many turns, run the action (a prefill
    restart) before the rest. Rows after it are marked `after_pause`; P's counters are read on both sides
    of it, because a restarted server's counters start again from zero."""
    exact = concurrency == 1
    lock = threading.Lock()
    rows: list[dict[str, Any]] = []
    state: dict[str, dict[str, Any]] = {c.id: {"history": [], "previous": None, "failed": 0} for c in conversations}

    def one(conv: Conversation, first: int, end: int, after_pause: bool) -> None:
        st = state[conv.id]
        for turn in range(first, min(end, len(conv.user_turns))):
            messages = conv.messages_for(st["history"], turn)
            before = summed_metrics(ep.prefill) if exact else None
            sent = time.perf_counter()
            try:
                result = chat(ep, messages, conv.max_tokens[turn] if turn < len(conv.max_tokens) else max_tokens,
                              timeout=request_timeout, extra=extra)
            except (OSError, http.client.HTTPException, ValueError) as exc:    # OSError: URLError, timeouts
                failed = {"arm": arm, "api": ep.api, "conversation": conv.id, "turn": turn + 1,
                          "error": failure(exc), "latency_s": time.perf_counter() - sent}
                if pause:
                    failed["after_pause"] = after_pause
                st["history"] = [*messages, {"role": "assistant", "content": NO_REPLY}]
                st["previous"] = None      # D holds nothing this client can continue
                with lock:
                    rows.append(failed)
                    on_request(failed)
                st["failed"] += 1
                if give_up_after and st["failed"] >= give_up_after:
                    return
                continue
            deltas = prefill_deltas(before, summed_metrics(ep.prefill)) if exact else {}
            reusable = 0
            if st["previous"] is not None:
                # What D holds of the previous turn: its prompt and reply, all but the last sampled token.
                # P may read all of it when the new prompt continues it exactly, whole blocks otherwise.
                reusable = st["previous"]["prompt_tokens"] + st["previous"]["completion_tokens"] - 1
            row = {"arm": arm, "api": ep.api, "conversation": conv.id, "turn": turn + 1,
                   **{k: v for k, v in result.items() if k not in ("reply", "items")},
                   **deltas, "reusable_tokens": reusable,
                   "new_tokens": result["prompt_tokens"] - reusable if reusable else result["prompt_tokens"]}
            if pause:
                row["after_pause"] = after_pause
            reply = {"role": "assistant", "content": result["reply"]}
            if result.get("items") is not None:     # Responses: the answer's own output items go back
                reply["items"] = result["items"]
            st["history"] = [*messages, reply]
            st["previous"] = result
            with lock:
                rows.append(row)
                on_request(row)

    longest = max(len(c.user_turns) for c in conversations)
    phases = [(0, pause[0], False), (pause[0], longest, True)] if pause else [(0, longest, False)]
    totals: dict[str, float] = {}
    for first, end, after_pause in phases:
        if after_pause:
            pause[1]()
        phase_before = summed_metrics(ep.prefill)
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for future in [pool.submit(one, c, first, end, after_pause) for c in conversations]:
                future.result()
        for key, value in prefill_deltas(phase_before, summed_metrics(ep.prefill)).items():
            totals[key] = totals.get(key, 0.0) + value
    return sorted(rows, key=lambda r: (r["conversation"], r["turn"])), totals
