"""The router's lean HTTP/1.1 client (router/legs/http1.py) against a real aiohttp server on loopback: keep-alive
reuse, chunked and sized bodies, the pool bound, and how each failure is told apart."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest
from aiohttp import web

from pdserve.router.legs.http1 import ConnectFailed, Disconnected, Http1Client, PoolTimeout
from tests.kits.raw_server import raw_server


async def serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def test_json_posts_reuse_one_connection_and_read_sized_and_chunked_bodies():
    peers = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername"))
        body = await request.json()
        if request.path == "/chunked":
            out = web.StreamResponse(headers={"Content-Type": "application/json"})
            out.enable_chunked_encoding()
            await out.prepare(request)
            await out.write(b'{"got": ')
            await out.write(str(body["n"]).encode() + b"}")
            await out.write_eof()
            return out
        return web.json_response({"got": body["n"], "auth": request.headers.get("Authorization")}, status=201)

    runner, url = await serve(handler)
    client = Http1Client(4)
    try:
        for n in range(3):
            status, ctype, data = await client.post(url, "/v1/x", b'{"n": %d}' % n, {"Authorization": "Bearer k"}, 5)
            assert (status, ctype) == (201, "application/json") and data == b'{"got": %d, "auth": "Bearer k"}' % n
        assert (await client.post(url, "/chunked", b'{"n": 7}', {}, 5))[2] == b'{"got": 7}'
        assert len(peers) == 1                      # one kept-alive connection for all four
    finally:
        await client.close()
        await runner.cleanup()


async def test_an_idle_connection_past_keepalive_is_not_reused():
    peers = set()

    async def handler(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))
        return web.json_response({})

    runner, url = await serve(handler)
    now = [0.0]
    client = Http1Client(4, keepalive=3.0, clock=lambda: now[0])
    try:
        await client.post(url, "/a", b"{}", {}, 5)
        now[0] += 3.5                               # idle longer than the keep-alive: closed, a new one
        await client.post(url, "/a", b"{}", {}, 5)
        assert len(peers) == 2
    finally:
        await client.close()
        await runner.cleanup()


async def test_the_pool_bound_makes_a_request_wait_and_then_time_out():
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    runner, url = await serve(handler)
    client = Http1Client(1)
    try:
        first = asyncio.create_task(client.post(url, "/a", b"{}", {}, 5))
        await asyncio.sleep(0.1)
        with pytest.raises(PoolTimeout):             # the one connection is busy: the router's shortage
            await client.post(url, "/a", b"{}", {}, 5, pool_timeout=0.2)
        release.set()
        assert (await first)[0] == 200
        assert (await client.post(url, "/a", b"{}", {}, 5, pool_timeout=0.2))[0] == 200
    finally:
        await client.close()
        await runner.cleanup()


async def test_failures_are_told_apart():
    with socket.socket() as s:                       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = Http1Client(2)
    with pytest.raises(ConnectFailed):
        await client.post(dead, "/a", b"{}", {}, 5)

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def hang_up(request: web.Request) -> web.Response:
        request.transport.close()                    # killed mid-request: no answer at all
        await asyncio.sleep(1)
        return web.json_response({})

    for handler, expected in ((slow, asyncio.TimeoutError), (hang_up, Disconnected)):
        runner, url = await serve(handler)
        try:
            with pytest.raises(expected):
                await client.post(url, "/a", b"{}", {}, 0.3)
        finally:
            await runner.cleanup()
    await client.close()


async def test_the_routers_own_shortage_is_raised_as_it_is(monkeypatch):
    loop = asyncio.get_running_loop()

    async def emfile(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(loop, "create_connection", emfile)
    client = Http1Client(2)
    with pytest.raises(OSError) as caught:
        await client.post("http://127.0.0.1:9", "/a", b"{}", {}, 5)
    assert caught.value.errno == errno.EMFILE and not isinstance(caught.value, ConnectFailed)
    assert client.pools["http://127.0.0.1:9"].open == 0      # nothing counted as open after the failure


async def test_a_header_with_a_line_break_is_refused_before_anything_is_sent():
    client = Http1Client(2)
    with pytest.raises(ValueError):
        await client.post("http://127.0.0.1:9", "/a", b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"}, 5)
    assert client.pools["http://127.0.0.1:9"].open == 0


# -- a backend or proxy that misbehaves (issue 35 item 4): a raw server, one scripted answer per request -------

def ok(payload: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (len(payload), extra, payload))


async def test_interim_1xx_answers_are_skipped_and_the_final_answer_is_the_requests_own():
    async def answer(writer, n, body, head):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)                  # the final answer comes a moment later
        writer.write(ok(body))

    server, url, peers = await raw_server(answer)
    client = Http1Client(1)
    try:
        for n in range(4):
            assert await client.post(url, "/a", b'{"n": %d}' % n, {}, 5) == (200, "application/json", b'{"n": %d}' % n)
        assert len(peers) == 1                     # and the connection stayed good to reuse
    finally:
        await client.close()
        server.close()


async def test_a_connection_that_sent_an_unsolicited_answer_is_never_reused():
    async def answer(writer, n, body, head):
        if body == b'{"n": 0}':                    # one answer stuck to the next, one a moment after it
            writer.write(ok(body) + ok(b'{"n": "stray"}'))
        elif body == b'{"n": 2}':
            writer.write(ok(body))
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(ok(b'{"n": "late"}'))
        else:
            writer.write(ok(body))

    server, url, peers = await raw_server(answer)
    client = Http1Client(1)
    try:
        for n in range(5):
            assert (await client.post(url, "/a", b'{"n": %d}' % n, {}, 5))[2] == b'{"n": %d}' % n
            await asyncio.sleep(0.05)
        assert len(peers) == 3                     # a new connection after each stray answer
    finally:
        await client.close()
        server.close()


async def test_a_close_delimited_body_is_read_to_the_close():
    async def answer(writer, n, body, head):
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"whole": ')
        await writer.drain()
        writer.write(body + b"}")
        return False                               # then close: the end of the body

    server, url, _ = await raw_server(answer)
    client = Http1Client(1)
    try:
        for _ in range(2):
            assert await client.post(url, "/a", b"1", {}, 5) == (200, "application/json", b'{"whole": 1}')
    finally:
        await client.close()
        server.close()


async def test_a_kept_alive_connection_the_backend_closed_is_retried_once_on_a_new_one():
    async def answer(writer, n, body, head):
        if body == b'{"n": 1}' and n == 1:
            return False                           # closes the kept-alive connection instead of answering
        writer.write(ok(body))

    server, url, peers = await raw_server(answer)
    client = Http1Client(1)
    try:
        for n in range(3):
            assert (await client.post(url, "/a", b'{"n": %d}' % n, {}, 5))[2] == b'{"n": %d}' % n
        assert len(peers) == 2

        async def never(writer, n, body, head):          # a new connection closed before any answer: no retry
            return False

        server2, url2, peers2 = await raw_server(never)
        with pytest.raises(Disconnected):
            await client.post(url2, "/a", b"{}", {}, 5)
        assert len(peers2) == 1
        server2.close()
    finally:
        await client.close()
        server.close()


class HandleClosed:
    """A transport as uvloop leaves it when the backend went away between two answers: its handle closed, the
    protocol's connection_lost not run yet, so `write` raises RuntimeError."""

    def __init__(self, transport):
        self.transport = transport

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def close(self) -> None:
        self.transport.close()


