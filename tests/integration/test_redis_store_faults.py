"""Issue 35, items 5, 9 and 11 against a real redis-server: what one request or one crafted Redis value can do
to the shared store. A non-UTF-8 session header, an entry of the wrong shape or type, a wrong-type key under
an entry, alias, index or engine key: refused for that entry (a miss), never a 500 and never the store marked
down for every client; a full Redis under `noeviction` refuses puts without taking the store down; a history
of thousands of messages asks Redis for a bounded number of keys."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis

from pdserve.router.kv.store_redis import MAX_CANDIDATES
from tests.kits.metric_text import reuse_hits
from tests.kits.redis_rig import PARAMS, store_at
from tests.kits.redis_rig import RedisServer
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
# A generous store_timeout where a test is about what Redis holds, not about time: a loaded CI box once took
# over the 0.25 s default for one take, which marks the store down.
LOADED = 5.0


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
    store = store_at(redis_server.url, timeout=LOADED, errors=errors)
    try:
        key = ("t", "id:sess\udcff\udc80")        # what aiohttp makes of the bytes ff 80 (surrogateescape)
        assert await (await store.put(key, PARAMS, "decode-0", 0, [1, 2], alias=("t", "prompt:\udcfe")))
        entry, why = await store.take_first([key])
        assert why == "ok" and list(entry.sequence) == [1, 2]
        assert errors == [] and store.up
    finally:
        await store.close()
    async with deployment(store=redis_server.url, store_timeout=LOADED) as dep:
        messages: list = []
        for i in range(3):
            body = {"model": "fake", "messages": messages + [{"role": "user", "content": f"turn {i} " * 20}],
                    "max_tokens": 4}
            status, data = await raw_post(dep.url, CHAT, body, b"X-Session-ID: s\xff\xfe")
            assert status == 200, data
            messages = body["messages"] + [json.loads(data)["choices"][0]["message"]]
        m = await dep.metrics()
        assert 'pdserve_router_store_up{store="redis"} 1.0' in m and "pdserve_router_store_errors_total{" not in m, m
        assert reuse_hits(m) == 2                          # both follow-ups found their entry


def value(params, decode: bytes = b"decode-0", tokens: bytes = b"", s: bool = False) -> bytes:
    return decode + b"\n" + json.dumps({"p": params, "s": s}).encode() + b"\n" + tokens


CRAFTED = {      # what a take of each must refuse, each as an entry of its own (before: 500s, or a failed script)
    "params a list": value([1, 2]),
    "params a string": value("x"),
    "no params": b"decode-0\n" + json.dumps({"s": False}).encode() + b"\n",
    "header not an object": b"decode-0\n[1]\n",
    "tokens not a flag": value(PARAMS, s="yes"),
    "token count a string": value({**PARAMS, "remote_num_tokens": "many"}),
    "token count negative": value({**PARAMS, "remote_num_tokens": -5}),
    "token count a bool": value({**PARAMS, "remote_num_tokens": True}),
    "blocks an object": value({**PARAMS, "remote_block_ids": {"a": 1}}),
    "blocks of strings": value({**PARAMS, "remote_block_ids": [["1", "2"]]}),
    "blocks empty": value({**PARAMS, "remote_block_ids": []}),
    "request id a number": value({**PARAMS, "remote_request_id": 7}),
    "port a string": value({**PARAMS, "remote_port": "1"}),
    "expiry not finite": b"decode-0\n" + b'{"p": {"remote_block_ids": [1], "remote_blocks_expiry_time": NaN}, "s": false}\n',
    "a constant JSON lacks": b"decode-0\n" + b'{"p": {"remote_block_ids": [1], "x": Infinity}, "s": false}\n',
    "decode not UTF-8": value(PARAMS, decode=b"\xffdecode"),
    "decode empty": value(PARAMS, decode=b""),
    "decode with a control byte": value(PARAMS, decode=b"decode\x01-0"),
    "tokens cut mid-id": value(PARAMS, tokens=b"\1\0\0\0\2\0", s=True),
    "no newline at all": b"garbage",
    "JSON broken": b"decode-0\n{\"p\": \n",
}


async def test_crafted_entries_are_refused_one_by_one_and_the_store_stays_up(redis_server):
    errors: list = []
    store = store_at(redis_server.url, timeout=LOADED, errors=errors)
    raw = aioredis.from_url(redis_server.url)
    try:
        for name, crafted in CRAFTED.items():
            await raw.set(store.inner.key(("t", name)), crafted)
            assert await store.take_first([("t", name)]) == (None, "invalid_entry"), name
        assert errors == [] and store.up, errors
        assert await (await store.put(("t", "good"), PARAMS, "decode-0", 0, [1, 2, 3]))
        entry, why = await store.take_first([("t", "good")])
        assert why == "ok" and entry.params == PARAMS and list(entry.sequence) == [1, 2, 3]
        await raw.set(store.inner.key(("t", "router's own")), value({**PARAMS, "pdserve_expect_token_ids": 5}))
        entry, why = await store.take_first([("t", "router's own")])       # only the router sets them, per turn
        assert why == "ok" and entry.params == PARAMS
    finally:
        await store.close()
        await raw.aclose()


async def test_keys_of_another_type_fail_no_script_and_no_put_and_aliases_stay_in_their_namespace(redis_server):
    """Before: a list under an entry key failed the take's script (the store marked down), and an alias could
    name any key of the Redis (read and deleted)."""
    errors: list = []
    store = store_at(redis_server.url, timeout=LOADED, errors=errors)
    raw = aioredis.from_url(redis_server.url)
    try:
        await raw.rpush(store.inner.key(("t", "a list")), "x")
        await raw.hset(store.inner.key(("t", "a hash")), "f", "v")
        await raw.set("victim", value(PARAMS))                              # another program's key
        await raw.set(store.inner.key(("t", "alias out")), b"\0victim")
        await raw.set(store.inner.key(("t", "alias to a list")), b"\0" + store.inner.key(("t", "a list")).encode())
        assert await store.take_first([("t", "a list"), ("t", "a hash")]) == (None, "invalid_entry")
        assert await store.take_first([("t", "alias out")]) == (None, "no_entry")
        assert await raw.get("victim") == value(PARAMS)                     # neither read nor deleted
        assert await store.take_first([("t", "alias to a list")]) == (None, "invalid_entry")
        await raw.set(store.inner.key(("t", "next")), b"\0")                # an alias naming nothing
        assert await store.take_first([("t", "a list"), ("t", "next")]) == (None, "invalid_entry")
        assert errors == [] and store.up, errors
    finally:
        await store.close()
        await raw.aclose()


async def test_a_damaged_index_or_engine_key_fails_no_put_refresh_or_drop(redis_server):
    """Before: a hash under a decode server's index failed every put on that server, the refresh and the drop,
    each marking the store down (reuse off for good); a new engine id deleted whatever keys its index named."""
    errors: list = []
    store = store_at(redis_server.url, timeout=LOADED, errors=errors)
    raw = aioredis.from_url(redis_server.url)
    try:
        await raw.set("victim", value(PARAMS))                              # another program's key
        await raw.hset("pdserve:t:idx:decode-0", "f", "v")                  # the index of decode-0
        await raw.rpush("pdserve:t:eng:decode-1", "e0")                     # the engine key of decode-1
        await raw.zadd("pdserve:t:idx:decode-1", {"victim": 1e18})          # an index naming a foreign key
        for decode in ("decode-0", "decode-1"):
            assert await (await store.put(("t", decode), PARAMS, decode, 0, [1])), decode
            entry, why = await store.take_first([("t", "other"), ("t", decode)])
            assert why == "ok" and entry.decode == decode
        assert await (await store.put(("t", "x"), {**PARAMS, "remote_engine_id": "e2"}, "decode-1", 0, [1]))
        assert await raw.get("victim") == value(PARAMS)                     # a new engine drops its own entries only
        await raw.hset("pdserve:t:idx:decode-0", "f", "v")
        await store.refresh()                                               # counts around a damaged index
        assert await store.drop_decode("decode-0") == 0
        assert errors == [] and store.up, errors
    finally:
        await store.close()
        await raw.aclose()


async def test_an_entry_rewritten_with_wrong_types_is_a_miss_not_a_500(redis_server):
    """Before: 500s for the turns that took such an entry."""
    async with deployment(store=redis_server.url, store_timeout=LOADED) as dep:
        raw = aioredis.from_url(redis_server.url)
        try:
            history: list = []
            for i in range(4):
                body = {"model": "fake", "messages": history + [{"role": "user", "content": f"turn {i} " * 20}],
                        "max_tokens": 4, "conversation_id": "c"}
                async with dep.session.post(dep.url + CHAT, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    data = await resp.json()
                history = body["messages"] + [data["choices"][0]["message"]]
                for key in await raw.keys("pdserve:*:e:*"):            # every entry stored: damaged
                    holder, header, tokens = (await raw.get(key)).split(b"\n", 2)
                    meta = json.loads(header)
                    meta["p"]["remote_num_tokens"] = ["x"] if i % 2 else "x"
                    await raw.set(key, holder + b"\n" + json.dumps(meta).encode() + b"\n" + tokens)
            m = await dep.metrics()
        finally:
            await raw.aclose()
        assert 'pdserve_router_reuse_decisions_total{api="chat",reason="invalid_entry",result="miss"} 3.0' in m, m
        assert 'pdserve_router_store_up{store="redis"} 1.0' in m and 'outcome="failed"' not in m


async def test_a_full_redis_under_noeviction_refuses_puts_without_taking_the_store_down(tmp_path):
    """Before: Redis's OOM error reply to a put marked the store down: every take for the next second was
    `store_unavailable` (the issue's hit rate of 19%)."""
    server = RedisServer(tmp_path / "full", args=("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")).start()
    errors, evicted = [], []
    store = store_at(server.url, timeout=LOADED, errors=errors)
    store.inner.on_evict = lambda reason, n: evicted.append((reason, n))
    try:
        assert await (await store.put(("t", "kept"), PARAMS, "decode-0", 0, [1, 2]))
        big = list(range(125_000))                       # 500 KB each: Redis is full after a few
        kept = [await (await store.put(("t", f"big{i}"), PARAMS, "decode-0", 0, big)) for i in range(12)]
        entry, why = await store.take_first([("t", "kept")])
        assert why == "ok" and errors == [] and store.up, (why, errors)
        assert any(kept) and not all(kept) and evicted == [("capacity", 1)] * kept.count(False), (kept, evicted)
    finally:
        await store.close()
        server.stop()


async def test_a_take_asks_redis_for_the_longest_histories_only(redis_server):
    """A history of thousands of messages is thousands of candidate keys: Redis is asked for the first
    MAX_CANDIDATES (longest history first) in one script. Before: every key, one script (90 ms of Redis's
    one thread for 150k messages)."""
    store = store_at(redis_server.url, timeout=LOADED)
    try:
        keys = [("t", f"h{i}") for i in range(5000)]
        assert await (await store.put(keys[MAX_CANDIDATES + 10], PARAMS, "decode-0", 0, [1])) is True
        assert await store.take_first(keys) == (None, "no_entry")                 # beyond the bound
        assert await (await store.put(keys[MAX_CANDIDATES - 1], PARAMS, "decode-0", 0, [1])) is True
        assert (await store.take_first(keys))[1] == "ok"
    finally:
        await store.close()
