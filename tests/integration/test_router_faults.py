"""Backends that answer badly, the router's own shortages, and degraded mode (issue 11, points 3, 8, 11, 12)."""

from __future__ import annotations

import asyncio
import errno
import json

import aiohttp
import pytest

from pdserve.router.front.app import FLOW
from tests.kits.fake_vllm import FAKE
from tests.kits.metric_text import sample
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
HI = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def breaker_failures(dep, role: str, i: int = 0) -> int:
    pool = dep.router[FLOW].decode if role == "decode" else dep.router[FLOW].prefill.pool
    return pool.backends[i].breaker.failures


async def test_plain_text_answer_to_a_stream_is_ds_failure_and_p_serves_it():
    async with deployment(decode_args=(["--plain-stream"],)) as dep:
        status, lines = await dep.stream(CHAT, HI)
        assert status == 200 and lines[-1] == b"data: [DONE]\n" and b"text/plain" not in b"".join(lines)
        assert breaker_failures(dep, "decode") == 1
        assert sample(await dep.metrics(), 'pdserve_router_degraded_requests_total{served_by="prefill"}') == 1
    async with deployment(prefill_args=(["--status", "500"],), decode_args=(["--plain-stream"],)) as dep:
        status, lines = await dep.stream(CHAT, HI)      # P cannot serve it either: D's failure is reported
        assert status == 502 and b"text/plain" in b"".join(lines)


async def test_malformed_sse_ends_with_an_error_event_and_done_never_an_http_block():
    async with deployment(decode_args=(["--bad-sse"],)) as dep:
        status, lines = await dep.stream(CHAT, HI)
        body = b"".join(lines)
        assert status == 200 and b"HTTP/1.1" not in body
        assert b'"error"' in lines[-2] and lines[-1] == b"data: [DONE]\n"
        assert breaker_failures(dep, "decode") == 1


async def test_stream_timing_out_before_its_first_byte_is_a_504():
    async with deployment(decode_args=(["--delay", "5"],), request_timeout=0.3) as dep:
        status, lines = await dep.stream(CHAT, HI)
        assert status == 504 and json.loads(b"".join(lines))["error"]["type"] == "timeout"


@pytest.mark.parametrize("lean", [True, False], ids=["http1", "aiohttp"])
async def test_a_stream_longer_than_the_timeout_runs_while_d_streams_and_is_cut_when_d_stalls(lean, monkeypatch):
    """router.request_timeout bounds a stream's head and each silence, not its length (issue 45: a long stream
    still steadily streaming was cut at request_timeout and counted against D's breaker)."""
    from pdserve.router.legs import http1
    monkeypatch.setattr(http1, "AVAILABLE", lean)
    async with deployment(decode_args=(["--token-delay", "0.15"],), request_timeout=0.5) as dep:
        status, lines = await dep.stream(CHAT, {**HI, "max_tokens": 8})     # ~1.2 s of tokens
        assert status == 200 and lines[-1] == b"data: [DONE]\n" and b'"error"' not in b"".join(lines), lines
        assert sum(b"delta" in line for line in lines) == 8 and breaker_failures(dep, "decode") == 0
        dep.decode[0][FAKE].args.done_delay = 1.5                         # then silent past the timeout
        status, lines = await dep.stream(CHAT, HI)
        assert status == 200 and b"TimeoutError" in lines[-2] and lines[-1] == b"data: [DONE]\n", lines
        assert breaker_failures(dep, "decode") == 1


async def test_client_fault_answers_do_not_open_the_breaker():
    async with deployment(prefill_args=(["--status", "500", "--error-type", "BadRequestError"],)) as dep:
        for _ in range(6):
            status, data = await dep.post(CHAT, HI)
            assert status == 500 and data["error"]["type"] == "BadRequestError"
        assert breaker_failures(dep, "prefill") == 0
        assert len(dep.prefill[0][FAKE].received) == 6       # never shut out
        dep.prefill[0][FAKE].args.status = 400
        for _ in range(4):
            assert (await dep.post(CHAT, HI))[0] == 400
        assert breaker_failures(dep, "prefill") == 0
        dep.prefill[0][FAKE].args.status = 200
        assert (await dep.post(CHAT, HI))[0] == 200


async def test_upstream_connections_are_capped_and_reused():
    # The ids echoed, as by the servers pdserve runs: a backend that echoes none gets a connection a request
    async with deployment(prefill_args=(["--delay", "0.05", "--request-id-headers"],), upstream_max_connections=4,
                          upstream_max_per_backend=3) as dep:
        results = await asyncio.gather(*(dep.post(CHAT, HI) for _ in range(30)))
        assert all(status == 200 for status, _ in results)
        p = dep.prefill[0][FAKE]
        assert p.max_in_flight <= 3
        assert len({r["peer"] for r in p.received}) <= 3      # kept-alive connections, reused


async def test_waiting_for_a_pooled_connection_is_the_routers_fault_not_the_backends():
    async with deployment(prefill_args=(["--delay", "1"],), upstream_max_per_backend=1,
                          upstream_pool_timeout=0.2) as dep:
        results = await asyncio.gather(*(dep.post(CHAT, HI) for _ in range(4)))
        statuses = sorted(status for status, _ in results)
        assert statuses == [200, 503, 503, 503]
        assert all("router busy" in d["error"]["message"] for s, d in results if s == 503)
        assert breaker_failures(dep, "prefill") == 0
        assert sample(await dep.metrics(), 'pdserve_router_busy_total{reason="pool_wait"}') == 3


