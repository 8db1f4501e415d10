"""Issue 35, items 5, 9 and 11 against a real redis-server: what one request or one crafted Redis value can do
to the shared store. A non-UTF-8 session header, an entry of the wrong shape or type, a wrong-type key under
an entry, alias, index or engine key: refused for that entry (a miss), never a 500 and never the store marked
down for every client; a full Redis under `noeviction` refuses puts without taking the store down; a history
of thousands of messages asks Redis for a bounded number of keys."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.rediskit import RedisServer
from tests.integration.routerkit import deployment
from tests.integration.test_router_store_redis import PARAMS, _hits, store_at

CHAT = "/v1/chat/completions"


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


async def raw_post(url: str, path: str, body: dict, header: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request with a header line as raw bytes (aiohttp's client sends only valid text)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + header + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)
    await writer.drain()
    response = await reader.read()
    writer.close()
    status = int(response.split(b" ", 2)[1])
    return status, response.split(b"\r\n\r\n", 1)[1]


async def test_a_non_utf8_session_header_is_a_conversation_like_any_other_and_the_store_stays_up(redis_server):
    """Before: encoding the Redis key raised inside the guarded take, marking the store down for everyone."""
    errors: list = []
    store = store_at(redis_server.url, errors=errors)
    try:
        key = ("t", "id:sess\udcff\udc80")        # what aiohttp makes of the bytes ff 80 (surrogateescape)
        assert await (await store.put(key, PARAMS, "decode-0", 0, [1, 2], alias=("t", "prompt:\udcfe")))
        entry, why = await store.take_first([key])
        assert why == "ok" and list(entry.sequence) == [1, 2]
        assert errors == [] and store.up
    finally:
        await store.close()
    async with deployment(store=redis_server.url) as dep:
        messages: list = []
        for i in range(3):
            body = {"model": "fake", "messages": messages + [{"role": "user", "content": f"turn {i} " * 20}],
                    "max_tokens": 4}
            status, data = await raw_post(dep.url, CHAT, body, b"X-Session-ID: s\xff\xfe")
            assert status == 200, data
            messages = body["messages"] + [json.loads(data)["choices"][0]["message"]]
        m = await dep.metrics()
        assert 'pdserve_router_store_up{store="redis"} 1.0' in m and "pdserve_router_store_errors_total{" not in m, m
        assert _hits(m) == 2                          # both follow-ups found their entry
