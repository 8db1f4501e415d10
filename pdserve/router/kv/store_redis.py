"""The shared reuse store: entries in Redis (`router.store: redis://HOST:PORT/DB`, or `managed`), through
redis-py's asyncio client. Every router replica sees the same entries, and a router restart loses none.

- Keys name no conversation: `pdserve:<cluster>:<deployment>:e:<sha256(tenant, conversation)>` (the tenant is
  already a hash of the credentials; a conversation id is hashed here too). The deployment id keeps two
  deployments on one Redis apart, even of one name (`own_params`: issue 35, item 10).
- Single use: a take is one Lua script over the candidate keys (at most MAX_CANDIDATES): the first that exists
  is read and deleted (GETDEL) in the same atomic step, so two concurrent turns never both get an entry. An entry's second key
  (its prompt's) holds a NUL and the entry's Redis key: taking it takes the entry, if it is still there (an
  alias left after its entry was taken finds nothing and expires with the entry's TTL).
- Expiry in Redis: SET ... PX reuse_ttl; an expired entry is simply gone (a `no_entry` miss).
- Bounded memory: an entry is at most MAX_ENTRY_BYTES (token ids as 4-byte ints after a JSON header); the
  whole is bounded by Redis's `maxmemory` (a managed Redis gets reuse_max_mb with `volatile-ttl`: the
  entries nearest their expiry go first, as the memory store's oldest-first). A given Redis without a
  maxmemory is said once in the log.
- Per decode server, a sorted set of its entry keys (scored by expiry) and the engine id of its last entry:
  a new engine id (D restarted) or D seen down drops that server's handles for every replica.
- What Redis holds is not trusted (issue 35, item 9): an entry is read back only if it meets store_entry.py's
  schema (else that take's miss, `invalid_entry`), and no key of another type fails a script (OWN, TAKE_FIRST).
  A put that a full Redis refuses (OOM under `noeviction`) is that put's loss, not the store's failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, ResponseError

from pdserve.router.kv.redis_pipe import RedisPipe
from pdserve.router.kv.reuse import NO_ENTRY, ReuseEntry
from pdserve.router.kv.store import kept
from pdserve.router.kv.store_entry import INVALID, decode_entry, encode

log = logging.getLogger("pdserve.router")

MAX_ENTRY_BYTES = 4 * 1024 * 1024
# Candidate keys a take asks Redis for, longest history first: a history of 150k messages is as many keys, one
# script over all of them (90 ms of Redis's one thread, issue 35 item 11). The entry a client's next turn needs
# is its previous turn's, the first candidate or two; older ones are found only when the turns after them
# were never stored.
MAX_CANDIDATES = 64
# What Redis holds is not trusted (issue 35, item 9): the scripts use no value as a key outside this store's
# own prefix (ARGV: the entry keys' prefix), and a key of another type than theirs never fails a script: one
# damaged key must never take the store down for every client. The index and engine keys are this store's own:
# one of another type is replaced; an entry or alias key of another type is skipped (reported as invalid).
OWN = """
local function own(key, kind)
  local t = redis.call('TYPE', key).ok
  if t ~= kind and t ~= 'none' then redis.call('DEL', key) end
