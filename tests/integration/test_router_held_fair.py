"""Fair shares of D's held-KV budget through the router (issue 45, item 5), against the fake vLLM servers: one
tenant's flood of new conversations cannot release another tenant's live conversation while that tenant holds
no more than its share (router/kv/held_ledger.py's over_budget)."""

from __future__ import annotations

import asyncio

from pdserve.observe.routerstats import parse_metrics
from pdserve.router.front.app import FLOW
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
CAPACITY = 4096          # D's KV in tokens: a budget of 2048 at the default share, 1024 a tenant with two
WORDS = 150              # ~170 tokens a message: the flood's 15 conversations a round are more than the budget


async def turn(dep, tenant: str, conv: str, history: list, n: int) -> int:
    """One turn of `tenant`'s conversation `conv`; the tokens P pulled from D."""
    history.append({"role": "user", "content": f"{conv} turn {n} " + " ".join(f"{conv}w{n}x{i}" for i in range(WORDS))})
    body = {"model": "fake", "messages": history, "max_tokens": 4, "conversation_id": conv}
    async with asyncio.timeout(30):
        async with dep.session.post(dep.url + CHAT, json=body, headers={"Authorization": f"Bearer {tenant}"}) as resp:
            data = await resp.json()
            pulled = int(resp.headers.get("X-PDServe-Pulled-Tokens") or 0)
    assert resp.status == 200, data
    history.append(data["choices"][0]["message"])
    await dep.router[FLOW].held.settled()      # the releases this turn caused have landed on D
    return pulled


async def test_one_tenants_flood_does_not_release_a_steady_tenants_conversation_within_its_share():
    """Before: one budget, least recently used first: each round of tenant A's new conversations released
    tenant B's conversation (the oldest entry), and B's follow-ups recomputed (0 of 4 reused here; 1 of 306 in
    the fuzz round). Now A's flood releases A's own oldest entries (`lru`); B, within its half, keeps reusing."""
    async with deployment(decode_args=(["--kv-capacity", str(CAPACITY)],)) as dep:
        d = dep.decode[0][FAKE]
        steady: list = []
        reused = []
        await turn(dep, "tenant-b", "b0", steady, 1)
        for n in range(2, 6):
            for i in range(15):                            # the flood: new conversations, one turn each
                await turn(dep, "tenant-a", f"a{n}-{i}", [], 1)
            reused.append(await turn(dep, "tenant-b", "b0", steady, n) > 0)
        stats = parse_metrics(await dep.metrics())
        held = stats["held_kv"]
        assert reused == [True] * 4, reused
        assert held["budget"] == {"decode-0": CAPACITY // 2} and held["tokens"]["decode-0"] <= CAPACITY // 2
        assert held["tenants"] == {"decode-0": 2}
        # A's turns release A's own oldest (lru); B's growing turns make room from A's, over its share
        assert held["releases"]["lru"] >= 15 and held["releases"]["over_share"] >= 1
        assert d.held_tokens() <= CAPACITY // 2 and d.stale_reads == 0
