"""Does every follow-up turn of a real client reuse D's KV? Run against any running pdserve cluster.

N conversations of T turns from an official SDK (streamed by default), C conversations at a time, no
conversation id: the router has to recognise each history, as it must for an unmodified client (with
--rewrite-replies, one that sends each reply back reformatted). `--api`
picks the wire format: chat (`openai`, /v1/chat/completions), messages (`anthropic`, /v1/messages, the
reply sent back as the assistant message's content blocks) or responses (`openai`, /v1/responses with
store=False, the reply's output items sent back in `input`).
Per turn it prints the prompt tokens, the tokens P pulled from D (the router's X-PDServe-Pulled-Tokens),
the reusable tokens (the previous turn's prompt, which D holds), the time to the first text delta (streamed),
and at the end the share of follow-up turns that pulled at least 90% of them. With --prefill-url, the pulled
tokens are checked against P's own `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`.

    python scripts/reuse_check.py --url http://127.0.0.1:8000/v1 --api messages --conversations 20 --turns 5 \
        --concurrency 2 --prefill-url http://127.0.0.1:8100

Exit status 0 when every follow-up turn reused (>= --min-share of its reusable tokens), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request
from typing import Any, NamedTuple

PULLED_HEADER = "X-PDServe-Pulled-Tokens"
APIS = ("chat", "messages", "responses")
EXTERNAL = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$',
                      re.M)
WORDS = ("build", "test", "file", "error", "line", "patch", "config", "deploy", "cache", "token", "router",
         "decode", "prefill", "trace", "retry", "value", "status", "table", "merge", "review")
SYSTEM = "You are a coding agent. " * 8


class Turn(NamedTuple):
    reply: list[dict]          # what the client sends back next turn (chat: one message; others: blocks or items)
    prompt: int | None         # prompt tokens from usage (input_tokens for messages and responses)
    pulled: int | None         # the router's X-PDServe-Pulled-Tokens
    first_ms: float | None     # time to the first text delta (streamed turns only)


def user_turn(rng: random.Random, conversation: int, turn: int, words: int) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return {"role": "user", "content": f"[conversation {conversation}, turn {turn}] {text}"}


def anthropic_base(url: str) -> str:
    """The Anthropic SDK's base URL (it adds /v1/messages) from the OpenAI one (…/v1)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def external_tokens(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        text = urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10).read().decode()
        total += sum(float(v) for v in EXTERNAL.findall(text))
    return total


def _pulled(headers) -> int | None:
    value = headers.get(PULLED_HEADER)
    return int(value) if value is not None else None


def _since(started: float) -> float:
    return round(1000 * (time.perf_counter() - started), 1)


async def chat_turn(client, model: str, history: list, args) -> Turn:
    messages = [{"role": "system", "content": SYSTEM}, *history]
    started = time.perf_counter()
    if not args.stream:
        raw = await client.chat.completions.with_raw_response.create(model=model, messages=messages,
                                                                     max_tokens=args.max_tokens)
        resp = raw.parse()
        return Turn([{"role": "assistant", "content": resp.choices[0].message.content or ""}],
                    resp.usage.prompt_tokens if resp.usage else None, _pulled(raw.headers), None)
    raw = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=args.max_tokens, stream=True,
        stream_options={"include_usage": True})
    parts, prompt, first = [], None, None
    async for chunk in raw.parse():       # the client closes the connection right after [DONE]
        for choice in chunk.choices:
            if choice.delta.content and first is None:
                first = _since(started)
            parts.append(choice.delta.content or "")
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
    return Turn([{"role": "assistant", "content": "".join(parts)}], prompt, _pulled(raw.headers), first)


def _blocks(content) -> list[dict]:
    return [{"type": "text", "text": b.text} if b.type == "text" else b.model_dump(exclude_none=True)
            for b in content]


async def messages_turn(client, model: str, history: list, args) -> Turn:
    kwargs = dict(model=model, system=SYSTEM, messages=history, max_tokens=args.max_tokens)
    started = time.perf_counter()
    if not args.stream:
        raw = await client.messages.with_raw_response.create(**kwargs)
        msg = await raw.parse()
        return Turn([{"role": "assistant", "content": _blocks(msg.content)}], msg.usage.input_tokens,
                    _pulled(raw.headers), None)
    first = None
    async with client.messages.stream(**kwargs) as stream:
        async for event in stream:
            if event.type == "content_block_delta" and first is None:
                first = _since(started)
        msg = await stream.get_final_message()    # usage: input_tokens as message_delta reports them
        pulled = _pulled(stream.response.headers)
    return Turn([{"role": "assistant", "content": _blocks(msg.content)}], msg.usage.input_tokens, pulled, first)


async def responses_turn(client, model: str, history: list, args) -> Turn:
    kwargs = dict(model=model, instructions=SYSTEM, input=history, max_output_tokens=args.max_tokens, store=False)
    started = time.perf_counter()
    raw = await client.responses.with_raw_response.create(**kwargs, stream=args.stream)
    first, resp = None, None
    if not args.stream:
        resp = raw.parse()
    else:
        async for event in raw.parse():
            if event.type == "response.output_text.delta" and first is None:
                first = _since(started)
            elif event.type == "response.completed":
                resp = event.response
    if resp is None:
        raise RuntimeError("the stream ended without response.completed")
    items = [item.model_dump(exclude_none=True) for item in resp.output]
    return Turn(items, resp.usage.input_tokens if resp.usage else None, _pulled(raw.headers), first)


TURNS = {"chat": chat_turn, "messages": messages_turn, "responses": responses_turn}


