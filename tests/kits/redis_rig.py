"""A real redis-server (Debian's) on a free loopback port with its data in a temp dir, for the store tests;
a reuse store opened on it as a router opens one, with the D params an entry carries; and more router
replicas on a router_rig deployment's fake backends."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from aiohttp import web

from pdserve.router.front.app import CONFIG, METRICS, build_app, server_limits
from pdserve.router.front.limits import GuardedRunner
from pdserve.router.kv.store import open_store
from tests.kits.ports import free_port
from tests.kits.router_rig import Deployment, serve_app

PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "e1", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 40}


def store_at(url: str, ttl: float = 30.0, timeout: float = 0.25, errors: list | None = None):
    return open_store(url, ttl=ttl, max_entries=100, max_bytes=2**20, cluster="t", decodes=["decode-0", "decode-1"],
                      timeout=timeout, on_evict=lambda r, n: None,
                      on_error=lambda op, reason: (errors if errors is not None else []).append((op, reason)),
                      on_health=lambda up: None)


def ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, data_dir: Path, port: int | None = None, args: tuple[str, ...] = ()):
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.dir = data_dir
        self.port = port or free_port()
        self.args = args            # e.g. a password, TLS or a unix socket (then `--port 0`)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                      str(self.dir), "--save", "", "--appendonly", "no", *self.args],
                                     stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start: {(self.dir / 'redis.log').read_text()[-500:]}")
            time.sleep(0.05)
        return self

    def _ready(self) -> bool:
        if not self.args:
            return ping(self.port)
        log = self.dir / "redis.log"
        return log.exists() and "ready to accept connections" in log.read_text(errors="replace").lower()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.kill()


async def add_router(dep: Deployment, **overrides) -> tuple[web.Application, str, web.AppRunner]:
    """Another router on `dep`'s backends, with `dep`'s router settings but `overrides`; cleaned up with dep."""
    cfg = dataclasses.replace(dep.router[CONFIG], **overrides)
    app = build_app(cfg, api_key="")
    runner, url = await serve_app(app, GuardedRunner, max_connections=cfg.max_connections, metrics=app[METRICS],
                               header_timeout=cfg.header_timeout, **server_limits(cfg))
    dep.runners.append(runner)
    return app, url, runner
