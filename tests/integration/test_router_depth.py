"""Router depth against fake backends: automatic conversation detection, circuit breaker, cost-aware
reuse, client disconnects, request ids, API key and size limits."""

from __future__ import annotations

import asyncio

import aiohttp
import openai

from pdserve.router.front.app import FLOW
from tests.kits.fake_vllm import FAKE
from tests.kits.metric_text import sample
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


def offered(app) -> list[dict | None]:
    """What each P leg was offered: D's block handles, or None."""
    out = []
    for r in app[FAKE].received:
        kv = r["body"].get("kv_transfer_params") or {}
        out.append(kv if kv.get("remote_block_ids") else None)
    return out


async def test_unmodified_openai_client_gets_reuse_by_history():
    async with deployment() as dep:
        client = openai.AsyncOpenAI(base_url=dep.url + "/v1", api_key="k1")
        history = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "alpha " * 40}]
        for turn in range(3):
            resp = await client.chat.completions.create(model="fake", messages=history, max_tokens=4)
            history += [{"role": "assistant", "content": resp.choices[0].message.content},
                        {"role": "user", "content": f"next {turn} " * 5}]
        await client.close()
        offers = offered(dep.prefill[0])
        assert offers[0] is None and offers[1] and offers[2]
        assert offers[2]["remote_num_tokens"] > offers[1]["remote_num_tokens"]
        m = await dep.metrics()
        assert sample(m, 'pdserve_router_reuse_decisions_total{api="chat",reason="trimmed",result="hit"}') == 2
        assert sample(m, 'pdserve_router_conversation_identity_total{source="history"}') == 2
        assert sample(m, 'pdserve_router_conversation_identity_total{source="none"}') == 1


async def test_history_match_needs_the_same_caller_and_an_edited_reply_reuses_only_the_prompt():
    async with deployment() as dep:
        first = [{"role": "user", "content": "alpha " * 40}]
        _, data = await dep.post(CHAT, {"model": "fake", "messages": first, "max_tokens": 4},
                                 {"Authorization": "Bearer a"})
        reply = data["choices"][0]["message"]["content"]
        same = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "go"}]
        await dep.post(CHAT, {"model": "fake", "messages": same, "max_tokens": 4}, {"Authorization": "Bearer b"})
        assert offered(dep.prefill[0]) == [None, None]      # another caller's history matches nothing
        # The caller who got the reply, sending it back unchanged (as [{"type": "text"}] parts), does match.
        same[1]["content"] = [{"type": "text", "text": reply}]
        await dep.post(CHAT, {"model": "fake", "messages": same, "max_tokens": 4}, {"Authorization": "Bearer a"})
        assert offered(dep.prefill[0])[-1] is not None
        # An edited reply is found by its prompt, and P is offered no more than the previous prompt's tokens.
        second = [{"role": "user", "content": "beta " * 40}]
        _, data = await dep.post(CHAT, {"model": "fake", "messages": second, "max_tokens": 4},
                                 {"Authorization": "Bearer a"})
        edited = second + [{"role": "assistant", "content": data["choices"][0]["message"]["content"] + " extra"},
                           {"role": "user", "content": "go"}]
        await dep.post(CHAT, {"model": "fake", "messages": edited, "max_tokens": 4}, {"Authorization": "Bearer a"})
        offer = offered(dep.prefill[0])[-1]
        assert offer is not None and offer["remote_num_tokens"] <= data["usage"]["prompt_tokens"]


async def test_streamed_reply_is_matched_too():
    async with deployment(decode_args=(["--stream-kv-params"],)) as dep:
        first = [{"role": "user", "content": "alpha " * 40}]
        _, lines = await dep.stream(CHAT, {"model": "fake", "messages": first, "max_tokens": 4})
        import json
        text = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
                       for line in lines if line.startswith(b"data: {"))
        history = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        await dep.post(CHAT, {"model": "fake", "messages": history, "max_tokens": 4})
        assert offered(dep.prefill[0])[-1] is not None


