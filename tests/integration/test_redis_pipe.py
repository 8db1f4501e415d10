"""RedisPipe (the reuse store's per-turn connection) against a real redis-server: replies matched to their
commands in order, an error reply failing only its command, and a stalled or killed Redis failing what was in
flight at once (never a caller waiting past the timeout) with the next command on a fresh connection."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from pdserve.router.kv.redis_pipe import RedisPipe
from tests.kits.redis_rig import RedisServer


@contextlib.asynccontextmanager
async def pipe_to(server: RedisServer, timeout: float):
    client = aioredis.Redis.from_url(server.url)
    pipe = RedisPipe(client, timeout)
    try:
        yield pipe
    finally:
        await pipe.close()
        await client.aclose()


async def test_replies_come_back_to_their_own_commands_in_order(redis_server):
    async with pipe_to(redis_server, 1.0) as pipe:
        sent = [await pipe.send("ECHO", f"reply-{i}") for i in range(200)]     # all in flight at once
        failing = await pipe.send("EVAL", "return redis.error_reply('boom')", 0)
        after = await pipe.send("ECHO", "still fine", then=lambda r: r.upper())
        assert await asyncio.gather(*sent) == [f"reply-{i}".encode() for i in range(200)]
        with pytest.raises(ResponseError, match="boom"):
            await failing
        assert await after == b"STILL FINE"                 # an error reply is its command's alone


async def test_a_stalled_redis_fails_what_is_in_flight_within_the_timeout_and_the_pipe_recovers(redis_server):
    async with pipe_to(redis_server, 0.3) as pipe:
        assert await (await pipe.send("PING")) == b"PONG"
        redis_server.pause()
        try:
            started = time.monotonic()
            stuck = [await pipe.send("ECHO", str(i)) for i in range(5)]
            outcomes = await asyncio.gather(*stuck, return_exceptions=True)
            took = time.monotonic() - started
        finally:
            redis_server.resume()
        assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
        assert took < 2, took
        assert await (await pipe.send("ECHO", "back")) == b"back"


async def test_a_killed_redis_fails_what_is_in_flight_and_a_restarted_one_is_reconnected(redis_server):
    async with pipe_to(redis_server, 1.0) as pipe:
        assert await (await pipe.send("SET", "k", "v")) == b"OK"
        redis_server.pause()
        in_flight = await pipe.send("GET", "k")
        redis_server.kill()
        with pytest.raises((ConnectionError, OSError, RedisConnectionError)):
            await in_flight
        with pytest.raises((ConnectionError, OSError, RedisConnectionError)):
            await pipe.send("GET", "k")                      # nothing to connect to: raised at once
        redis_server.start()
        assert await (await pipe.send("GET", "k")) is None  # a new, empty Redis on the same port


async def test_a_redis_that_accepts_but_never_answers_fails_the_connect_within_the_timeout(redis_server):
    """SIGSTOP before the first command: the kernel still accepts the connection, the handshake gets no
    reply. The pipe has no socket timeout of redis-py's, so its connect carries its own bound."""
    async with pipe_to(redis_server, 0.3) as pipe:
        redis_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises((TimeoutError, asyncio.TimeoutError)):
                await pipe.send("PING")
            assert time.monotonic() - started < 2
        finally:
            redis_server.resume()
        assert await (await pipe.send("PING")) == b"PONG"


async def test_a_reply_due_on_a_lost_connection_is_never_given_to_a_call_on_the_next_one(redis_server):
    """redis-py closes a connection on an error before the pipe's reader has seen it; a call sent right
    then goes out on a new connection. The old connection's failure fails only its own calls, and every
    later reply still goes to its own command (before: the new call failed with the old connection, its
    reply stayed on the new socket, and each later call got the reply of the one before it)."""
    async with pipe_to(redis_server, 2.0) as pipe:
        assert await (await pipe.send("PING")) == b"PONG"
        redis_server.pause()
        lost = await pipe.send("ECHO", "lost")
        await pipe.channel.conn.disconnect()          # as redis-py does on an error
        redis_server.resume()
        fresh = await pipe.send("ECHO", "fresh")
        outcomes = await asyncio.gather(lost, fresh, return_exceptions=True)
        assert isinstance(outcomes[0], Exception) and outcomes[1] == b"fresh", outcomes
        assert [await (await pipe.send("ECHO", w)) for w in ("one", "two")] == [b"one", b"two"]


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conns: list) -> None:
    """A RESP peer that answers +OK to every command but HELLO (redis-py then speaks RESP2)."""
    conns.append(writer)
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, ValueError):
        while True:
            count = int((await reader.readline())[1:])      # *N
            args = [(await reader.readexactly(int((await reader.readline())[1:]) + 2))[:-2] for _ in range(count)]
            writer.write(b"-ERR unknown command\r\n" if args[0].upper() == b"HELLO" else b"+OK\r\n")
            await writer.drain()


async def test_a_connection_reset_while_idle_is_not_used_again():
    """A peer gone with a reset (a Redis killed with a command unread: its kernel answers RST, not FIN) leaves
    the idle connection's reader holding the error, not at its end: the next call went out on that socket,
    failed, and took the store down (tests/integration/test_router_store_redis.py's restart, now and then)."""
    conns: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: _answer_ok(r, w, conns), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}")
    pipe = RedisPipe(client, 1.0)
    try:
        assert await (await pipe.send("PING")) == b"OK"
        for writer in conns:       # SO_LINGER 0: close() sends RST
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        await asyncio.sleep(0.2)   # the reset reaches the idle connection
        assert await (await pipe.send("PING")) == b"OK"    # on a new connection
        assert len(conns) == 2
    finally:
        await pipe.close()
        await client.aclose()
        server.close()
