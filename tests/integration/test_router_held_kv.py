"""Held KV on the decode servers through the router, against fake vLLM servers that hold turns as D does, answer
pdserve's control routes, and let P read only what D still holds (tests/kits/fake_vllm.py): the budget, the
releases by reason, the lease past D's timer, and that P never reads freed blocks (real vLLM: tests/e2e)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.observe.routerstats import parse_metrics
from pdserve.router.front.app import FLOW
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
CAPACITY = 1024          # D's KV in tokens (its /metrics): budget 512 at the default share, 3 turns of ~150 words
WORDS = 150


def user(conv: int, turn: int) -> dict:
    return {"role": "user", "content": f"conversation {conv} turn {turn} " + " ".join(
        f"w{conv}x{turn}x{i}" for i in range(WORDS))}


async def turn(dep, conv: int, history: list, n: int, timeout: float = 30.0) -> tuple[int, dict]:
    history.append(user(conv, n))
    body = {"model": "fake", "messages": history, "max_tokens": 4, "conversation_id": f"c{conv}"}
    async with asyncio.timeout(timeout):
        async with dep.session.post(dep.url + CHAT, json=body) as resp:
            data = await resp.json()
            pulled = int(resp.headers.get("X-PDServe-Pulled-Tokens") or 0)
    assert resp.status == 200, data
    history.append(data["choices"][0]["message"])
    await dep.router[FLOW].held.settled()      # the releases this turn caused have landed on D
    return pulled, data


def held_kv(stats_text: str) -> dict:
    return parse_metrics(stats_text)["held_kv"]


async def test_held_kv_stays_under_the_budget_and_every_turn_2_reuses_or_recomputes_counted():
    async with deployment(decode_args=(["--kv-capacity", str(CAPACITY), "--stall-when-full"],)) as dep:
        d, p = dep.decode[0][FAKE], dep.prefill[0][FAKE]
        histories: dict[int, list] = {c: [] for c in range(8)}
        for c in range(8):                      # more conversations than D's budget holds
            await turn(dep, c, histories[c], 1)
            assert d.held_tokens() <= CAPACITY // 2
        hits = 0
        for c in reversed(range(8)):            # the most recent first: those still held reuse
            pulled, _ = await turn(dep, c, histories[c], 2)
            hits += pulled > 0
            assert d.held_tokens() <= CAPACITY // 2
        stats = parse_metrics(await dep.metrics())
        assert 1 <= hits < 8
        # the 8 first turns are counted apart (first), not as misses: each turn 2 is a hit or a counted miss
        assert stats["reuse_hits"] == hits and stats["misses_by_reason"] == {"released": 8 - hits}
        assert stats["reuse_first"] == 8 and stats["reuse_hit_rate"] == hits / 8
        held = stats["held_kv"]
        assert held["budget"] == {"decode-0": CAPACITY // 2} and held["tokens"]["decode-0"] <= CAPACITY // 2
        assert held["releases"]["lru"] >= 8 - hits and held["renewals"] == 0
        assert d.stalled == 0 and d.stale_reads == 0 and p.received     # no turn waited, P read nothing freed


async def test_turned_off_d_keeps_every_turn_until_its_timer_and_a_new_turn_waits_for_room():
    async with deployment(decode_args=(["--kv-capacity", str(CAPACITY), "--stall-when-full"],),
                          held_kv=False) as dep:
        d = dep.decode[0][FAKE]
        history: dict[int, list] = {c: [] for c in range(8)}
        with pytest.raises(TimeoutError):       # the issue: D full of held turns, the next one waits
            for c in range(8):
                await turn(dep, c, history[c], 1, timeout=2.0)
        assert d.held_tokens() > CAPACITY // 2 and d.releases == []


async def test_an_entry_a_turn_took_and_did_not_pull_is_released_at_once():
    async with deployment(decode_only=True) as dep:
        d = dep.decode[0][FAKE]
        history: list = []
        await turn(dep, 0, history, 1)
        first = next(iter(d.held))
        # an edited history under the same id: not a continuation, P recomputes; D's old turn helps no one
        history[0] = user(9, 9)
        pulled, _ = await turn(dep, 0, history, 2)
        assert pulled == 0 and (first, 0.0) in d.releases and first not in d.held
        # a short follow-up served on D alone: the handle it took is useless after it
        before = set(d.held)
        history.append({"role": "user", "content": "yes"})
        body = {"model": "fake", "messages": history, "max_tokens": 4, "conversation_id": "c0"}
        async with dep.session.post(dep.url + CHAT, json=body) as resp:
            assert resp.headers["X-PDServe-Plan"] == "decode_only"
        await dep.router[FLOW].held.settled()
        assert all((rid, 0.0) in d.releases for rid in before) and not before & set(d.held)
        # a turn with no conversation identity: D's handles are never stored, so they are freed at once
        async with dep.session.post(dep.url + "/v1/completions", json={"model": "fake", "prompt": "a b c",
                                                                       "max_tokens": 2}) as resp:
            assert resp.status == 200
        await dep.router[FLOW].held.settled()
        releases = held_kv(await dep.metrics())["releases"]
        assert releases["unused"] == 2 and releases["untracked"] == 1
        assert len(d.held) == 1 and d.stale_reads == 0


async def test_the_table_bounds_and_ttl_release_what_they_drop():
    async with deployment(reuse_max_entries=2) as dep:
        d = dep.decode[0][FAKE]
        for c in range(4):
            await turn(dep, c, [], 1)
        assert held_kv(await dep.metrics())["releases"]["evicted"] == 2 and len(d.held) == 2
    async with deployment(reuse_ttl=0.3, decoder_kv_blocks_ttl=30, held_kv_lease=0) as dep:
        d = dep.decode[0][FAKE]
        await turn(dep, 0, [], 1)
        await asyncio.sleep(0.5)
        dep.router[FLOW].store.table.purge_expired()      # the periodic purge, now
        await dep.router[FLOW].held.settled()
        assert held_kv(await dep.metrics())["releases"]["expired"] == 1 and d.held == {}


@pytest.mark.parametrize("lease", [3600.0, 0.0], ids=["lease", "fixed_timer"])
async def test_a_conversation_idle_past_ds_timer_still_reuses_while_d_has_room(lease):
    # D holds a turn 2 s; P declines reads within 0.3 s of the deadline it is handed (5 s in vLLM)
    async with deployment(prefill_args=(["--read-margin", "0.3"],),
                          decode_args=(["--held-ttl", "2", "--kv-capacity", str(CAPACITY)],),
                          decoder_kv_blocks_ttl=2.0, reuse_ttl=1.5, held_kv_lease=lease) as dep:
        held = dep.router[FLOW].held
        held.lease.read_margin = 0.3
        d, p = dep.decode[0][FAKE], dep.prefill[0][FAKE]
        history: list = []
        await turn(dep, 0, history, 1)
        await turn(dep, 0, history, 2)          # it came back: leased (a one-turn conversation goes at reuse_ttl)
        await asyncio.sleep(4.5)                # more than twice decoder_kv_blocks_ttl
        pulled_before = p.external_tokens
        pulled, _ = await turn(dep, 0, history, 3)
        stats = held_kv(await dep.metrics())
        if lease:
            assert pulled > 0 and stats["renewals"] >= 2 and d.renewals
            assert d.stale_reads == 0 and p.external_tokens - pulled_before == pulled
            # pressure wins over the lease: the idle conversation's blocks go first when D has no room
            await asyncio.sleep(2.5)
            idle = set(d.held)
            for c in range(1, 4):
                await turn(dep, c, [], 1)
            assert idle and all((rid, 0.0) in d.releases for rid in idle)
        else:
            assert pulled == 0 and stats["renewals"] == 0 and d.renewals == []


async def test_a_decode_server_without_the_control_routes_serves_as_before():
    async with deployment(decode_args=(["--no-held-control", "--kv-capacity", str(CAPACITY)],)) as dep:
        history: list = []
        await turn(dep, 0, history, 1)
        pulled, _ = await turn(dep, 0, history, 2)
        for c in range(1, 6):
            await turn(dep, c, [], 1)
        m = await dep.metrics()
        assert pulled > 0 and 'pdserve_router_held_kv_control{decode="decode-0"} 0.0' in m
        assert sum(held_kv(m)["releases"].values()) == 0


async def test_the_control_calls_carry_the_routers_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sekret")
    async with deployment(api_key="sekret") as dep:
        auth = {"Authorization": "Bearer sekret"}
        body = {"model": "fake", "prompt": "a b c", "max_tokens": 4}
        async with dep.session.post(dep.url + "/v1/completions", json=body, headers=auth) as resp:   # untracked
            assert resp.status == 200
        await dep.router[FLOW].held.settled()
        m = await dep.metrics_with(auth)
        assert held_kv(m)["releases"]["untracked"] == 1 and dep.decode[0][FAKE].held == {}


async def test_concurrent_conversations_over_the_budget_never_make_p_read_freed_blocks():
    async with deployment(decode_args=(["--kv-capacity", str(CAPACITY)],), decode_only=True) as dep:
        d = dep.decode[0][FAKE]

        async def conversation(c: int) -> None:
            history: list = []
            for n in range(3):
                await turn(dep, c, history, n)
                history.append({"role": "user", "content": "ok"})   # sometimes a short turn on D alone

        await asyncio.gather(*(conversation(c) for c in range(12)))
        stats = parse_metrics(await dep.metrics())
        assert stats["turn_outcomes"]["stored"] == 36 and d.stale_reads == 0
        assert d.held_tokens() <= CAPACITY // 2


async def test_the_router_holds_the_control_token_and_nobody_else_reaches_d_s_held_turns(monkeypatch):
    """Issue 45: D's control routes answered anyone who reached D's port. With the cluster's control token in
    the environment (pdserve's supervisor puts it there for D and the routers), D answers only it: the router's
    releases land, a client of D's port without it gets 401."""
    from pdserve.router.wire import CONTROL_TOKEN_ENV
    monkeypatch.setenv(CONTROL_TOKEN_ENV, "the-cluster-s-control-token")
    async with deployment(decode_args=(["--kv-capacity", str(CAPACITY), "--stall-when-full"],)) as dep:
        d = dep.decode[0][FAKE]
        histories: dict[int, list] = {c: [] for c in range(6)}
        for c in range(6):                      # more than D's budget: the router releases the oldest on D
            await turn(dep, c, histories[c], 1)
            assert d.held_tokens() <= CAPACITY // 2
        held = held_kv(await dep.metrics())
        assert held["releases"]["lru"] >= 1 and not any(held["failures"].values()), held
        d_url = dep.router[FLOW].decode.backends[0].url
        async with dep.session.get(d_url + "/pdserve/held") as resp:
            assert resp.status == 401
        async with dep.session.post(d_url + "/pdserve/held/release", json={"request_ids": ["x"]},
                                    headers={"Authorization": "Bearer anything"}) as resp:
            assert resp.status == 401


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_client_that_leaves_before_d_s_handles_arrive_leaves_nothing_held_on_d(stream):
    """Issue 45: a client that hung up as D was finishing (D done, its handles not yet relayed) left D holding
    the turn for decoder_kv_blocks_ttl, unknown to the router. The router now looks for it in D's own list
    (D names it after the router's request id) and releases it. The fake D holds a turn from its start."""
    async with deployment(decode_args=(["--token-delay", "0.3", "--answer-delay", "0" if stream else "1",
                                        "--stream-kv-params"],)) as dep:
        held = dep.router[FLOW].held
        held.sweeps_s = (0.3, 0.8)
        d = dep.decode[0][FAKE]
        body = {"model": "fake", "messages": [user(0, 1)], "max_tokens": 4, "conversation_id": "c0",
                "stream": stream}
        rid = None
        if stream:
            resp = await dep.session.post(dep.url + CHAT, json=body)
            await resp.content.readline()       # the first content chunk, then away
            rid = resp.headers.get("X-Request-Id")
            resp.close()
        else:                                   # away while D has it (the fake holds it from its start)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(dep.session.post(dep.url + CHAT, json=body), 0.2)
        for _ in range(50):
            if d.held:
                break
            await asyncio.sleep(0.02)
        assert len(d.held) == 1 and (rid is None or rid in next(iter(d.held)))
        await asyncio.sleep(0.8)
        await held.settled()
        stats = parse_metrics(await dep.metrics())
        assert d.held == {} and stats["held_kv"]["releases"]["abandoned"] == 1
        assert stats["turn_outcomes"]["client_gone"] == 1 and stats["held_kv"]["tokens"]["decode-0"] == 0
