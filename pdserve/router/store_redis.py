"""The shared reuse store: entries in Redis (`router.store: redis://HOST:PORT/DB`, or `managed`), through
redis-py's asyncio client. Every router replica sees the same entries, and a router restart loses none.

- Keys name no conversation: `pdserve:<cluster>:e:<sha256(tenant, conversation)>` (the tenant is already a
  hash of the credentials; a conversation id is hashed here too).
- Single use: a take is one Lua script over the candidate keys: the first that exists is read and deleted
  (GETDEL) in the same atomic step, so two concurrent turns never both get an entry. An entry's second key
  (its prompt's) holds a NUL and the entry's Redis key: taking it takes the entry, if it is still there (an
  alias left after its entry was taken finds nothing and expires with the entry's TTL).
- Expiry in Redis: SET ... PX reuse_ttl; an expired entry is simply gone (a `no_entry` miss).
- Bounded memory: an entry is at most MAX_ENTRY_BYTES (token ids as 4-byte ints after a JSON header); the
  whole is bounded by Redis's `maxmemory` (a managed Redis gets reuse_max_mb with `volatile-ttl`: the
  entries nearest their expiry go first, as the memory store's oldest-first). A given Redis without a
  maxmemory is said once in the log.
- Per decode server, a sorted set of its entry keys (scored by expiry) and the engine id of its last entry:
  a new engine id (D restarted) or D seen down drops that server's handles for every replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve.router.redis_pipe import RedisPipe
from pdserve.router.reuse import ReuseEntry
from pdserve.router.store import kept

log = logging.getLogger("pdserve.router")

MAX_ENTRY_BYTES = 4 * 1024 * 1024
# KEYS: entry, decode's index, decode's engine key[, alias]; ARGV: value, ttl ms, engine id
PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dropped = 0
local engine = redis.call('GET', KEYS[3])
if engine and engine ~= ARGV[3] then
  local old = redis.call('ZRANGE', KEYS[2], 0, -1)
  for i = 1, #old do dropped = dropped + redis.call('DEL', old[i]) end
  redis.call('DEL', KEYS[2])
end
redis.call('SET', KEYS[3], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[4] then redis.call('SET', KEYS[4], '\0' .. KEYS[1], 'PX', ARGV[2]) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return dropped
"""
# KEYS: candidate entries, longest history first: the first that exists (itself, or the entry an alias names)
# is read and deleted, and leaves its decode server's index (the value's first line names the server);
# ARGV: the index keys' prefix. An entry taken by its alias is returned after a NUL.
TAKE_FIRST = """
for i = 1, #KEYS do
  local key = KEYS[i]
  local v = redis.call('GETDEL', key)
  local via = ''
  if v and string.byte(v, 1) == 0 then
    key = string.sub(v, 2)
    v = redis.call('GETDEL', key)
    via = '\\0'
  end
  if v then
    redis.call('ZREM', ARGV[1] .. string.sub(v, 1, string.find(v, '\\n', 1, true) - 1), key)
    return via .. v
  end
end
return false
"""
# KEYS: decode's index; entries it lists are deleted
DROP = """
local keys = redis.call('ZRANGE', KEYS[1], 0, -1)
local n = 0
for i = 1, #keys do n = n + redis.call('DEL', keys[i]) end
redis.call('DEL', KEYS[1])
return n
"""


