"""Hostile input (issue 11, points 9, 10, 12): every bad request is an OpenAI-style 4xx, never a 500;
one request is at most one log line; the router counts what it refuses."""

from __future__ import annotations

import asyncio
import gzip
import logging

from pdserve.router.telemetry import logs
from pdserve.router.telemetry.logs import OneLineFormatter
from tests.kits.fake_vllm import FAKE
from tests.kits.metric_text import sample
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


async def _raw(dep, path: str, data: bytes, headers: dict) -> tuple[int, dict]:
    async with dep.session.post(dep.url + path, data=data, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def _is_openai_4xx(status: int, data: dict) -> bool:
    err = data.get("error") if isinstance(data, dict) else None
    return 400 <= status < 500 and isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


async def test_malformed_bodies_and_headers_get_4xx_not_500():
    json_ct = {"Content-Type": "application/json"}
    cases = [
        (b"[" * 100_000 + b"]" * 100_000, json_ct),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, json_ct),
        (b'{"model": "fake", "messages": [' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"]}", json_ct),
        (b'{"model": "fake", "messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}', json_ct),
        (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}]}',
         {"Content-Type": "application/json; charset=bogus"}),
        (b'{"model": "fake", "messages": "hi"}', json_ct),
        (b'{"model": "fake", "messages": [5]}', json_ct),
        (b'{"model": "fake", "messages": [{"role": "user", "content": 5}]}', json_ct),
        (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', json_ct),
        (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', json_ct),
        (b'{"model": "fake", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', json_ct),
    ]
    async with deployment(api_key="") as dep:
        for body, headers in cases:
            status, data = await _raw(dep, CHAT, body, headers)
            assert _is_openai_4xx(status, data), (body[:60], headers, status, data)
        status, data = await _raw(dep, "/v1/completions", b'{"model": "fake", "prompt": 5}', json_ct)
        assert _is_openai_4xx(status, data)
        assert dep.prefill[0][FAKE].received == []
        # Without an API key, a non-UTF-8 Authorization header is just a tenant like any other.
        status, _ = await _raw(dep, CHAT, b'{"model": "fake", "messages": [{"role": "user", "content": "x"}]}',
                               {"Content-Type": "application/json", "Authorization": "Bearer \xff"})
        assert status == 200
        assert sample(await dep.metrics(), "pdserve_router_internal_errors_total") == 0


async def test_non_utf8_authorization_is_a_401_with_an_api_key():
    async with deployment(api_key="k") as dep:
        status, data = await _raw(dep, CHAT, b'{"messages": []}', {"Authorization": "Bearer \xff"})
        assert status == 401 and data["error"]["code"] == "invalid_api_key"
        m = await dep.metrics_with({"Authorization": "Bearer k"})
        assert sample(m, 'pdserve_router_requests_total{route="/v1/chat/completions",status="401"}') == 1


async def test_compressed_bodies_are_refused_without_inflating_them():
    bomb = gzip.compress(b" " * (64 * 1024 * 1024))        # 64 MiB of spaces in ~64 KiB
    async with deployment() as dep:
        for encoding in ("gzip", "deflate"):
            started = asyncio.get_running_loop().time()
            status, data = await _raw(dep, CHAT, bomb, {"Content-Type": "application/json",
                                                         "Content-Encoding": encoding})
            assert status == 415 and "uncompressed" in data["error"]["message"]
            assert asyncio.get_running_loop().time() - started < 1


async def test_one_request_is_at_most_one_log_line(caplog):
    caplog.set_level(logging.DEBUG)
    async with deployment(api_key="k") as dep:
        forged = "/v1/x%0a2026-01-01 00:00:00 CRITICAL pdserve.router forged%0d%0aline"
        async with dep.session.get(dep.url + forged) as resp:
            assert resp.status == 401
        host, port = dep.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /\x01\nfake CRITICAL line HTTP/1.1\r\nHost: x\r\n\r\n")   # the parser refuses it
        await writer.drain()
        await reader.read()
        writer.close()
        # A handler raising deep inside: its traceback too becomes one line.
        async with dep.session.post(dep.url + "/v1/chat/%0a%0dforged",
                                    headers={"Authorization": "Bearer k"}) as resp:
            assert resp.status in (404, 405)
    formatter = OneLineFormatter("%(levelname)s %(name)s %(message)s")
    lines = [formatter.format(r) for r in caplog.records]
    assert lines and all("\n" not in line and "\r" not in line for line in lines)
    assert not any(line.startswith("CRITICAL") or "Traceback" in line for line in lines
                   if "aiohttp.server" in line)


def test_formatter_keeps_tracebacks_on_one_line():
    formatter = OneLineFormatter("%(message)s")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "on %s", ("/p\nCRITICAL forged",),
                                   exc_info=__import__("sys").exc_info())
    line = formatter.format(record)
    assert "\n" not in line and line.startswith("on /p\\nCRITICAL forged | Traceback")


