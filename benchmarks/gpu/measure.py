"""Measure a running pdserve 1P1D cluster on the GPU node; prints one JSON line per point and writes OUT.json.

  python3 measure.py curve ROUTER P_URL OUT.json [LENGTHS]   off/on TTFT per context length, streamed and not
  python3 measure.py guard ROUTER P_URL OUT.json [LENGTH] [TURNS]   cost guard: TTFT per turn vs recompute
  python3 measure.py split ROUTER P_URL OUT.json [LENGTH] [REPS] D_URL   the streamed "on" turn in parts: the
      router's Server-Timing legs, and P's and D's own per-request metrics (queue, prefill, TTFT, NIXL)

"on" is turn 2 of a conversation whose turn 1 left its KV on D (P pulls it); "off" is the very same request
under a new conversation id (nothing to reuse; P's prefix cache is off, so P recomputes all of it). TTFT:
streamed, time to the first content chunk at the client; non-streamed, the whole answer with max_tokens 1.
P's own /metrics give the tokens pulled and NIXL's transfer time and bytes of each request.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request

NEW_TOKENS = 1000     # the new user message of turn 2


TIMINGS: dict[str, str] = {}   # the last answer's Server-Timing (router legs), by conversation


def post(url: str, body: dict, stream: bool) -> tuple[float, str]:
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": stream}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        TIMINGS[body.get("conversation_id", "")] = resp.headers.get("Server-Timing", "")
        if not stream:
            return time.perf_counter() - t0, resp.read().decode()
        first, text = None, []
        for line in resp:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - t0
            text.append(line.decode())
        return first or time.perf_counter() - t0, "".join(text)


def legs(conv: str) -> dict[str, float]:
    """{decide, prefill, decode: ms} from the router's Server-Timing of the conversation's last answer."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+);dur=([0-9.]+)", TIMINGS.get(conv, ""))}