class RedisStore:
    remote = True
    turn_calls_bounded = True     # put and take: by the pipe (GuardedStore adds no timeout of its own)

    def __init__(self, url: str, *, ttl: float, max_bytes: int, cluster: str, decodes: list[str], timeout: float,
                 on_evict: Callable[[str, int], None]):
        self.ttl_ms = max(1, int(ttl * 1000))
        self.prefix = f"pdserve:{cluster}:"
        self.decodes = decodes
        self.on_evict = on_evict
        self.max_bytes = max_bytes
        # No retries inside the client: a failed call is answered at once (the caller recomputes) and the next
        # call takes a fresh connection. GuardedStore bounds every call: no socket timeout per read on top.
        self.client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                                              health_check_interval=0)
        # A turn's put and take: one pipelined connection (redis_pipe.py); the rest through the client's pool.
        # EVAL with the script's text: Redis caches it by its hash, and a Redis restarted (its cache empty)
        # needs no reload.
        self.pipe = RedisPipe(self.client, timeout)
        self._drop = self.client.register_script(DROP)
        self.entries = 0
        self.used = 0
        self.checked_bound = False

    def __len__(self) -> int:
        return self.entries

    @property
    def bytes(self) -> int:
        return self.used

    def key(self, key: tuple[str, str]) -> str:
        """Defined for every str: a session header's non-UTF-8 bytes arrive as lone surrogates (aiohttp's
        surrogateescape), which plain UTF-8 refuses. Before (issue 35, item 5) that raised inside the guarded
        take and marked the store down for every client."""
        tenant, conversation = key
        raw = f"{tenant}\0{conversation}".encode("utf-8", "surrogatepass")
        return self.prefix + "e:" + hashlib.sha256(raw).hexdigest()[:40]

    async def put(self, key: tuple[str, str], params: dict[str, Any], decode: str, generation: int,
                  sequence: list[int] | None = None, alias: tuple[str, str] | None = None) -> asyncio.Future[bool]:
        value = encode(params, decode, sequence)
        if len(value) > MAX_ENTRY_BYTES:
            self.on_evict("capacity", 1)
            return kept(True)    # kept nowhere, by the bound: not the store's failure
        engine = str(params.get("remote_engine_id"))
        keys = [self.key(key), self.prefix + "idx:" + decode, self.prefix + "eng:" + decode]
        if alias is not None:
            keys.append(self.key(alias))
        return await self.pipe.send("EVAL", PUT, len(keys), *keys, value, self.ttl_ms, engine,
                                    then=lambda dropped: _put_replied(dropped, decode))

    async def take_first(self, keys: list[tuple[str, str]]) -> tuple[ReuseEntry | None, str]:
        value = await (await self.pipe.send("EVAL", TAKE_FIRST, len(keys), *[self.key(k) for k in keys],
                                            self.prefix + "idx:"))
        if not value:
            return None, "no_entry"
        by_prompt = value[:1] == b"\0"
        entry = decode_entry(value[1:] if by_prompt else value)
        if entry is None:
            return None, "no_entry"
        entry.by_prompt = by_prompt
        return entry, "ok"

    async def drop_decode(self, decode: str) -> int:
        return int(await self._drop(keys=[self.prefix + "idx:" + decode]))

    async def refresh(self) -> None:
        """Health, and len/bytes for the gauges: live entries by the decode indexes, bytes as Redis's
        used_memory (the whole server's)."""
        now_ms = int(time.time() * 1000)
        async with self.client.pipeline(transaction=False) as pipe:
            for d in self.decodes:
                pipe.zcount(self.prefix + "idx:" + d, now_ms, "+inf")
            pipe.info("memory")
            *counts, memory = await pipe.execute()
        self.entries = sum(int(c) for c in counts)
        self.used = int(memory.get("used_memory", 0))
        if not self.checked_bound:
            self.checked_bound = True
            if not int(memory.get("maxmemory", 0) or 0):
                log.warning("the Redis of router.store has no maxmemory: reuse entries are bounded only by their "
                            "TTL; set maxmemory (%d MiB fits reuse_max_mb) with maxmemory-policy volatile-ttl",
                            self.max_bytes // 2**20)

    async def close(self) -> None:
        await self.pipe.close()
        await self.client.aclose()


def _put_replied(dropped: int, decode: str) -> bool:
    if dropped:
        log.info("decode %s has a new engine id: dropped %d of its old handles", decode, dropped)
    return True


def encode(params: dict[str, Any], decode: str, sequence: list[int] | None) -> bytes:
    """A JSON header (D's params, the holder) and the token ids as 4-byte little-endian ints: ~4 bytes a token,
    against ~6 as JSON numbers."""
    tokens = b""
    if sequence is not None:
        try:
            packed = array("i", sequence)
            if sys.byteorder == "big":
                packed.byteswap()
            tokens = packed.tobytes()
        except (TypeError, OverflowError):
            sequence = None    # not token ids: stored without, nothing will be verified against it
    header = json.dumps({"p": params, "s": sequence is not None}, separators=(",", ":"))
    return decode.encode() + b"\n" + header.encode() + b"\n" + tokens


def decode_entry(value: bytes) -> ReuseEntry | None:
    decode, _, rest = value.partition(b"\n")      # the holder; decode names have no newline (the schema's)
    header, _, tokens = rest.partition(b"\n")     # JSON escapes newlines: the first one ends the header
    try:
        meta = json.loads(header)
        sequence = None
        if meta.get("s"):
            sequence = array("i")
            sequence.frombytes(tokens)
            if sys.byteorder == "big":
                sequence.byteswap()
        # generation None: replicas count a backend's restarts each their own way; the engine id check and
        # drop_decode (both shared) stand for it.
        return ReuseEntry(meta["p"], decode.decode(), None, float("inf"), sequence, len(value))
    except (ValueError, KeyError, TypeError):
        log.warning("a reuse entry in Redis could not be read: ignored")
        return None
