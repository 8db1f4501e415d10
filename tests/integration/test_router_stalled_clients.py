"""Issue 45, item 4: no client holds what it does not use. Real sockets against the real router (fake vLLM
behind it): a client that stops reading its stream (a small receive buffer, never read), or sends its body
a byte a second, while other clients keep sending requests; and the router's buffers bounded in all."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import aiohttp

from pdserve.observe.routerstats import parse_metrics
from tests.kits.metric_text import sample
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BOB = {"Authorization": "Bearer bob"}


async def post(dep, body=BODY, path=CHAT, headers=BOB):
    async with dep.session.post(dep.url + path, json=body, headers=headers) as resp:
        return resp.status, resp.headers.get("Retry-After"), await resp.json(content_type=None)


def raw_client(dep, path: str, body: bytes, send: int | None = None) -> socket.socket:
    """A socket that sent the request head and `send` bytes of `body` (all of it by default), with a 4 KiB
    receive buffer and never a read: what a client that stopped looks like to the router."""
    host, port = urlsplit(dep.url).hostname, urlsplit(dep.url).port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer stalled\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body[:len(body) if send is None else send])
    return sock


async def wait_for(dep, check, tries: int = 100):
    for _ in range(tries):
        text = await dep.metrics()
        if check(text):
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(text)


async def test_clients_that_stop_reading_their_streams_lose_their_slots():
    """Issue 45: 8 sockets that stopped reading held every admission slot for 50 s (over 3x request_timeout),
    every other client waiting. Each now loses its slot once it has read nothing for client_stall_timeout
    (body_timeout here, 1 s): its connection is closed, its D request dropped, its turn client_gone."""
    stream = json.dumps({**BODY, "stream": True, "max_tokens": 100000}).encode()
    async with deployment(decode_args=(["--endless-events"],), max_in_flight=2, queue_size=8, queue_timeout=8,
                          body_timeout=1) as dep:
        stalled = [raw_client(dep, CHAT, stream) for _ in range(2)]
        await wait_for(dep, lambda t: sample(t, "pdserve_router_admission_in_flight") == 2)
        results = await asyncio.gather(*(post(dep) for _ in range(6)))     # queued behind the stalled two
        assert [s for s, _, _ in results] == [200] * 6, results
        text = await wait_for(dep, lambda t: parse_metrics(t)["turn_outcomes"].get("client_gone") == 2)
        stats = parse_metrics(text)
        assert stats["turns"] == 8 and stats["turn_outcomes"]["client_gone"] == 2
        assert sample(text, 'pdserve_router_connections_dropped_total{reason="write_stalled"}') == 2
        assert sum(stats["admission"].values()) == 8
        assert sample(text, "pdserve_router_admission_in_flight") == 0
        assert sample(text, "pdserve_router_buffered_bytes") == 0
        for sock in stalled:
            sock.close()


async def test_a_client_sending_its_body_a_byte_a_second_holds_no_slot():
    """Issue 45: a half-sent body held its slot until body_timeout, every other client queued behind it. The
    body is now read before the slot is taken: the others are served while it trickles, then it gets its 408."""
    body = json.dumps(BODY).encode()
    async with deployment(max_in_flight=1, queue_size=4, queue_timeout=1, body_timeout=4) as dep:
        slow = raw_client(dep, CHAT, body, send=10)

        async def trickle():
            for byte in body[10:20]:
                await asyncio.sleep(1.0)
                await asyncio.get_running_loop().sock_sendall(slow, bytes([byte]))
        slow.setblocking(False)
        sending = asyncio.create_task(trickle())
        await asyncio.sleep(0.3)
        statuses = [s for s, _, _ in await asyncio.gather(*(post(dep) for _ in range(3)))]
        statuses += [(await post(dep))[0] for _ in range(2)]
        assert statuses == [200] * 5
        answer = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(slow, 4096), 10)
        assert answer.startswith(b"HTTP/1.1 408")
        sending.cancel()
        slow.close()
        stats = parse_metrics(await dep.metrics())
        adm = stats["admission"]                              # the trickled body never took a slot
        assert set(adm) <= {"admitted", "queued"} and sum(adm.values()) == 5, adm
        assert stats["turns"] == 6 and stats["turn_outcomes"]["failed"] == 1


async def test_past_the_routers_buffer_bound_a_new_request_gets_503_in_its_api_shape():
    """Issue 45: each body and answer was bounded, their sum not (6 concurrent 31 MB streams took the router
    from 44 to 542 MB). With 512 KiB of buffers, one body of 400 KiB arrived (its last bytes not yet) leaves no
    room for a second of 200 KiB: 503 with Retry-After in the OpenAI or Anthropic shape, counted; a small
    request still fits, and once the big one is served there is room again."""
    big = json.dumps({**BODY, "messages": [{"role": "user", "content": "x" * 420_000}]}).encode()
    medium = [{"role": "user", "content": "y" * 200_000}]
    async with deployment(max_buffered_mb=0.5) as dep:
        slow = raw_client(dep, CHAT, big, send=len(big) - 5)
        await wait_for(dep, lambda t: sample(t, "pdserve_router_buffered_bytes") >= 400_000)
        status, retry, chat = await post(dep, {**BODY, "messages": medium})
        assert status == 503 and retry == "1" and chat["error"]["type"] == "server_overloaded", chat
        assert "max_buffered_mb" in chat["error"]["message"]
        status, retry, msg = await post(dep, {"model": "fake", "max_tokens": 4, "messages": medium}, "/v1/messages")
        assert status == 503 and retry == "1" and msg["type"] == "error" and msg["error"]["type"] == "overloaded_error"
        assert (await post(dep))[0] == 200                       # a small one fits
        slow.sendall(big[-5:])
        answer = await asyncio.to_thread(slow.recv, 4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
        slow.close()
        assert (await post(dep, {**BODY, "messages": medium}))[0] == 200
        text = await wait_for(dep, lambda t: sample(t, "pdserve_router_buffered_bytes") == 0)
        assert sample(text, f'pdserve_router_buffer_refused_total{{route="{CHAT}"}}') == 1
        assert sample(text, 'pdserve_router_buffer_refused_total{route="/v1/messages"}') == 1
        stats = parse_metrics(text)
        assert stats["turns"] == 5 and stats["turn_outcomes"]["failed"] == 2


async def test_a_client_that_never_reads_a_large_whole_answer_is_dropped():
    """A whole answer is written by the router within client_stall_timeout, charged while it is: before, a
    client that never read one held its bytes with no end (aiohttp has no write timeout)."""
    async with deployment(decode_args=(["--huge-body", str(8 << 20)],), body_timeout=1) as dep:
        sock = raw_client(dep, CHAT, json.dumps(BODY).encode())
        text = await wait_for(dep, lambda t: sample(
            t, 'pdserve_router_connections_dropped_total{reason="write_stalled"}') == 1)
        assert sample(text, "pdserve_router_buffered_bytes") == 0
        sock.close()
        async with aiohttp.ClientSession() as fresh:               # others still served
            async with fresh.post(dep.url + CHAT, json=BODY) as resp:
                # the whole answer: D's 8 MiB less the few bytes of its handles and separators (compact JSON)
                assert resp.status == 200 and len(await resp.read()) >= (8 << 20) - 1024
