"""Off/on TTFT per wire format on a running pdserve 1P1D cluster (issue 31): the same two-turn agent step as
chat, Anthropic Messages and OpenAI Responses, each named by the session id its agent sends (chat: body
conversation_id; messages: Claude Code's X-Claude-Code-Session-Id; responses: Codex's session-id header).

  python3 measure_apis.py ROUTER P_URL OUT.json [LENGTHS] [APIS]

"on": turn 2, streamed, whose turn 1 left its KV on D; "off": the very same request under a new session id.
TTFT: time to the first content event at the client (chat delta content, content_block_delta,
response.output_text.delta). Prints one JSON line per point, then each API's on/off ratio against chat's.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request

from measure import NEW_TOKENS, filler, metrics

FIRST = {"chat": b'"content"', "messages": b"content_block_delta", "responses": b"response.output_text.delta"}
ROUTE = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def request(api: str, history: list[dict], conv: str, stream: bool, max_tokens: int) -> tuple[dict, dict]:
    """(body, headers) of one turn in `api`'s shape; `history` holds chat messages."""
    if api == "chat":
        return {"model": "m", "messages": history, "max_tokens": max_tokens, "stream": stream,
                "conversation_id": conv}, {}
    if api == "messages":
        return {"model": "m", "messages": history, "max_tokens": max_tokens, "stream": stream}, \
            {"X-Claude-Code-Session-Id": conv}
    items = [{"type": "message", "role": m["role"], "content": [
        {"type": "input_text" if m["role"] == "user" else "output_text", "text": m["content"]}]} for m in history]
    return {"model": "m", "input": items, "max_output_tokens": max_tokens, "stream": stream, "store": False}, \
        {"session-id": conv}


def send(router: str, api: str, history: list[dict], conv: str, stream: bool, max_tokens: int) -> tuple[float, str]:
    body, headers = request(api, history, conv, stream, max_tokens)
    req = urllib.request.Request(router + ROUTE[api], data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        if not stream:
            return time.perf_counter() - t0, resp.read().decode()
        first, text = None, []
        for line in resp:
            if first is None and FIRST[api] in line:
                first = time.perf_counter() - t0
            text.append(line.decode())
        return first or time.perf_counter() - t0, "".join(text)


def reply(api: str, raw: str) -> str:
    data = json.loads(raw)
    if api == "chat":
        return data["choices"][0]["message"]["content"] or ""
    if api == "messages":
        return "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
    return "".join(p.get("text", "") for item in data["output"] if item.get("type") == "message"
                   for p in item.get("content", []))


def point(router: str, p_url: str, api: str, length: int, tag: str) -> dict:
    conv = f"{tag}-{api}-{length}"
    history = [{"role": "user", "content": filler(p_url, length - NEW_TOKENS, length)}]
    _, raw = send(router, api, history, conv, False, 8)
    history += [{"role": "assistant", "content": reply(api, raw) or "ok"},
                {"role": "user", "content": filler(p_url, NEW_TOKENS, length + 1)}]
    m0 = metrics(p_url)
    on, _ = send(router, api, history, conv, True, 4)
    m1 = metrics(p_url)
    off, _ = send(router, api, history, conv + "-off", True, 4)
    m2 = metrics(p_url)
    return {"api": api, "length": length, "on_ms": round(1000 * on, 1), "off_ms": round(1000 * off, 1),
            "ratio": round(off / on, 2), "pulled": m1["pulled"] - m0["pulled"], "off_pulled": m2["pulled"] - m1["pulled"]}


def main() -> None:
    router, p_url, out = sys.argv[1:4]
    lengths = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "32768").split(",")]
    apis = (sys.argv[5] if len(sys.argv) > 5 else "chat,messages,responses").split(",")
    for api in apis:                 # compile/warm shapes and each endpoint's first use outside the figures
        for warm in (2048, 8192):
            point(router, p_url, api, warm, "warm")
    rows = []
    for length in lengths:
        for rep in range(2):
            for api in apis:
                row = point(router, p_url, api, length, f"m{rep}")
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary = {}
    for length in lengths:
        mean = {api: sum(r["ratio"] for r in rows if r["api"] == api and r["length"] == length) / 2 for api in apis}
        summary[length] = {api: {"ratio": round(mean[api], 2),
                                 "of_chat": round(mean[api] / mean["chat"], 2) if "chat" in mean else None}
                           for api in apis}
    print(json.dumps({"summary": summary}), flush=True)
    json.dump({"rows": rows, "summary": summary}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