async def test_a_lone_surrogate_is_a_400_that_never_reaches_a_backend_and_a_failed_turn():
    json_ct = {"Content-Type": "application/json"}
    async with deployment() as dep:
        for content in (rb"a\ud800b", rb"\udfff", rb"x\uD83D"):
            status, data = await _raw(dep, CHAT, b'{"model": "fake", "messages": [{"role": "user", "content": "'
                                      + content + b'"}]}', json_ct)
            assert _is_openai_4xx(status, data) and data["error"]["param"] == "messages", data
        assert not dep.prefill[0][FAKE].received and not dep.decode[0][FAKE].received
        assert 'pdserve_router_turns_total{api="chat",outcome="failed"} 3.0' in await dep.metrics()
        # A pair (an escaped emoji) and an escaped backslash before "ud800" are valid text.
        for content in (rb"\ud83d\ude00", rb"\\ud800"):
            status, _ = await _raw(dep, CHAT, b'{"model": "fake", "messages": [{"role": "user", "content": "'
                                   + content + b'"}]}', json_ct)
            assert status == 200


async def test_a_surrogate_sent_as_raw_utf8_bytes_is_a_400_too_streamed_or_not():
    """Issue 45: Python's JSON parser decodes bytes with surrogatepass, so a surrogate sent as its UTF-8 bytes
    (ED A0 80, no backslash escape for the raw scan to find) passed the check; in a conversation id the router
    then failed storing the turn (UnicodeEncodeError: a 500, or a stream cut and counted against D)."""
    json_ct = {"Content-Type": "application/json"}
    async with deployment() as dep:
        for field, value in (("conversation_id", b'"a\xed\xa0\x80b"'), ("prompt_cache_key", b'"\xed\xbf\xbf"'),
                             ("messages", b'[{"role": "user", "content": "x\xed\xa0\xbd\xed\xb8\x80"}]')):
            for stream in (b"false", b"true"):
                body = (b'{"model": "fake", "max_tokens": 4, "stream": ' + stream + b', "messages": '
                        b'[{"role": "user", "content": "hi"}], "' + field.encode() + b'": ' + value + b'}')
                status, data = await _raw(dep, CHAT, body, json_ct)
                assert _is_openai_4xx(status, data) and data["error"]["param"] == field, (field, status, data)
        assert not dep.prefill[0][FAKE].received and not dep.decode[0][FAKE].received
        m = await dep.metrics()
        assert 'pdserve_router_turns_total{api="chat",outcome="failed"} 6.0' in m
        assert "pdserve_router_internal_errors_total 0.0" in m


async def test_a_huge_body_is_parsed_checked_and_hashed_off_the_event_loop(monkeypatch):
    """Issue 25, point 4: the pure-Python passes over a 13 MB body stalled every other client for seconds."""
    import threading
    from pdserve.router import identity
    from pdserve.router.api import inputs
    threads = {}

    def spy(name, real):
        def wrapped(*args):
            threads[name] = threading.current_thread() is threading.main_thread()
            return real(*args)
        return wrapped

    monkeypatch.setattr(inputs, "checked", spy("checked", inputs.checked))
    monkeypatch.setattr(identity, "history", spy("history", identity.history))
    async with deployment() as dep:
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}] * 30_000, "max_tokens": 1}
        assert (await dep.post(CHAT, body))[0] == 200
        assert threads == {"checked": False, "history": False}
        threads.clear()
        assert (await dep.post(CHAT, {"model": "fake", "messages": MSG, "max_tokens": 1}))[0] == 200
        assert threads == {"checked": True, "history": True}      # small ones stay on the loop: no hop