def metrics(p_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(p_url + "/metrics", timeout=30).read().decode()
    def total(name: str, label: str = "") -> float:
        return sum(float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
                   if label in (m.group(1) or ""))
    return {"pulled": total("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"'),
            "computed": total("vllm:prompt_tokens_by_source_total", 'source="local_compute"'),
            "xfer_s": total("vllm:nixl_xfer_time_seconds_sum"), "xfer_n": total("vllm:nixl_xfer_time_seconds_count"),
            "post_s": total("vllm:nixl_post_time_seconds_sum"), "descs": total("vllm:nixl_num_descriptors_sum"),
            "bytes": total("vllm:nixl_bytes_transferred_sum"),
            "queue_s": total("vllm:request_queue_time_seconds_sum"),
            "prefill_s": total("vllm:request_prefill_time_seconds_sum"),
            "ttft_s": total("vllm:time_to_first_token_seconds_sum")}


def tokens(p_url: str, text: str) -> int:
    req = urllib.request.Request(p_url + "/tokenize", data=json.dumps({"prompt": text}).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["count"]


def filler(p_url: str, n_tokens: int, seed: int) -> str:
    unit = " ".join(f"row {seed}-{i}: value {i * 17 % 101} status ok;" for i in range(200))
    per = tokens(p_url, unit) / len(unit.split())
    words = unit.split()
    need = int(n_tokens / per)
    return " ".join((words * (need // len(words) + 1))[:need])


def chat(router: str, messages: list, conv: str, stream: bool, max_tokens: int) -> tuple[float, str]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "conversation_id": conv}
    return post(router + "/v1/chat/completions", body, stream)


def reply_of(raw: str, stream: bool) -> str:
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"] or ""
    out = []
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)


def measured(p_url: str, fn) -> tuple[float, dict[str, float]]:
    m0 = metrics(p_url)
    ttft, raw = fn()
    m1 = metrics(p_url)
    return ttft, {k: m1[k] - m0[k] for k in m0} | {"raw": raw}


def point(router: str, p_url: str, length: int, stream: bool, tag: str) -> dict:
    conv = f"{tag}-{length}-{int(stream)}"
    msgs = [{"role": "user", "content": filler(p_url, length - NEW_TOKENS, length)}]
    _, raw = chat(router, msgs, conv, False, 8)
    msgs += [{"role": "assistant", "content": reply_of(raw, False)},
             {"role": "user", "content": filler(p_url, NEW_TOKENS, length + 1)}]
    mt = 4 if stream else 1
    on, m_on = measured(p_url, lambda: chat(router, msgs, conv, stream, mt))
    off, m_off = measured(p_url, lambda: chat(router, msgs, conv + "-off", stream, mt))
    gbps = m_on["bytes"] / m_on["xfer_s"] / 1e9 if m_on["xfer_s"] > 0 else None
    return {"length": length, "stream": stream, "on_ms": round(1000 * on, 1), "off_ms": round(1000 * off, 1),
            "speedup": round(off / on, 2), "pulled": m_on["pulled"], "off_pulled": m_off["pulled"],
            "xfer_ms": round(1000 * m_on["xfer_s"], 1), "xfers": m_on["xfer_n"], "gb": round(m_on["bytes"] / 1e9, 3),
            "gbps": round(gbps, 1) if gbps else None, "on_legs": legs(conv), "off_legs": legs(conv + "-off")}


def curve(router: str, p_url: str, out: str, lengths: list[int]) -> None:
    for warm in (2048, 8192):       # compile/warm shapes and the NIXL handshake outside the figures
        point(router, p_url, warm, False, "warm")
    rows = []
    for length in lengths:
        for stream in (False, True, False):   # non-streamed twice: first touch vs repeat
            row = point(router, p_url, length, stream, "c")
            print(json.dumps(row), flush=True)
            rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)


def guard(router: str, p_url: str, out: str, length: int, turns: int) -> None:
    """Two conversations of the same shape, growing from `length` tokens, different text: A continues one
    conversation id (reuse as the cost-aware router decides); B takes a new id every turn (never reuse:
    recompute). Each keeps its own history on D, so D's prefix cache favours neither."""
    a = [{"role": "user", "content": filler(p_url, length, 0)}]
    b = [{"role": "user", "content": filler(p_url, length, 99)}]
    rows = []
    for turn in range(turns):
        on, m_on = measured(p_url, lambda: chat(router, a, "guard", True, 4))
        off, m_off = measured(p_url, lambda: chat(router, b, f"guard-off-{turn}", True, 4))
        row = {"turn": turn + 1, "on_ms": round(1000 * on, 1), "off_ms": round(1000 * off, 1),
               "ratio": round(on / off, 2), "pulled": m_on["pulled"], "xfer_ms": round(1000 * m_on["xfer_s"], 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        a += [{"role": "assistant", "content": reply_of(m_on["raw"], True)},
              {"role": "user", "content": filler(p_url, 500, turn + 1)}]
        b += [{"role": "assistant", "content": reply_of(m_off["raw"], True)},
              {"role": "user", "content": filler(p_url, 500, turn + 101)}]
    router_metrics = urllib.request.urlopen(router + "/metrics", timeout=30).read().decode()
    decisions = re.findall(r"^pdserve_router_reuse_decisions_total\{([^}]*)\} ([0-9.]+)", router_metrics, re.M)
    costs = re.findall(r"^pdserve_router_cost_seconds_per_token\{([^}]*)\} ([0-9.e+-]+)", router_metrics, re.M)
    json.dump({"turns": rows, "decisions": decisions, "costs": costs}, open(out, "w"), indent=1)
    print(json.dumps({"decisions": decisions, "costs": costs}))


def split(router: str, p_url: str, d_url: str, out: str, length: int, reps: int) -> None:
    """The streamed 36k "on" turn (and its "off" twin) `reps` times, each part in ms: client TTFT, the
    router's legs (decide = its /tokenize and reuse decision; prefill = P's whole leg; decode = D's leg to
    its first byte), and each engine's own sums for that request: queue (for P: waiting for the pull too),
    prefill (compute), TTFT at the engine, NIXL transfer and post time, descriptors, bytes."""
    for warm in (2048, 8192):
        point(router, p_url, warm, True, "warm")
    rows = []
    for rep in range(reps):
        conv = f"s-{length}-{rep}"
        msgs = [{"role": "user", "content": filler(p_url, length - NEW_TOKENS, length + 7 * rep)}]
        _, raw = chat(router, msgs, conv, False, 8)
        msgs += [{"role": "assistant", "content": reply_of(raw, False)},
                 {"role": "user", "content": filler(p_url, NEW_TOKENS, length + 7 * rep + 1)}]
        for arm, cid in (("on", conv), ("off", conv + "-off")):
            p0, d0 = metrics(p_url), metrics(d_url)
            ttft, _ = chat(router, msgs, cid, True, 4)
            time.sleep(0.5)      # D's request ends after its 4 tokens: its histograms then hold it
            p1, d1 = metrics(p_url), metrics(d_url)
            ms = lambda a, b, k: round(1000 * (b[k] - a[k]), 1)   # noqa: E731
            row = {"rep": rep, "arm": arm, "length": length, "ttft_ms": round(1000 * ttft, 1), "legs": legs(cid),
                   "p": {k: ms(p0, p1, k) for k in ("queue_s", "prefill_s", "ttft_s", "xfer_s", "post_s")}
                   | {k: p1[k] - p0[k] for k in ("pulled", "computed", "descs", "xfer_n", "bytes")},
                   "d": {k: ms(d0, d1, k) for k in ("queue_s", "prefill_s", "ttft_s", "xfer_s", "post_s")}
                   | {k: d1[k] - d0[k] for k in ("pulled", "computed", "descs", "xfer_n", "bytes")}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    mode, router, p_url, out = sys.argv[1:5]
    if mode == "split":
        split(router, p_url, sys.argv[7], out, int(sys.argv[5]), int(sys.argv[6]))
    elif mode == "curve":
        lengths = [int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "2048,8192,16384,24576,32768").split(",")]
        curve(router, p_url, out, lengths)
    else:
        guard(router, p_url, out, int(sys.argv[5]) if len(sys.argv) > 5 else 16384,
              int(sys.argv[6]) if len(sys.argv) > 6 else 10)
