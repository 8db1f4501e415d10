"""Health probes: ready means the health endpoint answers 200 (a managed Redis, `redis://HOST:PORT`: PONG to
a PING, or NOAUTH: it answers, behind its password), never "alive N seconds"."""

from __future__ import annotations

import socket
import urllib.error
import urllib.parse
import urllib.request


def probe(url: str, timeout: float = 2.0) -> bool:
    if url.startswith("redis://"):
        return redis_ping(url, timeout)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def redis_ping(url: str, timeout: float = 2.0) -> bool:
    where = urllib.parse.urlsplit(url)
    try:
        with socket.create_connection((where.hostname or "127.0.0.1", where.port or 6379), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            # NOAUTH: Redis answers, behind its password (the managed one's), which the probe need not know
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
