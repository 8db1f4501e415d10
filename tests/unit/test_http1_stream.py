"""The lean client's streamed answers (Http1Client.stream, the D leg's since issue 31): the body handed on as it
arrives, the connection kept only after a whole answer, bounded (time, buffered bytes, connections), and each
failure told apart as aiohttp's were."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.legs.http1 import STREAM_HIGH_WATER, Disconnected, Http1Client, PoolTimeout
from tests.kits.raw_server import raw_server

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_all(client: Http1Client, url: str, body: bytes = b"{}", timeout: float = 5, **kw) -> tuple:
    pieces = []
    async with client.stream(url, "/v1/chat/completions", body, kw.pop("headers", {}), timeout, **kw) as resp:
        async for data in resp.content.iter_any():
            pieces.append(data)
        return resp.status, resp.content_type, pieces


async def test_a_stream_is_handed_on_as_it_arrives_and_its_connection_kept_after_a_whole_answer():
    gate = asyncio.Event()

    async def answer(writer, n, body, head):
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n"))
        await writer.drain()
        await gate.wait()                          # the client has the first events before the rest is sent
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    server, url, peers = await raw_server(answer)
    client = Http1Client(4)
    try:
        async with client.stream(url, "/v1/chat/completions", b"{}", {}, 5) as resp:
            assert (resp.status, resp.content_type, resp.content_length) == (200, "text/event-stream", None)
            it = resp.content.iter_any()
            first = await it.__anext__()
            assert first == b"data: 1\n\ndata: 2\n\n"          # all that came, as one piece
            gate.set()
            assert [d async for d in it] == [b"data: [DONE]\n\n"]
        for _ in range(2):
            status, _, pieces = await read_all(client, url)
            assert status == 200 and b"".join(pieces) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert len(peers) == 1                     # one kept-alive connection for the three
    finally:
        await client.close()
        server.close()


async def test_a_stream_left_before_its_end_closes_its_connection():
    async def answer(writer, n, body, head):
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    server, url, peers = await raw_server(answer)
    client = Http1Client(4)
    try:
        async with client.stream(url, "/a", b"{}", {}, 5) as resp:
            async for _ in resp.content.iter_any():
                break                              # the client went away
        pool = client.stream_pools[url]
        assert pool.open == 0 and not pool.idle
        assert b"".join((await read_all(client, url))[2]).endswith(b"[DONE]\n\n") and len(peers) == 2
    finally:
        await client.close()
        server.close()


async def test_what_came_before_a_broken_stream_is_handed_on_then_the_break():
    async def answer(writer, n, body, head):
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        return False                               # dies mid-answer

    server, url, _ = await raw_server(answer)
    client = Http1Client(4)
    try:
        got = []
        with pytest.raises(Disconnected):
            async with client.stream(url, "/a", b"{}", {}, 5) as resp:
                async for data in resp.content.iter_any():
                    got.append(data)
        assert got == [b"data: 1\n\n"] and client.stream_pools[url].open == 0
    finally:
        await client.close()
        server.close()


async def test_a_close_delimited_stream_ends_at_the_close_and_interim_answers_are_skipped():
    async def answer(writer, n, body, head):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
                     b"data: 1\n\n")
        await writer.drain()
        writer.write(b"data: [DONE]\n\n")
        return False

    server, url, _ = await raw_server(answer)
    client = Http1Client(4)
    try:
        status, ctype, pieces = await read_all(client, url)
        assert (status, ctype, b"".join(pieces)) == (200, "text/event-stream", b"data: 1\n\ndata: [DONE]\n\n")
    finally:
        await client.close()
        server.close()


async def test_a_stream_that_keeps_sending_runs_past_the_timeout_and_one_that_stalls_is_cut():
    """The timeout bounds the head and each silence, not the stream (issue 45: a long stream still steadily
    streaming was cut at request_timeout and counted against D's breaker)."""
    async def answer(writer, n, body, head):
        writer.write(SSE_HEAD)
        for _ in range(30):                        # events 20 ms apart for 0.6 s, then silence
            writer.write(chunk(b"data: x\n\n"))
            await writer.drain()
            await asyncio.sleep(0.02)
        await asyncio.sleep(10)

    server, url, _ = await raw_server(answer)
    client = Http1Client(4)
    pieces: list[bytes] = []
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.TimeoutError):
            async with client.stream(url, "/v1/chat/completions", b"{}", {}, 0.3) as resp:
                async for data in resp.content.iter_any():
                    pieces.append(data)
        took = asyncio.get_running_loop().time() - started
        assert b"".join(pieces).count(b"data: x") == 30 and 0.85 < took < 2, took
        assert client.stream_pools[url].open == 0
    finally:
        await client.close()
        server.close()


async def test_a_reader_that_does_not_keep_up_stops_the_socket_not_the_memory():
    sent = 0

    async def answer(writer, n, body, head):
        nonlocal sent
        writer.write(SSE_HEAD)
        for _ in range(400):                       # 25 MiB, as fast as the socket takes it
            writer.write(chunk(b"x" * 65536))
            await writer.drain()
            sent += 65536
        writer.write(b"0\r\n\r\n")

    server, url, _ = await raw_server(answer)
    client = Http1Client(4)
    try:
        async with client.stream(url, "/a", b"{}", {}, 30) as resp:
            it = resp.content.iter_any()
            got = len(await it.__anext__())
            await asyncio.sleep(0.3)               # a slow client: D is held back by the socket
            conn = resp._conn
            assert conn.paused and conn.size < STREAM_HIGH_WATER + 4 * 65536 + 512 * 1024
            assert sent < 400 * 65536
            async for data in it:
                got += len(data)
        assert got == 400 * 65536
    finally:
        await client.close()
        server.close()


async def test_streams_wait_for_their_own_connection_bound_apart_from_json_calls():
    release = asyncio.Event()

    async def answer(writer, n, body, head):
        if body == b"json":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
            return
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await release.wait()
        writer.write(b"0\r\n\r\n")

    server, url, _ = await raw_server(answer)
    client = Http1Client(1)
    client.budget_streams(limit=1, limit_per_host=4)
    try:
        first = asyncio.create_task(read_all(client, url))
        await asyncio.sleep(0.05)
        assert (await client.post(url, "/a", b"json", {}, 5))[0] == 200     # JSON calls have their own pool
        with pytest.raises(PoolTimeout):
            await read_all(client, url, pool_timeout=0.1)                     # the one stream slot is taken
        release.set()
        assert (await first)[0] == 200
        assert (await read_all(client, url))[0] == 200
    finally:
        await client.close()
        server.close()