def make_client(args) -> Any:
    key = os.environ.get(args.api_key_env, "unused") if args.api_key_env else "unused"
    if args.api == "messages":
        from anthropic import AsyncAnthropic
        return AsyncAnthropic(base_url=anthropic_base(args.url), api_key=key, max_retries=0, timeout=600)
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=args.url, api_key=key, max_retries=0, timeout=600)


async def first_model(args) -> str:
    from openai import AsyncOpenAI
    key = os.environ.get(args.api_key_env, "unused") if args.api_key_env else "unused"
    async with AsyncOpenAI(base_url=args.url, api_key=key, max_retries=0, timeout=60) as client:
        return (await client.models.list()).data[0].id


async def conversation(client, model: str, index: int, args, rows: list[dict], gate: asyncio.Semaphore) -> None:
    rng = random.Random(args.seed * 1000 + index)
    async with gate:
        history: list = []
        previous_prompt = None
        for turn in range(1, args.turns + 1):
            history.append(user_turn(rng, index, turn, args.words))
            started = time.perf_counter()
            t = await TURNS[args.api](client, model, history, args)
            row = {"conversation": index, "turn": turn, "prompt_tokens": t.prompt, "pulled": t.pulled,
                   "reusable": previous_prompt, "first_text_ms": t.first_ms, "ms": _since(started)}
            rows.append(row)
            first = f", first text {t.first_ms:.0f} ms" if t.first_ms is not None else ""
            print(f"conversation {index:3d} turn {turn}: prompt {t.prompt} pulled {t.pulled} reusable "
                  f"{previous_prompt} ({row['ms']:.0f} ms{first})", file=sys.stderr, flush=True)
            history.extend(rewritten(t.reply) if args.rewrite_replies else t.reply)
            previous_prompt = t.prompt


def _edit(text: str) -> str:
    return " ".join(text.split()) + " (edited)"


def rewritten(reply: list[dict]) -> list[dict]:
    """The reply as an agent that reformats what it keeps sends it back: whitespace collapsed, a note added
    to every text (chat content, Anthropic text blocks, Responses output_text parts)."""
    out = []
    for item in reply:
        item = dict(item)
        content = item.get("content")
        if isinstance(content, str):
            item["content"] = _edit(content)
        elif isinstance(content, list):
            item["content"] = [{**part, "text": _edit(part["text"])} if part.get("type") in ("text", "output_text")
                               else part for part in content]
        out.append(item)
    return out


def reused(row: dict, min_share: float) -> bool:
    return bool(row["reusable"]) and row["pulled"] is not None and row["pulled"] >= min_share * row["reusable"]


async def main_async(args) -> int:
    client = make_client(args)
    model = args.model or await first_model(args)
    before = external_tokens(args.prefill_url) if args.prefill_url else None
    rows: list[dict] = []
    gate = asyncio.Semaphore(args.concurrency)
    started = time.perf_counter()
    await asyncio.gather(*(conversation(client, model, i, args, rows, gate) for i in range(args.conversations)))
    follow = [r for r in rows if r["turn"] > 1]
    good = [r for r in follow if reused(r, args.min_share)]
    summary = {"url": args.url, "api": args.api, "model": model, "stream": args.stream,
               "conversations": args.conversations, "turns": args.turns, "concurrency": args.concurrency,
               "follow_up_turns": len(follow), "reused_turns": len(good),
               "reused_share": len(good) / len(follow) if follow else None,
               "pulled_tokens": sum(r["pulled"] or 0 for r in rows),
               "reusable_tokens": sum(r["reusable"] or 0 for r in follow),
               "seconds": round(time.perf_counter() - started, 1)}
    if before is not None:
        summary["prefill_external_kv_tokens"] = external_tokens(args.prefill_url) - before
    if args.json:
        print(json.dumps({"summary": summary, "turns": sorted(rows, key=lambda r: (r["conversation"], r["turn"]))}))
    else:
        share = summary["reused_share"]
        label = ("" if args.api == "chat" else f"{args.api}, ") + ("streamed" if args.stream else "non-streamed")
        print(f"{label}: {len(good)} of {len(follow)} "
              f"follow-up turns pulled >= {100 * args.min_share:.0f}% of their reusable tokens "
              f"({100 * share if share is not None else 0:.1f}%); pulled {summary['pulled_tokens']} of "
              f"{summary['reusable_tokens']} reusable tokens in {summary['seconds']} s")
        if before is not None:
            print(f"P's own counter (external_kv_transfer) rose by {summary['prefill_external_kv_tokens']:.0f}")
    missed = [r for r in follow if not reused(r, args.min_share)]
    for r in missed:
        print(f"missed: conversation {r['conversation']} turn {r['turn']}: pulled {r['pulled']} of "
              f"{r['reusable']}", file=sys.stderr)
    return 0 if follow and not missed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1",
                   help="the router's OpenAI base URL (the Anthropic one is this without /v1)")
    p.add_argument("--api", choices=APIS, default="chat", help="wire format and SDK (default: chat)")
    p.add_argument("--model", help="model name (default: the router's first)")
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streamed turns")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--words", type=int, default=120, help="words in each new user message")
    p.add_argument("--min-share", type=float, default=0.9, help="share of the reusable tokens a turn must pull")
    p.add_argument("--prefill-url", action="append", default=[], help="a prefill server, to read its /metrics")
    p.add_argument("--api-key-env", help="env var holding the router's API key")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rewrite-replies", action="store_true",
                   help="send each reply back rewritten (whitespace collapsed, a note added): the router finds "
                        "the turn by its prompt, and the reusable tokens are the previous prompt's")
    p.add_argument("--json", action="store_true", help="per-turn rows and the summary as JSON on stdout")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
