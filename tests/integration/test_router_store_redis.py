"""The Redis reuse store against a real redis-server (Debian's, on a free loopback port, data in a temp dir):
its semantics (single use under concurrency, expiry in Redis, tenants, hashed keys), router replicas and a
router restart sharing it, and Redis faults (killed, paused) that never fail or hold up a request."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from pdserve.router.front.app import FLOW, REPLICA_HEADER
from pdserve.router.kv.store import UNAVAILABLE
from tests.kits.fake_vllm import FAKE
from tests.kits.metric_text import reuse_hits
from tests.kits.redis_rig import PARAMS, add_router, store_at
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


def chat(content: str, history=None, **kw) -> dict:
    return {"model": "fake", "messages": list(history or []) + [{"role": "user", "content": content}],
            "max_tokens": 4, **kw}


async def test_entries_are_single_use_under_concurrency_across_clients(redis_server):
    """50 takes of one entry at once, from two clients (two replicas): exactly one gets it."""
    a, b = store_at(redis_server.url), store_at(redis_server.url)
    try:
        for round_ in range(5):
            assert await (await a.put(("t", f"c{round_}"), PARAMS, "decode-0", 0, list(range(100))))
            takes = [s.take_first([("t", "other"), ("t", f"c{round_}")]) for s in (a, b) for _ in range(25)]
            got = [e for e, why in await asyncio.gather(*takes) if e is not None]
            assert len(got) == 1, len(got)
            assert list(got[0].sequence) == list(range(100)) and got[0].params == PARAMS
            assert got[0].decode == "decode-0"
    finally:
        await a.close()
        await b.close()


async def test_an_entry_is_taken_once_by_its_key_or_its_prompts_alias_across_clients(redis_server):
    """The prompt's alias finds the entry (marked by_prompt); 50 takes at once by either key, from two
    replicas: exactly one gets it, and its decode server's index lets it go."""
    a, b = store_at(redis_server.url), store_at(redis_server.url)
    try:
        for round_ in range(4):
            assert await (await a.put(("t", f"reply{round_}"), PARAMS, "decode-0", 0, [4, 5, 6],
                                      alias=("t", f"prompt{round_}")))
            takes = [s.take_first([("t", "other"), ("t", f"prompt{round_}" if i % 2 else f"reply{round_}")])
                     for s in (a, b) for i in range(25)]
            got = [e for e, why in await asyncio.gather(*takes) if e is not None]
            assert len(got) == 1, len(got)
            assert list(got[0].sequence) == [4, 5, 6] and got[0].params == PARAMS
        assert await (await a.put(("t", "r"), PARAMS, "decode-1", 0, alias=("t", "p")))
        entry, _ = await b.take_first([("t", "p")])
        assert entry.by_prompt and entry.decode == "decode-1"
        assert await b.take_first([("t", "r"), ("t", "p")]) == (None, "no_entry")
        raw = aioredis.from_url(redis_server.url)
        assert await raw.zcard("pdserve:t:idx:decode-1") == 0
        await raw.aclose()
    finally:
        await a.close()
        await b.close()


async def test_expiry_is_redis_own_and_keys_name_no_conversation(redis_server):
    store = store_at(redis_server.url, ttl=0.3)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await (await store.put(("tenant-hash", "id:my-secret-conversation"), PARAMS, "decode-0", 0, [5, 6, 7]))
        keys = [k.decode() for k in await client.keys("*")]
        entry_keys = [k for k in keys if ":e:" in k]
        assert len(entry_keys) == 1 and not any("secret" in k or "tenant-hash" in k for k in keys), keys
        assert 0 < await client.pttl(entry_keys[0]) <= 300            # expiry set in Redis (PX)
        value = await client.get(entry_keys[0])
        assert b"secret" not in value and len(value) < 400             # 3 tokens: 12 bytes after the header
        await asyncio.sleep(0.45)
        assert await store.take_first([("tenant-hash", "id:my-secret-conversation")]) == (None, "no_entry")
        assert await client.exists(entry_keys[0]) == 0
        await (await store.put(("a", "c"), PARAMS, "decode-0", 0))
        assert (await store.take_first([("b", "c")]))[0] is None      # another tenant's key
        assert (await store.take_first([("a", "c")]))[0] is not None
    finally:
        await store.close()
        await client.aclose()


