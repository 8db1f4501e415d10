"""Health probes: ready means the health endpoint answers 200 (a managed Redis, `redis://HOST:PORT`: PONG to
a PING, or NOAUTH: it answers, behind its password; the MPS control daemon, `mps://PIPE_DIR`: its own client
gets an answer there), never "alive N seconds"."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request

from pdserve.plan.gpu_sharing import HEALTH_SCHEME, MPS_CONTROL, PIPE_ENV


def probe(url: str, timeout: float = 2.0) -> bool:
    if url.startswith("redis://"):
        return redis_ping(url, timeout)
    if url.startswith(f"{HEALTH_SCHEME}://"):
        return mps_answers(url[len(HEALTH_SCHEME) + 3:], timeout)
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


def mps_answers(pipe_dir: str, timeout: float = 2.0) -> bool:
    """The MPS control daemon of `pipe_dir` answers its own client's `get_server_list` (exit 0; without a
    daemon there the client exits 1)."""
    control = shutil.which(MPS_CONTROL)
    if control is None:
        return False
    try:
        done = subprocess.run([control], input="get_server_list\n", capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, PIPE_ENV: pipe_dir})
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
