"""The router against backends (or proxies in front of them) that send what vLLM does not (issue 35 items 4
and 7; tests/kits/hostile.py): interim 1xx answers and unsolicited second answers never hand one request
another's answer or P handles; an endless or oversized answer is a 502 at the bound, and the router stays
responsive meanwhile."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


def body(text: str, **extra) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}


# A stray in the same write as the answer, or late (after the next request was sent): the backends echo no
# request id, so only a new connection per request keeps it from the next (issue 45: 3 of 8 on each leg).
@pytest.mark.parametrize("stray_delay", ["0", "0.05"], ids=["same_write", "late"])
async def test_interim_and_stray_answers_never_reach_another_request(stray_delay):
    manners = ["--interim", "--stray-answer", "--stray-delay", stray_delay, "--echo"]
    async with deployment(prefill_args=(manners,), decode_args=(manners + ["--delay", "0.002"],),
                          bidirectional_kv_xfer=False) as dep:
        async def ask(i: int) -> str:
            status, data = await dep.post(CHAT, body(f"nonce{i}"))
            assert status == 200, data
            return data["choices"][0]["message"]["content"].split("|")[0]

        got = [await ask(i) for i in range(12)]                       # one after another: one connection
        got += await asyncio.gather(*(ask(i) for i in range(12, 60)))  # and concurrent ones
        assert got == [f"nonce{i}" for i in range(60)]                # each its own; no P handles of another


async def test_an_endless_answer_is_a_502_at_the_bound_and_health_stays_quick():
    endless = (["--endless-body"],)        # both roles: D's failure is not served whole on P instead
    async with deployment(prefill_args=endless, decode_args=endless, max_answer_mb=1, request_timeout=20) as dep:
        started = time.monotonic()
        status, data = await dep.post(CHAT, body("hi"))
        assert status == 502 and "max_answer_mb" in data["error"]["message"], data
        assert time.monotonic() - started < 5

        async def health_ms() -> float:
            t = time.monotonic()
            async with dep.session.get(dep.url + "/health") as resp:
                assert resp.status == 200
            return 1000 * (time.monotonic() - t)

        stream = asyncio.create_task(dep.stream(CHAT, body("hi")))   # one SSE line that never ends
        slowest = 0.0
        while not stream.done():
            slowest = max(slowest, await health_ms())
            await asyncio.sleep(0.01)
        status, lines = await stream
        assert status == 200 and b"failed mid-stream: LineTooLong" in lines[-2]
        assert lines[-1] == b"data: [DONE]\n" and slowest < 500


async def test_a_huge_valid_answer_is_refused_without_reading_it_all():
    huge = (["--huge-body", str(64 << 20)],)
    async with deployment(prefill_args=huge, decode_args=huge, max_answer_mb=1, request_timeout=20) as dep:
        started = time.monotonic()
        status, data = await dep.post(CHAT, body("hi"))
        assert status == 502 and "over 1 MiB" in data["error"]["message"], data
        assert time.monotonic() - started < 2
