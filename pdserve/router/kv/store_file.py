"""The memory store kept across a router restart: written on a drained stop, read back by the next router.

A drained stop (SIGTERM: `down`, `restart`, `up` applying a change) writes every live entry of the memory table
to `router.reuse_file` (the cluster folder's REUSE_FILE, plan/routers.py) atomically (a sibling file, fsync,
rename; mode 0600). The next router reads it before it listens and removes it, so a later crash can never
bring back entries the file held (they are single use: once taken, D frees their blocks). Nothing is written
periodically: a killed router (SIGKILL, OOM) loses its entries, as before; a snapshot written while turns run
would hold entries taken since, which only D's list below keeps from being offered, for I/O every few seconds
on every router to save a rare case.

What is read back is checked, never trusted:
- the file must be this format, version and cluster, at most MAX_FILE_FACTOR x reuse_max_bytes (the table it
  came from is bounded by reuse_max_entries and reuse_max_bytes), and valid JSON; else it is ignored with a
  log line (a corrupt or foreign file never stops the router);
- each entry must meet the shared store's schema (store_entry.readable) and name a decode server of this config;
- expiry is written as wall-clock time (the monotonic clock is the process's own): an entry whose expiry passed
  while no router ran is dropped;
- D must still hold it: each decode server's held-KV list (GET /pdserve/held) names the request ids it holds
  and its engine id. An entry D no longer holds (P read it, D's timer freed it) or from another engine (D
  restarted since: the handles are of its previous process) is dropped; a D that does not answer the list
  (down, no control routes) gets none of its entries back.
Entries come back into the table through its put (in expiry order), so the held-KV ledger (held.py) learns
them as it learns new turns: it leases, renews and releases them from then on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.router.kv.reuse import ReuseEntry
from pdserve.router.kv.store_entry import readable
from pdserve.router.kv.store_memory import MemoryTable

log = logging.getLogger("pdserve.router")

FORMAT = "pdserve-reuse-store"
VERSION = 1
MAX_FILE_FACTOR = 4          # JSON holds token ids in ~6 bytes against the table's 8: 4x is room to spare
LIST_TIMEOUT_S = 5.0         # D's held-KV list at start: a D that does not answer in time gets nothing back

Key = tuple[str, str]


@dataclass
class Saved:
    key: Key
    decode: str
    params: dict[str, Any]
    sequence: list[int] | None
    alias: Key | None
    expires_wall: float
    used_wall: float | None = None       # its last use (held.py's lease renews what was used within held_kv_lease)
    continued: bool = False              # its conversation came back (the lease keeps only those)


def save(table: MemoryTable, path: str | Path, cluster: str, used: Callable[[ReuseEntry], float | None] = lambda e: None,
         clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> int:
    """Write the table's live entries (`used`: an entry's last use on `clock`, where known); returns how many.
    Raises OSError when the file cannot be written."""
    now, now_wall = clock(), wall()

    def when(t: float | None) -> float | None:
        return None if t is None else now_wall + (t - now)
    entries = [{"key": list(key), "decode": e.decode, "params": e.params, "alias": list(e.alias) if e.alias else None,
                "sequence": list(e.sequence) if e.sequence is not None else None,
                "expires": when(e.expires), "used": when(used(e)), "continued": e.continued}
               for key, e in table.entries() if e.expires > now]
    data = {"format": FORMAT, "version": VERSION, "cluster": cluster, "written": now_wall, "entries": entries}
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")      # 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(entries)


def load(path: str | Path, cluster: str, max_bytes: int, decodes: list[str],
         wall: Callable[[], float] = time.time) -> tuple[list[Saved], int]:
    """The entries of a file a drained router left (the file removed once read), and how many had expired.
    Nothing (logged) when it is absent, too large, unreadable, corrupt or not this cluster's."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], 0
    except OSError as err:
        log.warning("reuse store file %s: %s: ignored", path, err)
        return [], 0
    try:
        if size > MAX_FILE_FACTOR * max_bytes + (1 << 20):
            raise ValueError(f"{size} bytes, above {MAX_FILE_FACTOR} x reuse_max_bytes")
        data = json.loads(path.read_bytes())
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} file of version {VERSION}")
        if data.get("cluster") != cluster:
            raise ValueError(f"written for cluster {data.get('cluster')!r}, not {cluster!r}")
        if not isinstance(data.get("entries"), list):
            raise ValueError("no list of entries")
        out, expired, now = [], 0, wall()
        for raw in data["entries"]:
            saved = _entry(raw, decodes)
            if saved is None:
                continue
            if saved.expires_wall <= now:
                expired += 1
            else:
                out.append(saved)
        return out, expired
    except (OSError, ValueError, RecursionError) as err:    # JSON's errors and UnicodeDecodeError are ValueErrors
        log.warning("reuse store file %s ignored (nothing restored): %s", path, err)
        return [], 0
    finally:
        path.unlink(missing_ok=True)


def _entry(raw: Any, decodes: list[str]) -> Saved | None:
    """One entry of the file, or None when it is not one (or names a decode server this router lacks)."""
    if not isinstance(raw, dict):
        return None
    key, alias, seq, expires, used = (raw.get(f) for f in ("key", "alias", "sequence", "expires", "used"))
    if not (_key(key) and (alias is None or _key(alias)) and raw.get("decode") in decodes
            and readable(raw.get("params")) and _time(expires) and (used is None or _time(used))
            and (seq is None or (isinstance(seq, list) and all(type(t) is int for t in seq)))):
        return None
    return Saved(tuple(key), raw["decode"], raw["params"], seq, tuple(alias) if alias else None, float(expires),
                 None if used is None else float(used), raw.get("continued") is True)


def _time(t: Any) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)


def _key(k: Any) -> bool:
    return isinstance(k, list) and len(k) == 2 and all(isinstance(s, str) for s in k)


async def still_held(saved: list[Saved], ask: Callable[[str], Awaitable[tuple[int, Any]]]) -> list[Saved]:
    """The entries their decode server still holds, from the same engine (its held-KV list)."""
    out = []
    for decode in sorted({s.decode for s in saved}):
        try:
            status, answer = await asyncio.wait_for(ask(decode), LIST_TIMEOUT_S)
        except (asyncio.TimeoutError, OSError) as err:
            status, answer = 0, str(err) or "no answer"
        if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("held"), list):
            log.warning("reuse store file: decode server %s did not list what it holds (HTTP %s): none of its "
                        "entries restored", decode, status)
            continue
        engine = answer.get("engine_id")
        held = {h.get("request_id") for h in answer["held"]
                if isinstance(h, dict) and (h.get("remaining_s") or 0) > 0}
        out += [s for s in saved if s.decode == decode and s.params.get("remote_request_id") in held
                and (engine is None or s.params.get("remote_engine_id") in (None, engine))]
    return out


def restore(table: MemoryTable, saved: list[Saved], generation: Callable[[str], int],
            used: Callable[[ReuseEntry, float], None] = lambda e, t: None,
            clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> int:
    """Put the entries back, soonest expiry first (the table's order), each with its own expiry on this
    process's clock and its decode server's generation now; `used(entry, t)` is told each one's last use
    (the held-KV ledger's, else a restored entry would count as used at the restart)."""
    now, now_wall = clock(), wall()
    for s in sorted(saved, key=lambda s: s.expires_wall):
        entry = table.put(s.key, s.params, s.decode, generation(s.decode), s.sequence, s.alias,
                          expires=now + (s.expires_wall - now_wall), continued=s.continued)
        if s.used_wall is not None:
            used(entry, now + (min(s.used_wall, now_wall) - now_wall))
    return len(saved)