async def test_router_out_of_descriptors_is_not_blamed_on_the_backend():
    async with deployment() as dep:
        upstream = dep.router[FLOW].upstream
        real = upstream.session.post

        def emfile(*args, **kwargs):
            raise aiohttp.ClientOSError(errno.EMFILE, "Too many open files")

        async def emfile_lean(*args, **kwargs):   # the lean JSON client (router/legs/http1.py) lets it through raw
            raise OSError(errno.EMFILE, "Too many open files")

        upstream.session.post = emfile
        lean = upstream.client
        if lean is not None:
            lean.post = emfile_lean
        try:
            for _ in range(5):
                status, data = await dep.post(CHAT, HI)
                assert status == 503 and "out of resources" in data["error"]["message"]
        finally:
            upstream.session.post = real
            if lean is not None:
                del lean.post
        assert breaker_failures(dep, "prefill") == 0 and breaker_failures(dep, "decode") == 0
        assert (await dep.post(CHAT, HI))[0] == 200


async def test_degraded_mode_serves_on_p_while_d_is_down_and_on_d_while_p_is_down():
    async with deployment(health_interval=0.05) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        flow = dep.router[FLOW]
        d.healthy = False                                   # D fails its probes: down
        for _ in range(60):
            if flow.decode.backends[0].down:
                break
            await asyncio.sleep(0.02)
        received = len(d.received)
        status, data = await dep.post(CHAT, {**HI, "max_tokens": 3, "conversation_id": "c"})
        assert status == 200 and data["choices"][0]["message"]["content"] == "w0 w1 w2"
        assert "kv_transfer_params" not in p.received[-1]["body"] and p.received[-1]["body"]["max_tokens"] == 3
        status, lines = await dep.stream(CHAT, {**HI, "max_tokens": 3})
        assert status == 200 and lines[-1] == b"data: [DONE]\n" and len(lines) == 4
        assert len(d.received) == received and len(flow.store) == 0      # nothing remembered
        d.healthy = True
        p.healthy = False
        for _ in range(60):
            if flow.prefill.pool.backends[0].down and not flow.decode.backends[0].down:
                break
            await asyncio.sleep(0.02)
        received = len(p.received)
        status, data = await dep.post(CHAT, HI)
        assert status == 200 and "kv_transfer_params" not in d.received[-1]["body"]
        assert len(p.received) == received
        p.healthy = True
        for _ in range(60):
            if not flow.prefill.pool.backends[0].down:
                break
            await asyncio.sleep(0.02)
        status, _ = await dep.post(CHAT, HI)                 # normal P->D again
        assert status == 200 and p.received[-1]["body"]["max_tokens"] == 1
        assert d.received[-1]["body"]["kv_transfer_params"]["do_remote_prefill"] is True
        m = await dep.metrics()
        assert sample(m, 'pdserve_router_degraded_requests_total{served_by="prefill"}') == 2
        assert sample(m, 'pdserve_router_degraded_requests_total{served_by="decode"}') == 1
        assert sample(m, 'pdserve_router_degraded{missing="decode"}') == 0


async def test_a_leg_that_fails_before_the_client_saw_anything_is_served_whole_by_the_other_role():
    """A server killed mid-request (its connection closes unanswered) or failing with a 5xx of its own
    loses no request: nothing reached the client yet, so the other role serves it whole (degraded)."""
    for role_args, served_by in (({"decode_args": (["--drop-connection"],)}, "prefill"),
                                 ({"decode_args": (["--status", "500"],)}, "prefill"),
                                 ({"prefill_args": (["--drop-connection"],)}, "decode")):
        async with deployment(**role_args) as dep:
            status, data = await dep.post(CHAT, {**HI, "max_tokens": 3})
            assert status == 200 and data["choices"][0]["message"]["content"] == "w0 w1 w2", (role_args, data)
            status, lines = await dep.stream(CHAT, {**HI, "max_tokens": 3})
            assert status == 200 and lines[-1] == b"data: [DONE]\n", (role_args, lines)
            m = await dep.metrics()
            assert sample(m, f'pdserve_router_degraded_requests_total{{served_by="{served_by}"}}') == 2


async def test_a_client_fault_5xx_from_d_is_passed_through_not_retried_elsewhere():
    async with deployment(decode_args=(["--status", "500", "--error-type", "BadRequestError"],)) as dep:
        status, data = await dep.post(CHAT, HI)
        assert status == 500 and data["error"]["type"] == "BadRequestError"
        assert sample(await dep.metrics(), 'pdserve_router_degraded_requests_total{served_by="prefill"}') == 0


async def test_a_server_back_before_the_next_probe_gets_the_request_not_degraded_mode():
    """The supervisor saw a restarted D healthy and said so; the router's last probe (up to an interval
    ago) still says down. The request must reach D, or the turn leaves no blocks on D to reuse."""
    async with deployment(health_interval=60) as dep:            # no scheduled probe during the test
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        backend = dep.router[FLOW].decode.backends[0]
        backend.record_probe(False, refused=True)                  # what the probe saw while D restarted
        assert backend.down
        received = len(d.received)
        status, _ = await dep.post(CHAT, {**HI, "conversation_id": "back"})
        assert status == 200 and len(d.received) == received + 1      # served through D, P->D as usual
        assert d.received[-1]["body"]["kv_transfer_params"]["do_remote_prefill"] is True
        assert not backend.down and len(dep.router[FLOW].store) == 1     # D's blocks are remembered
        m = await dep.metrics()
        assert sample(m, 'pdserve_router_degraded_requests_total{served_by="prefill"}') == 0

        d.healthy = False                                          # really down: degraded, and quickly
        backend.record_probe(False, refused=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _ = await dep.post(CHAT, HI)
        assert status == 200 and loop.time() - started < 2
        assert sample(await dep.metrics(), 'pdserve_router_degraded_requests_total{served_by="prefill"}') == 1
        assert len(p.received) >= 2
