"""Admission policy (pdserve/router/front/admission.py) on a fake clock, and its queue on a real loop with
millisecond waits: per-tenant rate and in-flight caps (429), the global cap with its bounded queue (503),
Retry-After, and exactly one counted outcome per request."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.front import admission as adm
from pdserve.router.front.admission import Admission, AdmissionPolicy, Limits, Refusal
from pdserve.router.telemetry.metrics import RouterMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def outcomes(metrics: RouterMetrics) -> dict[str, float]:
    out = {}
    for metric in metrics.admission.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels["outcome"]] = s.value
    return out


def test_off_by_default():
    assert not Limits().enabled
    from pdserve.router.config import RouterConfig
    cfg = RouterConfig(prefill=[], decode=[], model="m")
    assert not Limits.from_config(cfg).enabled


def test_token_bucket_rejects_over_rate_with_retry_after_and_refills_on_the_clock():
    clock = Clock()
    policy = AdmissionPolicy(Limits(tenant_rate=2.0, tenant_burst=3), clock)
    assert [policy.arrive("a").outcome for _ in range(3)] == [adm.ADMITTED] * 3     # the burst
    over = policy.arrive("a")
    assert over.outcome == adm.REJECTED_TENANT_RATE and over.retry_after == 1
    assert policy.arrive("b").outcome == adm.ADMITTED                          # another tenant's own bucket
    clock.now += 0.499                                                          # 0.998 tokens: not yet
    assert policy.arrive("a").outcome == adm.REJECTED_TENANT_RATE
    clock.now += 0.002
    assert policy.arrive("a").outcome == adm.ADMITTED
    assert policy.arrive("a").outcome == adm.REJECTED_TENANT_RATE
    clock.now += 100                                                            # refills to the burst, no more
    assert [policy.arrive("a").outcome for _ in range(4)] == [adm.ADMITTED] * 3 + [adm.REJECTED_TENANT_RATE]


def test_slow_rate_retry_after_is_the_time_to_the_next_token():
    clock = Clock()
    policy = AdmissionPolicy(Limits(tenant_rate=0.1), clock)                    # one per 10 s, burst 1
    assert policy.arrive("a").outcome == adm.ADMITTED
    clock.now += 2.5
    v = policy.arrive("a")
    assert (v.outcome, v.retry_after) == (adm.REJECTED_TENANT_RATE, 8)          # 7.5 s left, rounded up


def test_tenant_in_flight_cap_frees_on_release_and_rejections_take_no_token():
    policy = AdmissionPolicy(Limits(tenant_max_in_flight=2, tenant_rate=100, tenant_burst=3), Clock())
    assert policy.arrive("a").outcome == adm.ADMITTED
    assert policy.arrive("a").outcome == adm.ADMITTED
    for _ in range(5):
        v = policy.arrive("a")
        assert (v.outcome, v.retry_after) == (adm.REJECTED_TENANT_IN_FLIGHT, 1)
    assert policy.arrive("b").outcome == adm.ADMITTED
    policy.release("a")
    assert policy.arrive("a").outcome == adm.ADMITTED                           # the third token was kept
    assert policy.in_flight == 3


def test_global_cap_queues_then_rejects_saturated():
    policy = AdmissionPolicy(Limits(max_in_flight=2, queue_size=1, queue_timeout=2.5), Clock())
    assert [policy.arrive(t).outcome for t in "ab"] == [adm.ADMITTED, adm.ADMITTED]
    assert policy.arrive("c").outcome == adm.WAIT
    full = policy.arrive("d")
    assert (full.outcome, full.retry_after) == (adm.REJECTED_SATURATED, 3)
    policy.release("a")
    assert policy.slot_free()
    policy.dequeued(True, "c")
    assert (policy.in_flight, policy.queued) == (2, 0)
    assert policy.arrive("d").outcome == adm.WAIT


def test_no_queue_rejects_at_the_cap():
    policy = AdmissionPolicy(Limits(max_in_flight=1), Clock())
    assert policy.arrive("a").outcome == adm.ADMITTED
    assert policy.arrive("b") == adm.Verdict(adm.REJECTED_SATURATED, 1)


def test_queued_requests_count_toward_the_tenant_cap():
    """One tenant cannot fill the queue: its queued requests are in its in-flight count."""
    policy = AdmissionPolicy(Limits(max_in_flight=1, queue_size=10, tenant_max_in_flight=2), Clock())
    assert policy.arrive("a").outcome == adm.ADMITTED
    assert policy.arrive("a").outcome == adm.WAIT
    assert policy.arrive("a").outcome == adm.REJECTED_TENANT_IN_FLIGHT
    assert policy.arrive("b").outcome == adm.WAIT
    policy.dequeued(False, "a")                                                  # a's waiter gave up
    assert policy.arrive("a").outcome == adm.WAIT


def test_idle_tenants_are_forgotten_so_the_table_stays_bounded(monkeypatch):
    monkeypatch.setattr(adm, "PRUNE_AT", 8)
    clock = Clock()
    policy = AdmissionPolicy(Limits(tenant_rate=1.0, tenant_max_in_flight=1), clock)
    for i in range(100):
        assert policy.arrive(f"t{i}").outcome == adm.ADMITTED
        policy.release(f"t{i}")
        clock.now += 1.0                          # each bucket refilled one second later
    assert len(policy.tenants) <= 16
    busy = AdmissionPolicy(Limits(tenant_max_in_flight=1), clock)
    for i in range(20):
        busy.arrive(f"t{i}")                      # in flight: kept, whatever the table's size
    assert len(busy.tenants) == 20 and busy.arrive("t3").outcome == adm.REJECTED_TENANT_IN_FLIGHT


def run(coro):
    return asyncio.run(coro)


def test_queue_admits_in_order_when_slots_free_and_times_out():
    async def main():
        metrics = RouterMetrics()
        gate = Admission(Limits(max_in_flight=1, queue_size=2, queue_timeout=0.05), metrics)
        await gate.enter("a")
        order = []

        async def queued(name):
            await gate.enter(name)
            order.append(name)

        b, c = asyncio.create_task(queued("b")), asyncio.create_task(queued("c"))
        await asyncio.sleep(0.005)
        with pytest.raises(Refusal) as full:
            await gate.enter("d")
        assert full.value.response().status == 503 and full.value.response().headers["Retry-After"] == "1"
        gate.exit("a")
        await asyncio.sleep(0.005)
        assert order == ["b"]
        with pytest.raises(Refusal) as late:                   # c waits past queue_timeout: b holds the slot
            await c
        assert late.value.verdict.outcome == adm.QUEUE_TIMEOUT and late.value.response().status == 503
        await b
        gate.exit("b")
        assert (gate.policy.in_flight, gate.policy.queued, len(gate.waiters)) == (0, 0, 0)
        return outcomes(metrics)

    assert run(main()) == {adm.ADMITTED: 1, adm.QUEUED: 1, adm.REJECTED_SATURATED: 1, adm.QUEUE_TIMEOUT: 1}


def test_a_queued_client_that_leaves_frees_its_place_and_is_counted():
    async def main():
        metrics = RouterMetrics()
        gate = Admission(Limits(max_in_flight=1, queue_size=1, queue_timeout=5), metrics)
        await gate.enter("a")
        waiting = asyncio.create_task(gate.enter("b"))
        await asyncio.sleep(0.005)
        assert gate.policy.queued == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (gate.policy.queued, len(gate.waiters)) == (0, 0)
        nxt = asyncio.create_task(gate.enter("c"))             # the place is free again
        await asyncio.sleep(0.005)
        gate.exit("a")
        await nxt
        gate.exit("c")
        assert (gate.policy.in_flight, gate.policy.queued) == (0, 0)
        assert gate.policy.tenants["b"].in_flight == 0
        return outcomes(metrics)

    assert run(main()) == {adm.ADMITTED: 1, adm.CLIENT_GONE: 1, adm.QUEUED: 1}


def test_a_slot_handed_to_a_waiter_that_just_left_goes_to_the_next():
    async def main():
        gate = Admission(Limits(max_in_flight=1, queue_size=2, queue_timeout=5), RouterMetrics())
        await gate.enter("a")
        first = asyncio.create_task(gate.enter("b"))
        second = asyncio.create_task(gate.enter("c"))
        await asyncio.sleep(0.005)
        gate.exit("a")              # hands the slot to b ...
        first.cancel()              # ... whose client leaves before b runs again
        with pytest.raises(asyncio.CancelledError):
            await first
        await second                # c gets the slot b gave back
        assert gate.policy.in_flight == 1
        gate.exit("c")
        assert (gate.policy.in_flight, gate.policy.queued) == (0, 0)

    run(main())


def test_a_waiter_cancelled_just_before_a_slot_frees_is_skipped_and_no_slot_leaks():
    """Issue 35 item 1: the client leaves (its task is cancelled, its future with it) and, before its task
    runs again, another request exits: the slot goes to the next waiter, the exit raises nothing, and
    nothing stays counted."""
    async def main():
        metrics = RouterMetrics()
        gate = Admission(Limits(max_in_flight=1, queue_size=2, queue_timeout=5, tenant_max_in_flight=5), metrics)
        await gate.enter("a")
        first = asyncio.create_task(gate.enter("b"))
        second = asyncio.create_task(gate.enter("c"))
        await asyncio.sleep(0.005)
        first.cancel()              # b's client leaves: its future is cancelled, its task not yet run ...
        gate.exit("a")              # ... when a's request ends and frees the slot
        with pytest.raises(asyncio.CancelledError):
            await first
        await second                # c got the slot
        assert (gate.policy.in_flight, gate.policy.queued) == (1, 0)
        gate.exit("c")
        assert (gate.policy.in_flight, gate.policy.queued, len(gate.waiters)) == (0, 0, 0)
        assert all(t.in_flight == 0 for t in gate.policy.tenants.values())
        return outcomes(metrics)

    assert run(main()) == {adm.ADMITTED: 1, adm.CLIENT_GONE: 1, adm.QUEUED: 1}


def test_churn_of_queued_clients_leaving_loses_no_slot():
    """Waves of requests over a small cap, half of the queued ones cancelled at random moments (some just as
    slots free): afterwards nothing is in flight, queued or held by a tenant."""
    import random

    async def main():
        rng = random.Random(35)
        gate = Admission(Limits(max_in_flight=4, queue_size=200, queue_timeout=5), RouterMetrics())

        async def request(tenant):
            await gate.enter(tenant)
            try:
                await asyncio.sleep(rng.random() * 0.002)
            finally:
                gate.exit(tenant)

        for wave in range(20):
            tasks = [asyncio.create_task(request(f"t{i % 7}")) for i in range(150)]
            await asyncio.sleep(0)
            for task in tasks[1::2]:
                if rng.random() < 0.3:
                    await asyncio.sleep(0)      # let a request or two end (and free a slot) in between
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert not [r for r in results if not isinstance(r, (type(None), asyncio.CancelledError))]
            assert (gate.policy.in_flight, gate.policy.queued, len(gate.waiters)) == (0, 0, 0), wave
        assert all(t.in_flight == 0 for t in gate.policy.tenants.values())

    run(main())


def test_refusal_bodies_are_openai_shaped():
    resp = Refusal(adm.Verdict(adm.REJECTED_TENANT_RATE, 4)).response()
    assert resp.status == 429 and resp.headers["Retry-After"] == "4"
    import json
    err = json.loads(resp.body)["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == 429 and "request rate" in err["message"]
    resp = Refusal(adm.Verdict(adm.QUEUE_TIMEOUT, 2)).response()
    assert resp.status == 503 and json.loads(resp.body)["error"]["type"] == "server_overloaded"


def test_a_client_address_cannot_escape_its_limits_by_rotating_credentials():
    clock = Clock()
    policy = AdmissionPolicy(Limits(client_max_in_flight=2, tenant_max_in_flight=10), clock)
    assert [policy.arrive(f"key{i}", "10.0.0.9").outcome for i in range(3)] == [
        adm.ADMITTED, adm.ADMITTED, adm.REJECTED_CLIENT_IN_FLIGHT]
    assert policy.arrive("key0", "10.0.0.7").outcome == adm.ADMITTED        # another address, even one key
    policy.release("key0", "10.0.0.9")
    assert policy.arrive("key5", "10.0.0.9").outcome == adm.ADMITTED
    rated = AdmissionPolicy(Limits(client_rate=1.0, client_burst=2), clock)
    assert [rated.arrive(f"k{i}", "a").outcome for i in range(3)] == [adm.ADMITTED] * 2 + [adm.REJECTED_CLIENT_RATE]
    assert rated.arrive("k9", "b").outcome == adm.ADMITTED
    assert Refusal(rated.arrive("k3", "a")).response().status == 429
    assert len(AdmissionPolicy(Limits(max_in_flight=1), clock).tenants) == 0  # off: no client table at all
    assert AdmissionPolicy(Limits(max_in_flight=1), clock).by_client is None


def test_client_address_is_the_ipv4_address_or_the_ipv6_slash_64():
    from types import SimpleNamespace
    from pdserve.router.identity import client_address as address
    assert address(SimpleNamespace(remote="10.1.2.3")) == "10.1.2.3"
    assert address(SimpleNamespace(remote="::ffff:10.1.2.3")) == "10.1.2.3"
    assert address(SimpleNamespace(remote="2001:db8:1:2:aaaa::1")) == address(SimpleNamespace(remote="2001:db8:1:2::9"))
    assert address(SimpleNamespace(remote="2001:db8:1:3::1")) == "2001:db8:1:3::/64"
    assert address(SimpleNamespace(remote=None)) == ""
