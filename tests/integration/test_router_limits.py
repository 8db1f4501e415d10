"""Slow and idle clients are cut off (issue 11, point 7): real sockets against the router."""

from __future__ import annotations

import asyncio
import json

from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open that long."""
    try:
        async with asyncio.timeout(seconds):
            return await reader.read()
    except TimeoutError:
        return None


async def test_slowloris_head_is_cut_off_within_the_header_timeout():
    async with deployment(header_timeout=0.5, idle_timeout=30) as dep:
        reader, writer = await asyncio.open_connection(*_hostport(dep.url))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        started = asyncio.get_running_loop().time()

        async def trickle() -> None:
            for byte in head:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)

        dripping = asyncio.create_task(trickle())
        try:
            assert await _closed_within(reader, 3) is not None
            assert asyncio.get_running_loop().time() - started < 1.5
        finally:
            dripping.cancel()
            writer.close()


async def test_a_body_that_never_ends_gets_a_408_within_the_body_timeout():
    async with deployment(body_timeout=0.5) as dep:
        reader, writer = await asyncio.open_connection(*_hostport(dep.url))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
        await writer.drain()
        answer = await _closed_within(reader, 3)
        writer.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 408")
        assert b'"code": 408' in answer and b"Connection: close" in answer


async def test_legitimate_requests_pass_while_slow_clients_fill_the_connection_cap():
    async with deployment(max_connections=6, header_timeout=30, idle_timeout=30) as dep:
        host, port = _hostport(dep.url)
        slow = []
        for _ in range(10):     # more slow clients than the cap
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")   # head never completed
            await writer.drain()
            slow.append(writer)
        await asyncio.sleep(0.1)
        try:
            for _ in range(3):
                async with asyncio.timeout(3):
                    status, _ = await dep.post(CHAT, json.loads(BODY))
                assert status == 200
        finally:
            for w in slow:
                w.close()