end
local function drop_listed(index, prefix)
  local n = 0
  for _, k in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    if string.sub(k, 1, #prefix) == prefix then n = n + redis.call('DEL', k) end
  end
  redis.call('DEL', index)
  return n
end
"""
# KEYS: entry, decode's index, decode's engine key[, alias]; ARGV: value, ttl ms, engine id, entry keys' prefix
PUT = OWN + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dropped = 0
own(KEYS[2], 'zset')
own(KEYS[3], 'string')
local engine = redis.call('GET', KEYS[3])
if engine and engine ~= ARGV[3] then dropped = drop_listed(KEYS[2], ARGV[4]) end
redis.call('SET', KEYS[3], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if KEYS[4] then redis.call('SET', KEYS[4], '\\0' .. KEYS[1], 'PX', ARGV[2]) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return dropped
"""
# KEYS: candidate entries, longest history first: the first that exists (itself, or the entry an alias names)
# is read and deleted, and leaves its decode server's index (the value's first line names the server);
# ARGV: the index keys' prefix, the entry keys' prefix. An entry taken by its alias is returned after a NUL;
# nothing found, but a key of another type skipped on the way: a lone \\1 (the store refuses it, a miss).
TAKE_FIRST = """
local skipped = false
for i = 1, #KEYS do
  local key = KEYS[i]
  local v = redis.pcall('GETDEL', key)
  local via = ''
  if type(v) == 'string' and string.byte(v, 1) == 0 then
    key = string.sub(v, 2)
    v = false
    if string.sub(key, 1, #ARGV[2]) == ARGV[2] then
      v = redis.pcall('GETDEL', key)
      via = '\\0'
    end
  end
  if type(v) == 'string' then
    local nl = string.find(v, '\\n', 1, true)
    if nl then redis.pcall('ZREM', ARGV[1] .. string.sub(v, 1, nl - 1), key) end
    return via .. v
  end
  if type(v) == 'table' then skipped = true end
end
if skipped then return '\\1' end
return false
"""
# KEYS: decode's index; ARGV: the entry keys' prefix. The entries it lists are deleted.
DROP = OWN + """
own(KEYS[1], 'zset')
return drop_listed(KEYS[1], ARGV[1])
"""


class RedisStore:
    remote = True
    turn_calls_bounded = True     # put and take: by the pipe (GuardedStore adds no timeout of its own)

    def __init__(self, url: str, *, ttl: float, max_bytes: int, cluster: str, decodes: list[str], timeout: float,
                 on_evict: Callable[[str, int], None]):
        self.ttl_ms = max(1, int(ttl * 1000))
        url, own = own_params(url)
        deployment = own.get("deployment") or (deployment_id(read_secret(own["deployment_file"]))
                                                if own.get("deployment_file") else "")
        self.prefix = f"pdserve:{cluster}:{deployment}:" if deployment else f"pdserve:{cluster}:"
        if not deployment:
            log.warning("router.store names no deployment (?deployment=ID, or ?deployment_file=PATH as pdserve up "
                        "writes): keys are namespaced by the cluster name %r alone, so another deployment of that "
                        "name on this Redis would read and drop this one's entries", cluster)
        password = {"password": read_secret(own["password_file"])} if own.get("password_file") else {}
        self.decodes = decodes
        self.on_evict = on_evict
        self.max_bytes = max_bytes
        # No retries inside the client: a failed call is answered at once (the caller recomputes) and the next
        # call takes a fresh connection. GuardedStore bounds every call: no socket timeout per read on top.
        self.client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                                              health_check_interval=0, **password)
        # A turn's put and take: one pipelined connection (redis_pipe.py); the rest through the client's pool.
        # EVAL with the script's text: Redis caches it by its hash, and a Redis restarted (its cache empty)
        # needs no reload.
        self.pipe = RedisPipe(self.client, timeout)
        self._drop = self.client.register_script(DROP)
        self.entries = 0
        self.used = 0
        self.checked_bound = False
        self.warned_full = False

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
        return await self.pipe.send("EVAL", PUT, len(keys), *keys, value, self.ttl_ms, engine, self.prefix + "e:",
                                    then=lambda dropped: _put_replied(dropped, decode), otherwise=self._refused)

    def _refused(self, err: ResponseError) -> bool:
        """A put's error reply. Redis full under `noeviction` (OOM) refuses writes, not reads: that put is not
        kept (counted as a capacity eviction), and the store stays up for the takes (before: marked down, every
        take for a second `store_unavailable`). Any other error reply is the store's failure."""
        if not isinstance(err, OutOfMemoryError):     # redis-py's name for the reply "OOM ..."
            raise err
        self.on_evict("capacity", 1)
        if not self.warned_full:
            self.warned_full = True
            log.warning("the Redis of router.store is full and evicts nothing (maxmemory-policy noeviction?): "
                        "new turns are not kept until entries expire; set maxmemory-policy volatile-ttl")
        return False

    async def take_first(self, keys: list[tuple[str, str]]) -> tuple[ReuseEntry | None, str]:
        keys = keys[:MAX_CANDIDATES]
        value = await (await self.pipe.send("EVAL", TAKE_FIRST, len(keys), *[self.key(k) for k in keys],
                                            self.prefix + "idx:", self.prefix + "e:"))
        if not value:
            return None, NO_ENTRY
        by_prompt = value[:1] == b"\0"
        entry = decode_entry(value[1:] if by_prompt else value)
        if entry is None:
            return None, INVALID      # refused on its own (store_entry.py): a miss, the store is fine
        entry.by_prompt = by_prompt
        return entry, "ok"

    async def drop_decode(self, decode: str) -> int:
        return int(await self._drop(keys=[self.prefix + "idx:" + decode], args=[self.prefix + "e:"]))

    async def refresh(self) -> None:
        """Health, and len/bytes for the gauges: live entries by the decode indexes, bytes as Redis's
        used_memory (the whole server's)."""
        now_ms = int(time.time() * 1000)
        async with self.client.pipeline(transaction=False) as pipe:
            for d in self.decodes:
                pipe.zcount(self.prefix + "idx:" + d, now_ms, "+inf")
            pipe.info("memory")
            # an index of another type fails its count alone (the next put replaces it), not the refresh
            *counts, memory = await pipe.execute(raise_on_error=False)
        if isinstance(memory, Exception):
            raise memory
        self.entries = sum(int(c) for c in counts if not isinstance(c, Exception))
        self.used = int(memory.get("used_memory", 0))
        if not self.checked_bound:
            self.checked_bound = True
            if not int(memory.get("maxmemory", 0) or 0):
                log.warning("the Redis of router.store has no maxmemory: reuse entries are bounded only by their "
                            "TTL; set maxmemory (%d MiB fits reuse_max_mb) with maxmemory-policy volatile-ttl",
                            self.max_bytes // 2**20)
            elif memory.get("maxmemory_policy") == "noeviction":
                log.warning("the Redis of router.store has maxmemory-policy noeviction: once full, new turns are "
                            "not kept until entries expire; volatile-ttl evicts the entries nearest expiry instead")

    async def close(self) -> None:
        await self.pipe.close()
        await self.client.aclose()


OWN_PARAMS = ("deployment", "deployment_file", "password_file")


def own_params(url: str) -> tuple[str, dict[str, str]]:
    """`router.store`'s own query parameters, taken out of the URL (redis-py refuses names it does not know):
    `deployment=ID`, the namespace of this deployment's keys (every replica of one deployment names the same,
    no other deployment on the Redis does); `deployment_file=PATH`, the id derived from the secret in that
    file (what `pdserve up` writes: read_secret); `password_file=PATH`, the password read from that file (the
    managed Redis's). Values are URL-quoted."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, {}
    own, rest = {}, []
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if name in OWN_PARAMS:
            own[name] = unquote(value)
        elif pair:
            rest.append(pair)
    return (base + "?" + "&".join(rest) if rest else base), own


def read_secret(path: str) -> str:
    """The token of a store secret file: a Redis config line `requirepass TOKEN` (pdserve/state/secret.py makes
    it at `pdserve up`; the managed Redis includes the same file)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"router.store's secret file {path}: {err.strerror} (`pdserve up` makes it; a router "
                         "run by hand can name its deployment with ?deployment=ID instead)") from err
    tokens = [line.split(None, 1)[1].strip() for line in lines if line.startswith("requirepass ")]
    if not tokens or not tokens[-1]:
        raise ValueError(f"router.store's secret file {path} holds no `requirepass TOKEN` line")
    return tokens[-1]


def deployment_id(secret: str) -> str:
    """A one-way hash: the id, in Redis's key names, says nothing of the secret (the managed Redis's password)."""
    return hashlib.sha256(b"pdserve deployment\0" + secret.encode()).hexdigest()[:16]


def _put_replied(dropped: int, decode: str) -> bool:
    if dropped:
        log.info("decode %s has a new engine id: dropped %d of its old handles", decode, dropped)
    return True