async def test_a_kept_alive_connection_whose_handle_closed_under_it_is_retried_on_a_new_one():
    # CI: a SIGKILL of decode-0's API server made the router answer a 500 (uvloop's RuntimeError from the write
    # on a pooled connection); the request never left, so it goes once more on a new connection
    async def answer(writer, n, body, head):
        writer.write(ok(body))

    server, url, peers = await raw_server(answer)
    client = Http1Client(1)
    try:
        assert (await client.post(url, "/a", b'{"n": 0}', {}, 5))[2] == b'{"n": 0}'
        conn = client._pool(url).idle[-1]
        conn.transport = HandleClosed(conn.transport)
        assert (await client.post(url, "/a", b'{"n": 1}', {}, 5))[2] == b'{"n": 1}'
        assert len(peers) == 2
        closing = client._pool(url).idle[-1]
        closing.transport.close()          # closing, its connection_lost not run yet: not taken from the pool
        assert (await client.post(url, "/a", b'{"n": 2}', {}, 5))[2] == b'{"n": 2}'
        assert len(peers) == 3
    finally:
        await client.close()
        server.close()


async def test_an_answer_over_the_bound_is_refused_at_once_and_the_connection_closed():
    from pdserve.router.legs.http1 import AnswerTooLarge

    async def answer(writer, n, body, head):
        if body == b"endless":                     # chunked, never ends
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 65536
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 30))   # a 1 GiB answer
        writer.write(b"[" + b"1," * 400_000)

    server, url, _ = await raw_server(answer)
    client = Http1Client(2, max_answer_bytes=512 * 1024)
    try:
        for body in (b"endless", b"big"):
            with pytest.raises(AnswerTooLarge):
                await client.post(url, "/a", body, {}, 5)
        assert client.pools[url].open == 0 and not client.pools[url].idle
    finally:
        await client.close()
        server.close()


