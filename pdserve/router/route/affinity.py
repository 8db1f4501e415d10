"""Prefill policy `affinity`: keep each conversation on one prefill server, so that P's own prefix cache
holds its history (the sticky-session baseline that `pdserve bench` compares D->P reuse with).

The conversation's anchor is stable across its turns: its root session when the client names one (a
subagent's parent session: siblings and their parent share one P, whose prefix cache holds what they share;
identity.root_session), else the explicit id, else a hash of the tenant and the history up to the first user
message (automatic detection's keys change every turn, so they cannot anchor). Under `least_loaded` a named
root session is preferred too, softly (`home`, within the pool's pin slack). Rendezvous hashing ranks the servers per anchor: adding or removing one
server moves only the conversations that ranked it first. When that server is unusable (down, breaker
open, or already tried for this request), the request goes to the least-loaded usable one instead.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.router.config import AFFINITY
from pdserve.router.identity import Key
from pdserve.router.route.backends import Backend, Pool

__all__ = ["AFFINITY", "anchor", "root_anchor", "ranked", "home", "pick"]    # AFFINITY: the policy's name (router/config.py), for flow.py


def root_anchor(tenant: str, root: str | None) -> str | None:
    """The anchor of a named root session (per tenant), or None."""
    return None if root is None else tenant + "\0root\0" + root


def anchor(explicit: Key | None, tenant: str, messages: list[Any] | None, root: str | None = None) -> str | None:
    """What identifies the conversation on every turn, or None (nothing to pin: least-loaded)."""
    if root is not None:
        return root_anchor(tenant, root)
    if explicit is not None:
        return "\0".join(explicit)
    if not messages:
        return None
    first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    if first_user is None:
        return None
    opening = json.dumps(messages[: first_user + 1], sort_keys=True, default=str)
    return tenant + "\0" + hashlib.sha256(opening.encode()).hexdigest()


def ranked(key: str, names: list[str]) -> list[str]:
    """Rendezvous (highest random weight) order of `names` for `key`."""
    def weight(name: str) -> bytes:
        # surrogatepass: a session id from a header holds surrogate escapes of its non-UTF-8 bytes
        return hashlib.blake2b(f"{key}\0{name}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return sorted(names, key=weight, reverse=True)


def home(pool: Pool, key: str | None) -> str | None:
    """The server `key` ranks first (None: no key, or no server)."""
    if key is None or not pool.backends:
        return None
    return ranked(key, [b.name for b in pool.backends])[0]


def pick(pool: Pool, key: str | None, exclude: set[str]) -> Backend | None:
    """The conversation's own server while it is usable; otherwise least-loaded among the rest."""
    own = pool.by_name(home(pool, key) or "")
    if own and own.name not in exclude and own.healthy and own.breaker.allows():
        return own
    return pool.pick(exclude=exclude)