async def test_a_client_s_kv_transfer_params_inside_vllm_xargs_never_reach_a_backend():
    """Issue 45: vLLM copies vllm_xargs into the request's extra args, where its connector reads
    kv_transfer_params when the body has none at top level (a degraded turn, count_tokens): a client's then
    steered the engine's KV transfer (another tenant's block ids) or failed it (a non-object: a 500)."""
    forged = {"do_remote_prefill": True, "remote_block_ids": [[0, 1]], "remote_engine_id": "someone-else"}
    body = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 40}],
            "vllm_xargs": {"kv_transfer_params": forged, "session_id": "xargs-conv", "other": 1}}
    async with deployment() as dep:
        assert (await dep.post(CHAT, body))[0] == 200                         # P then D
        dep.prefill[0][FAKE].args.status = 503                              # then degraded: D alone
        for _ in range(4):
            assert (await dep.post(CHAT, {**body, "vllm_xargs": {**body["vllm_xargs"], "kv_transfer_params": "x"}}
                                   ))[0] == 200
        dep.prefill[0][FAKE].args.status = 200
        await dep.post("/v1/messages/count_tokens", {"model": "fake", "messages": body["messages"],
                                                     "vllm_xargs": body["vllm_xargs"]})
        sent = [r["body"] for app in dep.prefill + dep.decode for r in app[FAKE].received]
        assert len(sent) >= 6 and all(r.get("vllm_xargs") == {"session_id": "xargs-conv", "other": 1} for r in sent)
        assert sample(await dep.metrics(), 'pdserve_router_turn_plans_total{plan="degraded"}') >= 1


async def test_anonymous_clients_on_different_hosts_never_continue_each_other_s_conversations():
    """Issue 45: clients that send no credentials shared one tenant, so one could name another's conversation
    (or send its history) and have P read that conversation's blocks (131 tokens pulled in the fuzz round)."""
    import aiohttp
    from tests.kits.metric_text import reuse_hits
    first = {"model": "fake", "max_tokens": 4, "conversation_id": "guessable",
             "messages": [{"role": "user", "content": "alpha " * 60}]}
    async with deployment() as dep:
        status, data = await dep.post(CHAT, first)
        assert status == 200
        follow = {**first, "messages": [*first["messages"], data["choices"][0]["message"],
                                        {"role": "user", "content": "beta " * 5}]}
        other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))      # another host, no key
        async with aiohttp.ClientSession(connector=other) as elsewhere:
            async with elsewhere.post(dep.url + CHAT, json=follow) as resp:
                assert resp.status == 200 and int(resp.headers.get("X-PDServe-Pulled-Tokens") or 0) == 0
        assert reuse_hits(await dep.metrics()) == 0
        async with dep.session.post(dep.url + CHAT, json=follow) as resp:     # its own client still reuses
            assert resp.status == 200 and int(resp.headers["X-PDServe-Pulled-Tokens"]) > 0
        assert reuse_hits(await dep.metrics()) == 1


def test_formatter_writes_the_time_as_logging_does():
    """The router's log time is made once a second (logs.OneLineFormatter.formatTime): the text is logging's
    own for every record, across second boundaries and with a date format given."""
    ours, theirs = OneLineFormatter(logs.FORMAT), logging.Formatter(logs.FORMAT)
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    for created in (1_764_800_000.0, 1_764_800_000.999, 1_764_800_001.0005, 1_764_799_999.5, 1.25, 1_764_800_000.5):
        record.created, record.msecs = created, (created - int(created)) * 1000 // 1 + 0.0
        assert ours.formatTime(record) == theirs.formatTime(record)
        assert ours.formatTime(record, "%H:%M") == theirs.formatTime(record, "%H:%M")