async def test_a_stray_answer_naming_another_request_is_skipped_even_after_the_next_request_was_sent():
    """A copy of answer 0 comes 50 ms late, when request 1 is already on the connection: its X-Request-Id (as
    vLLM echoes it with --enable-request-id-headers) is not request 1's, so request 1 reads on to its own."""
    def echo(body: bytes, head: bytes) -> bytes:
        rid = head.lower().split(b"x-request-id: ")[1].split(b"\r\n")[0]
        return ok(body, b"X-Request-Id: %s\r\n" % rid)

    async def answer(writer, n, body, head):
        writer.write(echo(body, head))
        if n == 0:
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(echo(b'{"n": "stray"}', head))

    server, url, peers = await raw_server(answer)
    client = Http1Client(1)
    try:
        first = await client.post(url, "/a", b'{"n": 0}', {"X-Request-Id": "r0"}, 5)
        second = await client.post(url, "/a", b'{"n": 1}', {"X-Request-Id": "r1"}, 5)   # sent at once
        assert (first[2], second[2]) == (b'{"n": 0}', b'{"n": 1}')
        assert (await client.post(url, "/a", b'{"n": 2}', {"X-Request-Id": "r2"}, 5))[2] == b'{"n": 2}'
        assert len(peers) == 2                      # the connection that carried a stray was not kept
    finally:
        await client.close()
        server.close()


async def test_a_backend_that_echoes_no_request_id_gets_a_new_connection_per_request():
    """Issue 45: a copy of answer 0 arriving 50 ms late, when request 1 was already on the kept connection,
    was request 1's answer (3 of 8 on each leg in the fuzz round): without the request id echoed nothing in
    HTTP/1.1 tells the two apart. Such a backend's connections are not kept, so the stray has nowhere to go."""
    async def answer(writer, n, body, head):
        writer.write(ok(body))
        if n == 0:
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(ok(b'{"n": "stray"}'))

    server, url, peers = await raw_server(answer)
    client = Http1Client(1)
    try:
        got = [(await client.post(url, "/a", b'{"n": %d}' % i, {"X-Request-Id": f"r{i}"}, 5))[2] for i in range(3)]
        assert got == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
        assert len(peers) == 3
    finally:
        await client.close()
        server.close()
