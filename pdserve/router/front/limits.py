"""Connection-level limits the aiohttp server lacks: a deadline for the request head, a cap on open
connections, and the router's own file-descriptor limit.

aiohttp closes a connection that is idle (or has sent only part of a request head) `keepalive_timeout`
after its last response; a slowloris client that trickles a head byte by byte would still hold a
descriptor that long. Here a request head must be complete `header_timeout` after its first byte, and
past `max_connections` the oldest connection not in a request is closed to make room (slow heads and idle
keep-alives go first), so slow clients can neither exhaust descriptors nor lock out legitimate requests.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
FD_RESERVE = 64   # descriptors kept back for listening sockets, logs, probes


def raise_fd_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; returns (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, err)
    return soft, hard


# Below these the router refuses to start: a handful of connections would serve almost nobody, and
# silently (each new client evicting the last).
MIN_CLIENT_CONNECTIONS = 32
MIN_UPSTREAM_CONNECTIONS = 16


class TooFewDescriptors(SystemExit):
    """The open-file limit leaves too few descriptors for a workable router."""


def fd_budget(fd_soft_limit: int, clients: int, upstream: int) -> tuple[int, int]:
    """(client connections, upstream pool) that fit under the descriptor limit together.

    Every request in flight holds a client socket and an upstream one, so when the configured caps do not
    fit, what is left after FD_RESERVE is split: the upstream pool gets at most half, the clients the rest
    (idle keep-alives and slow heads need client sockets but no upstream one). Raises TooFewDescriptors
    below MIN_CLIENT_CONNECTIONS + MIN_UPSTREAM_CONNECTIONS."""
    available = fd_soft_limit - FD_RESERVE
    if clients + upstream <= available:
        return clients, upstream
    need = min(clients, MIN_CLIENT_CONNECTIONS) + min(upstream, MIN_UPSTREAM_CONNECTIONS) + FD_RESERVE
    if fd_soft_limit < need:
        raise TooFewDescriptors(
            f"error: the open-file limit {fd_soft_limit} is too low for the router (it needs at least {need}: "
            f"{FD_RESERVE} reserved, {MIN_CLIENT_CONNECTIONS} client and {MIN_UPSTREAM_CONNECTIONS} upstream "
            "connections); raise the hard limit (ulimit -Hn, LimitNOFILE= in a systemd unit, nofile in "
            "/etc/security/limits.conf)")
    pool = min(upstream, max(MIN_UPSTREAM_CONNECTIONS, available // 2))
    return min(clients, available - pool), pool


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol, plus a deadline for each request head."""

    def __init__(self, manager: "GuardedServer", *, header_timeout: float, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self.guard = manager
        self.header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:           # a request head is complete
            self._cancel_head_timer()
        elif data and self._head_timer is None and not self._request_in_progress and self.transport:
            # The first byte of a new request head (a body's bytes arrive while a request is in progress).
            self._head_timer = self._loop.call_later(self.header_timeout, self._head_timed_out, heads)

    def _head_timed_out(self, heads: int) -> None:
        self._head_timer = None
        if self._request_count == heads and not self._request_in_progress and self.transport is not None:
            self.guard.dropped("head_timeout", self.transport,
                               f"request head incomplete after {self.header_timeout:g}s")
            self.force_close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    @property
    def busy(self) -> bool:
        return self._request_in_progress or bool(self._messages)


class GuardedServer(Server):
    def __init__(self, *args: Any, max_connections: int, header_timeout: float,
                 metrics: RouterMetrics | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.metrics = metrics

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, header_timeout=self.header_timeout, **self._kwargs)

    def dropped(self, reason: str, transport: asyncio.BaseTransport | None, why: str) -> None:
        """A client connection the router refused or closed on its own: one metric, one log line."""
        if self.metrics is not None:
            self.metrics.connections_dropped.labels(reason).inc()
        peer = transport.get_extra_info("peername") if transport is not None else None
        log.warning("closed a connection from %s (%s): %s", peer and peer[0], reason, why)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        if len(self._connections) >= self.max_connections:
            # Full: make room by closing the oldest connection that is not in a request (dicts keep
            # insertion order); if every one is busy, the newcomer is refused.
            victim = next((h for h in self._connections if not getattr(h, "busy", True)), None)
            if victim is not None:
                self.dropped("evicted", victim.transport, f"{len(self._connections)} connections open (the cap), "
                             "this one idle or its request head incomplete")
                victim.force_close()
                self._connections.pop(victim, None)
            else:
                self.dropped("full", transport, f"{len(self._connections)} connections open (the cap), all busy")
                transport.close()
        super().connection_made(handler, transport)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server applies the limits above."""

    def __init__(self, app: web.Application, *, max_connections: int, header_timeout: float,
                 metrics: RouterMetrics | None = None, **kwargs: Any):
        super().__init__(app, **kwargs)
        self._guard = {"max_connections": max_connections, "header_timeout": header_timeout, "metrics": metrics}

    async def _make_server(self) -> Server:
        plain = await super()._make_server()
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop,
                             **self._guard, **plain._kwargs)