async def test_new_engine_id_and_decode_down_drop_that_servers_handles(redis_server):
    store = store_at(redis_server.url)
    try:
        await (await store.put(("t", "old"), PARAMS, "decode-0", 0))
        await (await store.put(("t", "other"), PARAMS, "decode-1", 0))
        await store.put(("t", "new"), {**PARAMS, "remote_engine_id": "e2"}, "decode-0", 0)   # decode-0 restarted
        assert (await store.take_first([("t", "old")]))[0] is None
        assert (await store.take_first([("t", "new")]))[0] is not None
        await store.refresh()
        assert len(store) == 1                      # decode-1's entry, counted by the decode indexes
        assert await store.drop_decode("decode-1") == 1
        assert (await store.take_first([("t", "other")]))[0] is None
    finally:
        await store.close()


async def _turns(url: str, session, n: int, conversation: str, served_by: list[str]) -> None:
    history: list = []
    for i in range(n):
        body = chat(f"turn {i} " * 30, history, conversation_id=conversation)
        async with session.post(url + CHAT, json=body) as resp:
            assert resp.status == 200
            served_by.append(resp.headers.get(REPLICA_HEADER, ""))
            data = await resp.json()
        history = body["messages"] + [data["choices"][0]["message"]]


async def test_two_replicas_share_one_conversation_and_a_restarted_router_keeps_it(redis_server):
    """Turns alternate between two routers: every follow-up is a hit, and so is the first turn through a
    router started after the others stopped."""
    async with deployment(store=redis_server.url, replica="router-0") as dep:
        other, other_url, _ = await add_router(dep, replica="router-1")
        history, served = [], []
        for i in range(6):
            url = dep.url if i % 2 == 0 else other_url
            body = chat(f"turn {i} " * 30, history, conversation_id="shared")
            async with dep.session.post(url + CHAT, json=body) as resp:
                assert resp.status == 200
                served.append(resp.headers[REPLICA_HEADER])
                data = await resp.json()
            history = body["messages"] + [data["choices"][0]["message"]]
        assert served == ["router-0", "router-1"] * 3
        offers = [b["body"]["kv_transfer_params"] for b in dep.prefill[0][FAKE].received if b["path"] == CHAT]
        assert ["remote_block_ids" in o for o in offers] == [False] + [True] * 5
        other_metrics = await (await dep.session.get(other_url + "/metrics")).text()
        assert (reuse_hits(await dep.metrics()), reuse_hits(other_metrics)) == (2, 3)    # turns 2, 4 and 1, 3, 5

        # Both routers gone, a new one started: the conversation's entry is still there.
        for runner in list(dep.runners[-2:]):
            await runner.cleanup()
            dep.runners.remove(runner)
        fresh, fresh_url, _ = await add_router(dep, replica="router-0")
        await _wait_healthy(fresh)
        body = chat("after the restart " * 5, history, conversation_id="shared")
        async with dep.session.post(fresh_url + CHAT, json=body) as resp:
            assert resp.status == 200
        assert "remote_block_ids" in dep.prefill[0][FAKE].received[-1]["body"]["kv_transfer_params"]


async def _wait_healthy(app) -> None:
    flow = None
    for _ in range(100):
        flow = app.get(FLOW)
        if flow and all(b.healthy for b in flow.prefill.pool.backends + flow.decode.backends):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("backends never became healthy")


async def test_redis_killed_mid_run_fails_no_request_and_reuse_resumes(redis_server):
    async with deployment(store=redis_server.url) as dep:
        served: list[str] = []
        await _turns(dep.url, dep.session, 3, "before", served)          # stored and hit while Redis is up
        redis_server.kill()
        started = time.monotonic()
        await asyncio.gather(*(_turns(dep.url, dep.session, 3, f"during-{i}", served) for i in range(4)))
        assert time.monotonic() - started < 10
        m = await dep.metrics()
        assert f'pdserve_router_reuse_decisions_total{{api="chat",reason="{UNAVAILABLE}",result="miss"}}' in m
        assert 'pdserve_router_turns_total{api="chat",outcome="not_stored"}' in m
        assert 'pdserve_router_store_up{store="redis"} 0.0' in m
        assert 'outcome="failed"' not in m
        redis_server.start()                                              # back, same port, empty
        await _store_back(dep)
        pre = reuse_hits(await dep.metrics())
        await _turns(dep.url, dep.session, 3, "after", served)
        assert reuse_hits(await dep.metrics()) == pre + 2                      # both follow-ups reused again


async def _store_back(dep) -> None:
    for _ in range(50):
        if 'pdserve_router_store_up{store="redis"} 1.0' in await dep.metrics():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the router never saw the store back")


