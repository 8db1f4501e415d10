"""Circuit breaker trials that end without a verdict (issue 11, point 5): a half-open trial abandoned by
its client must free the slot, or the backend never gets traffic again."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdserve.router.front.app import FLOW
from pdserve.router.route.breaker import OPEN
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
HI = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _abandon(dep, path: str, body: dict, after: float) -> None:
    """Send a request and drop the connection after `after` seconds (or after the first line, streamed)."""
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with asyncio.timeout(after):
                async with s.post(dep.url + path, json=body) as resp:
                    await resp.content.readline()
                    await asyncio.sleep(10)


async def _wait_in_flight_zero(backend) -> None:
    for _ in range(50):
        if backend.in_flight == 0:
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("role,slow,request_body,after", [
    ("prefill", {"delay": 5}, HI, 0.5),                                                  # dropped while P works
    ("decode", {"token_delay": 0.5}, {**HI, "stream": True, "max_tokens": 20}, 0.3),     # dropped mid-stream
])
async def test_abandoned_trial_frees_the_half_open_slot(role, slow, request_body, after):
    async with deployment(**{f"{role}_args": (["--status", "500"],)}, breaker_cooldown=0.2) as dep:
        fake = (dep.prefill if role == "prefill" else dep.decode)[0][FAKE]
        pool = dep.router[FLOW].prefill.pool if role == "prefill" else dep.router[FLOW].decode
        for _ in range(3):
            await dep.post(CHAT, HI)                    # the other role serves it (degraded); the breaker counts
        assert pool.backends[0].breaker.state == OPEN
        fake.args.status = 200
        vars(fake.args).update(slow)
        await asyncio.sleep(0.25)                       # cooldown over: half-open
        await _abandon(dep, CHAT, request_body, after)  # the trial's client goes away
        await _wait_in_flight_zero(pool.backends[0])
        vars(fake.args).update({k: 0 for k in slow})
        received = len(fake.received)
        status, _ = await dep.post(CHAT, HI)
        assert status == 200 and len(fake.received) == received + 1


async def test_abandoned_reuse_hit_trial_on_completions_frees_the_half_open_slot():
    async with deployment(breaker_cooldown=0.2) as dep:
        p = dep.prefill[0][FAKE]
        prompt = list(range(100, 164))
        first = {"model": "fake", "prompt": prompt, "max_tokens": 4, "conversation_id": "c"}
        assert (await dep.post("/v1/completions", first))[0] == 200
        sequence = prompt + [50000 + i for i in range(4)]
        p.args.status = 500
        for _ in range(3):
            await dep.post(CHAT, HI)                    # D serves it whole (degraded); P's breaker counts
        assert dep.router[FLOW].prefill.pool.backends[0].breaker.state == OPEN
        p.args.status, p.args.delay = 200, 5
        await asyncio.sleep(0.25)
        # The trial is a reuse hit (P reads D's blocks): its outcome is not held against P either way.
        await _abandon(dep, "/v1/completions", {**first, "prompt": sequence + [7, 8, 9]}, 0.5)
        assert p.received[-1]["body"]["kv_transfer_params"].get("remote_block_ids")
        await _wait_in_flight_zero(dep.router[FLOW].prefill.pool.backends[0])
        p.args.delay = 0
        received = len(p.received)
        status, _ = await dep.post(CHAT, HI)
        assert status == 200 and len(p.received) == received + 1


async def test_a_router_side_failure_while_relaying_a_good_stream_never_counts_against_d():
    """Issue 45: whatever the router raised while relaying D's stream counted as D breaking it, so a bug of the
    router's (the fuzz round's: a conversation id it could not store) opened D's breaker in three turns, and
    the next turns were served whole on P. Injected here: the router's own bookkeeping fails at the first
    chunk of every stream. The client gets the format's error event; D's breaker stays closed."""
    async with deployment() as dep:
        flow = dep.router[FLOW]

        def broken(*_args, **_kwargs):
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

        flow.d_leg.costs.observe_first_token = broken
        d = dep.decode[0][FAKE]
        for _ in range(4):
            async with dep.session.post(dep.url + CHAT, json={**HI, "stream": True}) as resp:
                text = await resp.text()
            assert resp.status == 200 and '"error"' in text and "router" in text and "decode-0" not in text, text
        backend = flow.decode.backends[0]
        assert backend.breaker.state != OPEN and backend.breaker.failures == 0
        received = len(d.received)
        status, _ = await dep.post(CHAT, HI)
        assert status == 200 and len(d.received) == received + 1      # D still serves: no degraded turn
