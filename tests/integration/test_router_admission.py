"""Admission control through the real router and fake vLLM servers: a tenant over its limit gets 429 with
Retry-After while another is served, a saturated deployment 503 with Retry-After, a queued request is
served once a slot frees, and every request ends in one counted outcome (pdserve_router_admission_total,
pdserve_router_turns_total and pdserve_router_requests_total agree)."""

from __future__ import annotations

import asyncio
import urllib.error

import aiohttp
import pytest

from pdserve.observe.routerstats import parse_metrics
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ALICE = {"Authorization": "Bearer alice"}
BOB = {"Authorization": "Bearer bob"}


async def post(dep, headers):
    async with dep.session.post(dep.url + CHAT, json=BODY, headers=headers) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.json(content_type=None)


async def test_tenant_over_its_rate_gets_429_with_retry_after_while_another_is_served():
    async with deployment(tenant_rate=0.2, tenant_burst=2) as dep:
        first = [await post(dep, ALICE) for _ in range(3)]
        assert [s for s, _, _ in first] == [200, 200, 429]
        status, retry, body = first[2]
        assert int(retry) >= 1 and body["error"]["type"] == "rate_limit_exceeded" and body["error"]["code"] == 429
        assert [(await post(dep, BOB))[0] for _ in range(2)] == [200, 200]     # bob has his own bucket
        for path in ("/health", "/metrics", "/v1/models"):                     # never limited
            for _ in range(3):
                async with dep.session.get(dep.url + path, headers=ALICE) as resp:
                    assert resp.status == 200
        stats = parse_metrics(await dep.metrics())
        assert stats["admission"] == {"admitted": 4, "rejected_tenant_rate": 1}
        assert stats["turn_outcomes"]["failed"] == 1 and stats["turns"] == 5


async def test_tenant_in_flight_cap_429_while_another_tenant_is_served():
    async with deployment(decode_args=(["--delay", "0.4"],), tenant_max_in_flight=1) as dep:
        slow = asyncio.create_task(post(dep, ALICE))
        await asyncio.sleep(0.15)
        status, retry, body = await post(dep, ALICE)
        assert status == 429 and retry == "1" and "in flight" in body["error"]["message"]
        assert (await post(dep, BOB))[0] == 200
        assert (await slow)[0] == 200
        assert (await post(dep, ALICE))[0] == 200                              # its slot came back
        assert parse_metrics(await dep.metrics())["admission"] == {"admitted": 3, "rejected_tenant_in_flight": 1}


async def test_saturated_deployment_queues_then_serves_then_503s():
    async with deployment(decode_args=(["--delay", "0.3"],), max_in_flight=1, queue_size=1,
                          queue_timeout=5) as dep:
        first = asyncio.create_task(post(dep, ALICE))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(post(dep, BOB))           # waits for first's slot
        await asyncio.sleep(0.1)
        status, retry, body = await post(dep, {"Authorization": "Bearer carol"})   # the queue is full
        assert status == 503 and int(retry) == 5 and body["error"]["type"] == "server_overloaded"
        assert (await first)[0] == 200 and (await queued)[0] == 200
        text = await dep.metrics()
        stats = parse_metrics(text)
        assert stats["admission"] == {"admitted": 1, "queued": 1, "rejected_saturated": 1}
        assert stats["admission_queue_depth"] == 0
        assert 'pdserve_router_admission_wait_seconds_count 1.0' in text


async def test_queue_wait_runs_out_with_503_and_a_client_that_leaves_the_queue_is_counted():
    async with deployment(decode_args=(["--delay", "0.6"],), max_in_flight=1, queue_size=4,
                          queue_timeout=0.2) as dep:
        first = asyncio.create_task(post(dep, ALICE))
        await asyncio.sleep(0.1)
        status, retry, _ = await post(dep, BOB)               # waits 0.2 s; first still holds the slot
        assert status == 503 and retry == "1"
        async with aiohttp.ClientSession() as gone:            # a client that hangs up while queued
            with_timeout = gone.post(dep.url + CHAT, json=BODY, headers=BOB, timeout=aiohttp.ClientTimeout(total=0.05))
            try:
                async with with_timeout:
                    raise AssertionError("answered while the slot was taken")
            except TimeoutError:
                pass
        assert (await first)[0] == 200
        for _ in range(50):
            stats = parse_metrics(await dep.metrics())
            if stats["admission"].get("client_gone"):
                break
            await asyncio.sleep(0.02)
        assert stats["admission"] == {"admitted": 1, "queue_timeout": 1, "client_gone": 1}
        assert stats["admission_queue_depth"] == 0
        assert (await post(dep, BOB))[0] == 200                  # nothing left behind in the queue