async def test_a_paused_redis_holds_up_no_request(redis_server):
    """SIGSTOP: Redis accepts connections but never answers. Every request still answers, each within
    the store timeout plus its own time, and the store is back once Redis resumes."""
    async with deployment(store=redis_server.url, store_timeout=0.2) as dep:
        served: list[str] = []
        await _turns(dep.url, dep.session, 2, "warm", served)
        redis_server.pause()
        try:
            started = time.monotonic()
            await asyncio.gather(*(_turns(dep.url, dep.session, 3, f"paused-{i}", served) for i in range(4)))
            took = time.monotonic() - started
            m = await dep.metrics()
        finally:
            redis_server.resume()
        assert took < 5, took
        assert 'pdserve_router_store_errors_total{op="take",reason="timeout"}' in m or \
            'pdserve_router_store_errors_total{op="put",reason="timeout"}' in m, m
        assert 'outcome="failed"' not in m
        await _store_back(dep)
        pre = reuse_hits(await dep.metrics())
        await _turns(dep.url, dep.session, 2, "resumed", served)
        assert reuse_hits(await dep.metrics()) == pre + 1


async def test_an_answer_never_waits_for_redis_to_confirm_its_put(redis_server):
    """The put is on the wire before the answer and its reply is awaited after: with Redis paused for
    longer than the answer takes, the client is answered at once; once Redis resumes, the turn counts as
    stored and its follow-up reuses it. (Before, the answer waited for the reply: the store timeout here,
    then not_stored.)"""
    async with deployment(store=redis_server.url, store_timeout=3.0) as dep:
        await _turns(dep.url, dep.session, 1, "warm", [])            # the pipe's connection is open
        body = chat("a first turn " * 20)                              # no history: nothing to take
        redis_server.pause()
        try:
            started = time.monotonic()
            async with dep.session.post(dep.url + CHAT, json=body) as resp:
                assert resp.status == 200
                data = await resp.json()
            took = time.monotonic() - started
        finally:
            redis_server.resume()
        assert took < 1.5, took                                        # not the 3 s store timeout
        m = await dep.metrics()                                        # waits for the put's reply
        assert 'pdserve_router_turns_total{api="chat",outcome="not_stored"}' not in m
        assert 'pdserve_router_turns_total{api="chat",outcome="stored"} 2.0' in m, m
        follow_up = chat("and then? " * 5, body["messages"] + [data["choices"][0]["message"]])
        async with dep.session.post(dep.url + CHAT, json=follow_up) as resp:
            assert resp.status == 200
        assert "remote_block_ids" in dep.prefill[0][FAKE].received[-1]["body"]["kv_transfer_params"]


async def test_a_take_after_a_put_returns_finds_the_entry_before_the_put_is_confirmed(redis_server):
    """What lets the reply come after the answer, on one replica: its put and take share one connection,
    which Redis serves in order, so a take sent once put has returned finds the entry, its reply still due.
    (Another replica's take comes through another connection; it is behind the put because the client
    sends its next turn only once it had the answer: test_two_replicas_share_one_conversation...)"""
    store = store_at(redis_server.url)
    try:
        for i in range(50):
            verdict = await store.put(("t", f"c{i}"), PARAMS, "decode-0", 0, [1, 2, 3])
            assert not verdict.done()                  # the reply is still due
            entry, why = await store.take_first([("t", f"c{i}")])
            assert entry is not None, (i, why)
            assert await verdict
    finally:
        await store.close()


async def _stored(dep, turns: int) -> None:
    """Until Redis has answered the puts of `turns` turns."""
    for _ in range(100):
        if f'pdserve_router_turns_total{{api="chat",outcome="stored"}} {turns:.1f}' in await dep.metrics():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the puts of {turns} turns were never answered")


async def test_redis_restarted_while_the_router_is_idle_costs_no_turn(redis_server):
    """Redis restarts between two turns (an upgrade, a failover): the pipe's connection is to the old
    process, closed by it. The next turn reconnects instead of failing its take on the dead socket,
    marking the store down and leaving its follow-up unstored (before: store_up 0 and a miss)."""
    async with deployment(store=redis_server.url) as dep:
        await _turns(dep.url, dep.session, 2, "before-restart", [])         # the pipe's connection is open
        # Idle: a turn's put is answered after the turn's answer, so the second one may still be in flight
        # (killed with it, it failed and took the store down: the test failed now and then).
        await _stored(dep, 2)
        redis_server.kill()
        redis_server.start()                                                 # back, same port, empty
        pre = reuse_hits(await dep.metrics())
        await _turns(dep.url, dep.session, 3, "after-restart", [])
        m = await dep.metrics()
        assert 'pdserve_router_store_up{store="redis"} 1.0' in m
        assert "pdserve_router_store_errors_total{" not in m, [line for line in m.splitlines() if "store_errors_total{" in line]
        assert reuse_hits(m) == pre + 2