async def test_circuit_breaker_opens_on_failed_requests_and_closes_after_a_good_trial():
    async with deployment(prefill_args=(["--status", "500"], []), breaker_cooldown=0.3) as dep:
        bad, good = dep.prefill
        for _ in range(8):
            status, _ = await dep.post(CHAT, {"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200   # each failure on prefill-0 fails over to prefill-1
        assert len(bad[FAKE].received) == 3   # 3 consecutive failures, then no more traffic
        flow = dep.router[FLOW]
        assert flow.prefill.pool.by_name("prefill-0").healthy   # its /health answers; only requests fail
        assert sample(await dep.metrics(), 'pdserve_router_backend_breaker_open{backend="prefill-0",role="prefill"}') == 1
        bad[FAKE].args.status = 200
        await asyncio.sleep(0.35)
        for _ in range(6):
            await dep.post(CHAT, {"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        assert len(bad[FAKE].received) >= 5   # the half-open trial succeeded: traffic is shared again
        assert sample(await dep.metrics(), 'pdserve_router_backend_breaker_open{backend="prefill-0",role="prefill"}') == 0


async def test_cost_aware_reuse_stops_pulling_when_slow_and_resumes_when_fast():
    slow = ["--compute-delay", "0.0005", "--pull-delay", "0.01"]
    async with deployment(prefill_args=(slow,), cost_probe_every=3, cost_aware=True) as dep:
        p = dep.prefill[0]
        history: list = []
        for turn in range(8):
            if turn == 5:
                p[FAKE].args.pull_delay = 0.00001      # the transport got fast again
            history.append({"role": "user", "content": f"turn {turn} " + "word " * 60})
            _, data = await dep.post(CHAT, {"model": "fake", "messages": history, "max_tokens": 4,
                                            "conversation_id": "c"})
            history.append(data["choices"][0]["message"])
        pulls = [o is not None for o in offered(p)]
        # 0: first turn; 1: pulls (the pair's first pull: handshake, not a sample); 2: pulls and is slow;
        # 3, 4: skipped as slower; 5: re-probe (3rd candidate) finds it fast; 6, 7: pull again.
        assert pulls == [False, True, True, False, False, True, True, True]
        m = await dep.metrics()
        assert sample(m, 'pdserve_router_reuse_decisions_total{api="chat",reason="pull_slower",result="miss"}') == 2
        costs = dep.router[FLOW].prefill.costs
        assert costs.pull[("prefill-0", "decode-0")] < costs.recompute["prefill-0"]


async def test_client_disconnect_cancels_the_decode_stream():
    async with deployment(decode_args=(["--token-delay", "0.2"],)) as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(dep.url + CHAT, json=body) as resp:
                await resp.content.readline()
        d = dep.decode[0][FAKE]
        for _ in range(40):
            if d.cancelled:
                break
            await asyncio.sleep(0.05)
        assert d.cancelled == 1
        backend = dep.router[FLOW].decode.by_name("decode-0")
        assert backend.in_flight == 0 and backend.breaker.failures == 0   # a client leaving is not D's fault


async def test_request_ids_are_the_routers_own():
    async with deployment() as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        for client_id, echoed in (("trace-42.a:b", True), ("bad id\twith tab", False), ("x" * 200, False)):
            async with dep.session.post(dep.url + CHAT, json=body, headers={"X-Request-Id": client_id}) as resp:
                assert resp.status == 200
                assert (resp.headers["X-Request-Id"] == client_id) is echoed
                if not echoed:
                    assert resp.headers["X-Request-Id"].startswith("pdserve-")
                assert resp.headers["Server-Timing"].startswith("prefill;dur=") and "decode;dur=" in resp.headers["Server-Timing"]
            sent = dep.prefill[0][FAKE].received[-1]["headers"]["x-request-id"]
            assert sent.startswith("pdserve-") and sent != client_id


async def test_api_key_guards_everything_but_health_and_reaches_backends():
    async with deployment(api_key="s3cret") as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, data = await dep.post(CHAT, body, headers)
            assert status == 401 and data["error"]["code"] == "invalid_api_key"
        for path in ("/metrics", "/v1/models"):
            async with dep.session.get(dep.url + path) as resp:
                assert resp.status == 401
        async with dep.session.get(dep.url + "/health") as resp:
            assert resp.status == 200
        assert dep.prefill[0][FAKE].received == []   # nothing reached a backend
        status, _ = await dep.post(CHAT, body, {"Authorization": "Bearer s3cret"})
        assert status == 200
        for app in dep.prefill + dep.decode:
            assert app[FAKE].received[-1]["headers"]["authorization"] == "Bearer s3cret"


async def test_oversized_body_and_header_are_refused():
    async with deployment(max_body_bytes=1024, max_header_bytes=512) as dep:
        status, data = await dep.post(CHAT, {"model": "fake", "messages": [{"role": "user", "content": "x" * 4096}]})
        assert status == 413 and data["error"]["code"] == 413
        async with dep.session.post(dep.url + CHAT, json={"messages": []}, headers={"X-Big": "y" * 2048}) as resp:
            assert resp.status in (400, 431)
        assert dep.prefill[0][FAKE].received == []


async def test_decode_failover_when_a_decode_server_refuses_connections():
    async with deployment(decode_args=([], []), health_interval=60) as dep:
        await dep.runners[1].cleanup()   # decode-0 gone; the router has not probed it since
        for _ in range(4):
            status, _ = await dep.post(CHAT, {"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200


async def test_entries_of_a_decode_server_that_died_are_dropped():
    async with deployment(decode_args=([], [])) as dep:
        first = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 40}], "max_tokens": 4,
                 "conversation_id": "c"}
        _, data = await dep.post(CHAT, first)
        holder = next(i for i, app in enumerate(dep.decode) if app[FAKE].received)
        await dep.runners[1 + holder].cleanup()          # the holder's process is gone: connections refused
        await asyncio.sleep(0.4)                          # a few probe rounds
        history = first["messages"] + [data["choices"][0]["message"], {"role": "user", "content": "more"}]
        status, _ = await dep.post(CHAT, {**first, "messages": history})
        assert status == 200                              # served by the other decode server
        assert offered(dep.prefill[0]) == [None, None]    # nothing offered from the dead server
        assert len(dep.router[FLOW].store) == 1           # only the new turn's entry


async def test_a_stalled_backend_becomes_a_504_not_a_hang():
    async with deployment(decode_args=(["--delay", "5"],), request_timeout=0.3) as dep:
        started = asyncio.get_running_loop().time()
        status, data = await dep.post(CHAT, {"model": "fake", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 504 and data["error"]["type"] == "timeout"
        assert asyncio.get_running_loop().time() - started < 2