async def test_every_request_ends_in_one_counted_outcome_under_a_burst():
    async with deployment(decode_args=(["--delay", "0.05"],), max_in_flight=4, queue_size=4, queue_timeout=0.1,
                          tenant_max_in_flight=6) as dep:
        tenants = [{"Authorization": f"Bearer t{i % 3}"} for i in range(40)]
        results = await asyncio.gather(*(post(dep, h) for h in tenants))
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 429, 503} and 200 in statuses and (429 in statuses or 503 in statuses)
        assert all(r is not None for s, r, _ in results if s != 200)           # every refusal says when
        stats = parse_metrics(await dep.metrics())
        adm = stats["admission"]
        assert sum(adm.values()) == 40
        assert adm.get("admitted", 0) + adm.get("queued", 0) == statuses.count(200)
        assert adm.get("rejected_tenant_in_flight", 0) == statuses.count(429)
        assert adm.get("rejected_saturated", 0) + adm.get("queue_timeout", 0) == statuses.count(503)
        assert stats["turns"] == 40 and stats["turn_outcomes"].get("failed", 0) == 40 - statuses.count(200)


async def test_admission_is_off_by_default():
    async with deployment(decode_args=(["--delay", "0.1"],)) as dep:
        statuses = await asyncio.gather(*(post(dep, ALICE) for _ in range(30)))
        assert [s for s, _, _ in statuses] == [200] * 30
        text = await dep.metrics()
        assert "pdserve_router_admission_total{" not in text      # no outcome counted: no admission at all
        assert parse_metrics(text)["admission"] == {}


async def test_the_canary_waits_out_a_retry_after_instead_of_failing():
    """The supervisor's canary is a request like any other: refused by admission, it asks again after
    Retry-After (within its timeout) rather than reporting a broken deployment."""
    from pdserve.supervise import canary
    async with deployment(tenant_rate=1.0, tenant_burst=1) as dep:
        headers = {"Content-Type": "application/json"}
        await asyncio.to_thread(canary._chat, dep.url, headers, BODY, 30)
        started = asyncio.get_running_loop().time()
        reply, _ = await asyncio.to_thread(canary._chat, dep.url, headers, BODY, 30)   # 429, Retry-After 1, then 200
        assert reply["choices"] and asyncio.get_running_loop().time() - started >= 0.9
        with pytest.raises(urllib.error.HTTPError) as refused:                      # no time left to wait: the 429
            await asyncio.to_thread(canary._chat, dep.url, headers, BODY, 0.5)
        assert refused.value.code == 429
        assert parse_metrics(await dep.metrics())["admission"] == {"admitted": 2, "rejected_tenant_rate": 2}


async def test_a_flooder_rotating_credentials_does_not_starve_a_client_at_another_address():
    """Issue 35 item 8: one address floods with a new Authorization per request (each a new tenant); the
    per-address cap holds it to its share, and a client at another address keeps being served."""
    async with deployment(decode_args=(["--delay", "0.05"],), max_in_flight=4, queue_size=8, queue_timeout=1,
                          tenant_max_in_flight=8, client_max_in_flight=3) as dep:
        stop = asyncio.Event()
        flood_statuses: list[int] = []

        async def flooder(session: aiohttp.ClientSession, k: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                headers = {"Authorization": f"Bearer flood-{k}-{n}"}
                async with session.post(dep.url + CHAT, json=BODY, headers=headers) as resp:
                    flood_statuses.append(resp.status)
                    await resp.read()

        flood = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0), limit=0))
        tasks = [asyncio.create_task(flooder(flood, k)) for k in range(24)]
        await asyncio.sleep(0.2)
        good = [(await post(dep, ALICE))[0] for _ in range(12)]      # from 127.0.0.1, one at a time
        stop.set()
        await asyncio.gather(*tasks)
        await flood.close()
        assert good.count(200) >= 10, good
        assert 429 in flood_statuses and flood_statuses.count(200) > 12
        stats = parse_metrics(await dep.metrics())["admission"]
        assert stats["rejected_client_in_flight"] == flood_statuses.count(429)


async def test_count_tokens_goes_through_admission_and_counts_no_turn():
    """Issue 45: /v1/messages/count_tokens was never admission-checked: 300 of 300 reached P (each tokenized
    there), and 8 bodies of 15 MB took the router to 552 MB."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi " * 20}]}
    async with deployment(tenant_rate=0.2, tenant_burst=2) as dep:
        statuses = []
        for _ in range(4):
            async with dep.session.post(dep.url + "/v1/messages/count_tokens", json=body, headers=ALICE) as resp:
                statuses.append(resp.status)
                if resp.status == 429:
                    assert (await resp.json())["type"] == "error"      # Anthropic's shape on its route
        assert statuses == [200, 200, 429, 429]
        stats = parse_metrics(await dep.metrics())
        assert stats["admission"] == {"admitted": 2, "rejected_tenant_rate": 2}
        assert stats["turns"] == 0                                      # no turn: nothing generated
