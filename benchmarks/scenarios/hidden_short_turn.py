#!/usr/bin/env python3
"""Issue 35 item 6: can a short follow-up carry new text the unchecked short-turn bound does not see? The real
router (decode_only on, as shipped) against fake P and D: turn 1 is a 400-word prompt (P then D), turn 2 a
short follow-up matched by its history, sent with hidden new text in one of these places:

- none: the plain short turn (the unchecked path: D alone, no /tokenize on P);
- fabricated: --hidden words as a user message before a made-up assistant message, then "yes";
- tools, documents, chat_template_kwargs: the words in that field (the fake's /tokenize, unlike vLLM's, does
  not render these, so the checked path's count is short there: what matters is that P was asked).

Printed per place: the plan the router chose (X-PDServe-Plan) and whether P tokenized the turn first.

Usage: flock /tmp/vllm.lock .venv/bin/python benchmarks/scenarios/hidden_short_turn.py [--hidden 20000]
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp

from hostile_kit import fake, router, scrape, total

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}]
PLACES = ("none", "fabricated", "tools", "documents", "chat_template_kwargs")


async def place(url: str, p_url: str, where: str, hidden: str) -> tuple[str, int]:
    async with aiohttp.ClientSession() as session:
        async def send(messages: list, **fields) -> tuple[str, list]:
            body = {"model": "fake", "messages": messages, "max_tokens": 4, "tools": TOOLS, **fields}
            async with session.post(url + CHAT, json=body) as resp:
                assert resp.status == 200, await resp.text()
                reply = (await resp.json())["choices"][0]["message"]
                return resp.headers["X-PDServe-Plan"], messages + [reply]

        _, history = await send([{"role": "user", "content": f"{where} " + "alpha " * 400}])
        before = total(scrape(p_url), "fake_tokenize_requests_total")
        fields: dict = {}
        messages = history + [{"role": "user", "content": "yes"}]
        if where == "fabricated":
            messages = history + [{"role": "user", "content": hidden}, {"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "yes"}]
        elif where == "tools":
            fields["tools"] = TOOLS + [{"type": "function", "function": {"name": "x", "description": hidden}}]
        elif where == "documents":
            fields["documents"] = [{"title": "x", "text": hidden}]
        elif where == "chat_template_kwargs":
            fields["chat_template_kwargs"] = {"extra": hidden}
        plan, _ = await send(messages, **fields)
        return plan, int(total(scrape(p_url), "fake_tokenize_requests_total") - before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=20_000, help="hidden words (one fake token each)")
    args = ap.parse_args()
    hidden = "hidden " * args.hidden
    with fake() as p, fake() as d, router([p], [d], decode_only=True) as (_, url):
        for where in PLACES:
            plan, tokenized = asyncio.run(place(url, p, where, hidden))
            print(f"{where}: plan {plan}, P tokenized it first: {'yes' if tokenized else 'no'}")


if __name__ == "__main__":
    main()
