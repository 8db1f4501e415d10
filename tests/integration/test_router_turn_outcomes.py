"""Every turn ends in exactly one recorded outcome, whatever the client does once it has what it needs.

The official `openai` client closes the connection as soon as it has read `data: [DONE]`; vLLM's body
ends a moment later. The fake D here ends its stream `--tail-delay` after [DONE] (and `--done-delay`
after its last chunk), so the client's close lands while the router still reads D."""

from __future__ import annotations

import asyncio
import json

from pdserve.observe.promtext import parse, total
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
STREAM_D = ["--stream-kv-params"]


def chat(messages: list[dict], **kw) -> dict:
    return {"model": "fake", "messages": messages, "max_tokens": 6, "stream": True, **kw}


async def outcomes(dep) -> dict[str, float]:
    samples = parse(await dep.metrics())
    return {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
            if name == "pdserve_router_turns_total"}


async def settled(dep, expected_turns: int) -> dict[str, float]:
    """The outcomes once `expected_turns` turns have ended (the router finishes after the client left)."""
    for _ in range(100):
        got = await outcomes(dep)
        if sum(got.values()) >= expected_turns:
            return got
        await asyncio.sleep(0.05)
    return await outcomes(dep)


async def stream_then_close(dep, body: dict, stop_after: bytes | None = b"data: [DONE]",
                            max_events: int | None = None, seen: dict | None = None) -> str:
    """Read the stream like the openai client and close the connection at once when `stop_after` is
    seen (or after `max_events` data lines); returns the assistant text received (headers into `seen`)."""
    text, events = [], 0
    resp = await dep.session.post(dep.url + CHAT, json=body)
    assert resp.status == 200
    if seen is not None:
        seen.update(resp.headers)
    async for line in resp.content:
        if stop_after is not None and line.startswith(stop_after):
            break
        if line.startswith(b"data: {"):
            events += 1
            for choice in json.loads(line[6:]).get("choices", []):
                text.append((choice.get("delta") or {}).get("content") or "")
            if max_events is not None and events >= max_events:
                break
    resp.close()     # drops the connection, as a client that hangs up does
    return "".join(text)


async def test_a_client_that_closes_right_after_done_keeps_the_turns_entry():
    async with deployment(decode_args=([*STREAM_D, "--tail-delay", "0.5"],)) as dep:
        history = [{"role": "user", "content": "alpha " * 40}]
        reply = await stream_then_close(dep, chat(history))
        got = await settled(dep, 1)
        # Before the fix the handler was cancelled while it waited for D's body to end: no entry.
        assert got == {"stored": 1.0}, got
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_client_cancelled_total") == 0      # it had everything it asked for
        assert total(m, "pdserve_router_requests_total", route=CHAT, status="200") == 1
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "beta " * 5}]
        headers: dict = {}
        await stream_then_close(dep, chat(history), seen=headers)
        assert int(headers["X-PDServe-Pulled-Tokens"]) == dep.prefill[0][FAKE].external_tokens
        assert headers["Server-Timing"].startswith("decide;dur=")        # the reuse decision, timed apart
        got = await settled(dep, 2)
        assert got == {"stored": 2.0}, got
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit") == 1
        assert dep.prefill[0][FAKE].external_tokens > 0


async def test_a_client_that_closes_before_done_after_the_last_chunk_keeps_the_entry():
    """D reported its handles with its final chunk: the answer is complete and D holds the blocks."""
    async with deployment(decode_args=([*STREAM_D, "--done-delay", "0.5"],)) as dep:
        history = [{"role": "user", "content": "gamma " * 40}]
        reply = await stream_then_close(dep, chat(history), stop_after=None, max_events=6)
        assert reply.split() == [f"w{i}" for i in range(6)]
        got = await settled(dep, 1)
        assert got == {"stored": 1.0}, got
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "delta " * 5}]
        await stream_then_close(dep, chat(history))
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit") == 1


async def test_a_client_that_leaves_mid_stream_cancels_d_and_is_counted_client_gone():
    """Mid-stream the router drops D's request (vLLM aborts it and frees its blocks, so there is nothing
    to remember) and records why; D is not blamed for it."""
    async with deployment(decode_args=([*STREAM_D, "--token-delay", "0.2"],)) as dep:
        await stream_then_close(dep, chat([{"role": "user", "content": "eps " * 40}]), stop_after=None,
                                max_events=2)
        got = await settled(dep, 1)
        assert got == {"client_gone": 1.0}, got
        for _ in range(40):
            if dep.decode[0][FAKE].cancelled:
                break
            await asyncio.sleep(0.05)
        assert dep.decode[0][FAKE].cancelled == 1      # D stopped generating for nobody
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_client_cancelled_total") == 1
        assert total(m, "pdserve_router_backend_requests_total", outcome="error") == 0
        assert total(m, "pdserve_router_reuse_entries_live") == 0


async def test_every_turn_has_exactly_one_outcome():
    async with deployment(decode_args=(STREAM_D,)) as dep:
        msgs = [{"role": "user", "content": "zeta " * 30}]
        status, _ = await dep.post(CHAT, {**chat(msgs), "stream": False})             # stored
        assert status == 200
        await stream_then_close(dep, chat(msgs))                                        # stored
        status, _ = await dep.post("/v1/completions", {"model": "fake", "prompt": "eta " * 30, "max_tokens": 4})
        assert status == 200                                                            # no identity: untracked
        dep.decode[0][FAKE].args.status = 400
        status, _ = await dep.post(CHAT, {**chat(msgs), "stream": False})               # D refused it
        assert status == 400
        got = await settled(dep, 4)
        assert got == {"stored": 2.0, "untracked": 1.0, "failed": 1.0}, got
