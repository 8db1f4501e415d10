"""The router's lean HTTP/1.1 client (router/http1.py) against a real aiohttp server on loopback: keep-alive
reuse, chunked and sized bodies, the pool bound, and how each failure is told apart."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest
from aiohttp import web

from pdserve.router.http1 import ConnectFailed, Disconnected, Http1Client, PoolTimeout


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
