"""Traces and JSON request logs of the router, against fake backends and a real OTLP/HTTP receiver (the
official protobuf): one trace per request, the span tree of a reuse miss, a hit and a degraded request,
W3C traceparent passed to the backends, one JSON line per request; and nothing of OpenTelemetry imported
when tracing is off."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from tests.kits.fake_vllm import FAKE
from tests.kits.otlp_receiver import Receiver
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


def turn(conv: str, n: int) -> dict:
    return {"model": "fake", "max_tokens": 4, "conversation_id": conv,
            "messages": [{"role": "user", "content": f"turn {i} " + "words " * 40} for i in range(n)]}


def tree(receiver: Receiver, request_id: str):
    root = next(s for s in receiver.roots() if s.attributes.get("pdserve.request_id") == request_id)
    children = [s for s in receiver.trace(root.trace_id) if s.parent_id == root.span_id]
    return root, children


async def test_span_tree_of_a_miss_then_a_hit_and_traceparent_reaches_the_backends(caplog):
    receiver = await Receiver().start()
    caplog.set_level(logging.INFO, logger="pdserve.router.requests")
    try:
        async with deployment(otlp_endpoint=receiver.url, json_logs=True) as dep:
            ids = []
            for n in (1, 2):
                async with dep.session.post(dep.url + CHAT, json=turn("conv-a", n)) as resp:
                    assert resp.status == 200
                    ids.append(resp.headers["X-Request-Id"])
            p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
            p_seen = [r["headers"].get("traceparent") for r in p.received]
            d_seen = [r["headers"].get("traceparent") for r in d.received]
        # leaving the deployment shut the router down, which flushed its spans
    finally:
        await receiver.stop()
    miss, miss_children = tree(receiver, ids[0])
    hit, hit_children = tree(receiver, ids[1])
    assert miss.service == "pdserve-router" and miss.kind == 2          # SERVER
    assert miss.parent_id == ""                                         # one trace per request
    assert miss.trace_id != hit.trace_id
    a = miss.attributes
    # turn 1 holds no earlier model output: a first turn, not a miss
    assert (a["pdserve.identity"], a["pdserve.reuse"], a["pdserve.reuse_reason"]) == ("explicit", "first", "no_entry")
    assert a["pdserve.outcome"] == "stored" and a["pdserve.prefill_servers"] == "prefill-0"
    assert a["pdserve.generated_on"] == "decode-0" and a["pdserve.generate_tries"] == 1
    assert a["pdserve.conversation"] and a["pdserve.degraded"] is False
    assert 0 < a["pdserve.ttft_ms"] <= (miss.end_ns - miss.start_ns) / 1e6
    b = hit.attributes
    assert (b["pdserve.reuse"], b["pdserve.outcome"]) == ("hit", "stored")
    assert b["pdserve.tokens_offered"] > 0 and b["pdserve.tokens_pulled"] > 0
    # the P leg and the D leg, each a CLIENT span under the request's, named by role, timed to first byte
    assert sorted(s.name for s in miss_children) == ["decode /v1/chat/completions", "prefill /v1/chat/completions"]
    assert {s.kind for s in miss_children} == {3}
    # no short-turn rule here: the router needs no token count and P's engine checks the offer (no /tokenize)
    assert not any(s.name == "prefill /tokenize" for s in hit_children)
    legs = {s.attributes["pdserve.role"]: s for s in hit_children if s.name.endswith(CHAT)}
    assert legs["prefill"].attributes["pdserve.backend"] == "prefill-0"
    assert legs["decode"].attributes["pdserve.backend"] == "decode-0"
    assert legs["prefill"].end_ns <= legs["decode"].start_ns
    # each backend got the traceparent of its own client span: vLLM's spans hang under it
    client_ids = {s.span_id for s in receiver.spans if s.kind == 3}
    for seen in (p_seen, d_seen):
        assert seen and all(tp and tp.split("-")[2] in client_ids for tp in seen), seen
    assert {tp.split("-")[1] for tp in d_seen} == {miss.trace_id, hit.trace_id}
    # one JSON line per request, with the same ids
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.router.requests"]
    assert [ln["request_id"] for ln in lines] == ids
    assert [ln["trace_id"] for ln in lines] == [miss.trace_id, hit.trace_id]
    assert [ln["outcome"] for ln in lines] == ["stored", "stored"]
    assert lines[0]["conversation"] == a["pdserve.conversation"] and lines[1]["reuse"] == "hit"


async def test_span_tree_of_a_degraded_request_and_a_client_traceparent_is_continued():
    receiver = await Receiver().start()
    try:
        async with deployment(decode_args=(["--drop-connection"],), otlp_endpoint=receiver.url) as dep:
            client_trace = "0af7651916cd43dd8448eb211c80319c"
            headers = {"traceparent": f"00-{client_trace}-b7ad6b7169203331-01"}
            async with dep.session.post(dep.url + CHAT, json=turn("conv-b", 1), headers=headers) as resp:
                assert resp.status == 200
                request_id = resp.headers["X-Request-Id"]
    finally:
        await receiver.stop()
    root, children = tree(receiver, request_id)
    assert root.trace_id == client_trace and root.parent_id == "b7ad6b7169203331"
    a = root.attributes
    assert a["pdserve.outcome"] == "degraded" and a["pdserve.degraded"] is True
    assert a["pdserve.degraded_to"] == "prefill" and "decode-0 failed" in a["pdserve.degraded_reason"]
    assert a["pdserve.generated_on"] == "prefill-0"
    # P leg, the D leg that failed (no answer: an error span), then the whole request on P
    names = [s.name for s in sorted(children, key=lambda s: s.start_ns)]
    assert names == ["prefill /v1/chat/completions", "decode /v1/chat/completions", "prefill /v1/chat/completions"]
    failed = next(s for s in children if s.attributes["pdserve.role"] == "decode")
    assert failed.status_code == 2                                       # ERROR


def test_tracing_off_imports_no_opentelemetry():
    code = ("import sys; from pdserve.router.front.app import build_app; from pdserve.router.config import RouterConfig; "
            "build_app(RouterConfig(prefill=[], decode=[], model='m', json_logs=True)); "
            "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('opentelemetry')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


async def test_a_streamed_turn_has_its_trace_and_first_token_time():
    receiver = await Receiver().start()
    try:
        async with deployment(decode_args=(["--stream-kv-params"],), otlp_endpoint=receiver.url) as dep:
            status, lines = await dep.stream(CHAT, turn("conv-s", 1))
            assert status == 200 and lines[-1].strip() == b"data: [DONE]"
    finally:
        await receiver.stop()
    (root,) = receiver.roots()
    assert root.attributes["pdserve.stream"] is True and root.attributes["pdserve.outcome"] == "stored"
    assert 0 < root.attributes["pdserve.ttft_ms"] <= (root.end_ns - root.start_ns) / 1e6
    legs = sorted(s.attributes["pdserve.role"] for s in receiver.trace(root.trace_id) if s.parent_id == root.span_id)
    assert legs == ["decode", "prefill"]
