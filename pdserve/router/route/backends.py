"""Backend pools: live load, health probes (background and on demand), least-loaded choice among the healthy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from pdserve.router.config import BackendConfig
from pdserve.router.route.breaker import CircuitBreaker
from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
PIN_SLACK = 4
FAILED_PROBES_BEFORE_DOWN = 3


@dataclass(eq=False)
class Backend:
    name: str
    url: str
    role: str
    healthy: bool = False      # unknown until the first probe answers
    in_flight: int = 0
    generation: int = 0        # bumps when the server process is seen gone: handles it gave out are stale
    failed_probes: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    seen_alive: bool = False   # answered since the last generation bump
    breaker_shown: bool = False   # what pdserve_router_backend_breaker_open says (set on changes only)

    @property
    def down(self) -> bool:
        """Seen failing its probes (or refusing connections) since it last answered."""
        return not self.healthy and self.failed_probes > 0

    def mark_answering(self) -> bool:
        """The server answered (a probe or a real request); True when that brings it back into routing.

        A successful request counts as much as a probe: after a restart the supervisor's canary or the
        first client request often reaches the server before the next probe does, and until then the
        router would refuse to reuse the blocks the new server already holds."""
        came_back = not self.healthy
        self.failed_probes = 0
        self.healthy = self.seen_alive = True
        return came_back

    def record_probe(self, ok: bool, refused: bool = False) -> bool:
        """Update health from one probe; True when the server's KV state is lost (entries must go).

        A refused connection means the server process is gone, and its KV blocks with it: out of routing
        at once, and its generation moves on. Slow or failing answers only take it out of routing after
        FAILED_PROBES_BEFORE_DOWN in a row, and keep its entries: a server busy with long prefills on a
        loaded machine still holds its blocks (a restart shows as refused connections or a new engine id).
        """
        if ok:
            self.mark_answering()
            return False
        self.failed_probes += 1
        if refused or self.failed_probes >= FAILED_PROBES_BEFORE_DOWN:
            self.healthy = False
        if refused and self.seen_alive:
            self.seen_alive = False
            self.generation += 1
            return True
        return False


class Pool:
    def __init__(self, role: str, configs: list[BackendConfig], metrics: RouterMetrics,
                 breaker: Callable[[], CircuitBreaker] = CircuitBreaker):
        self.role = role
        self.metrics = metrics
        self.backends = [Backend(c.name, c.url.rstrip("/"), role, breaker=breaker()) for c in configs]
        self._rr = 0
        for b in self.backends:     # exported from the start (0): a dashboard shows closed, not "no data"
            metrics.breaker_open.labels(b.name, role).set(0)
            # Read at scrape time: nothing per request (acquire and release ran a locked set each, 4 a turn).
            metrics.in_flight.labels(b.name).set_function(lambda b=b: b.in_flight)

    def by_name(self, name: str) -> Backend | None:
        return next((b for b in self.backends if b.name == name), None)

    def pick(self, exclude: set[str] = frozenset(), prefer: str | None = None) -> Backend | None:
        """Least outstanding requests among healthy backends; ties rotate so load spreads.

        `prefer` (the decode server holding a conversation's blocks, whose prefix cache is warm) wins
        while it is healthy and not more than PIN_SLACK requests busier than the least-loaded one.
        """
        usable = [b for b in self.backends if b.name not in exclude and b.breaker.allows()]
        candidates = [b for b in usable if b.healthy]
        pinned = next((b for b in candidates if b.name == prefer), None)
        if pinned and pinned.in_flight <= min(b.in_flight for b in candidates) + PIN_SLACK:
            return pinned
        if not candidates:
            # Health is probed every few seconds; a backend not yet seen healthy may still answer.
            candidates = usable
        if not candidates:
            return None
        self._rr += 1
        n = len(candidates)
        rotated = candidates[self._rr % n:] + candidates[:self._rr % n]
        return min(rotated, key=lambda b: b.in_flight)

    def any_usable(self) -> bool:
        """Could a request go to some backend now (not seen down, breaker letting traffic through)?"""
        return any(b.breaker.allows() and not b.down for b in self.backends)

    def least_loaded(self) -> Backend | None:
        usable = [b for b in self.backends if b.healthy and b.breaker.allows()] or self.backends
        return min(usable, key=lambda b: b.in_flight) if usable else None

    def acquire(self, backend: Backend) -> bool:
        """Count a request as outstanding; True when it is the breaker's half-open trial (pass that back
        to `release`)."""
        backend.in_flight += 1
        return backend.breaker.begin()

    def release(self, backend: Backend, ok: bool | None, trial: bool = False) -> None:
        """The request is over: ok, failed (counts toward the breaker), or None when the outcome says
        nothing about this backend (the client went away, or P failed to read another server's blocks).
        Call it from a `finally`: a trial released with no outcome frees the slot for the next request."""
        backend.in_flight -= 1
        if ok is None and trial:
            backend.breaker.abandon_trial()
        if ok and backend.mark_answering():
            log.info("%s %s is healthy (answered a request)", self.role, backend.name)
            self.metrics.healthy.labels(backend.name, self.role).set(1)
        if ok is not None:
            self.record(backend, ok)

    def record(self, backend: Backend, ok: bool) -> None:
        """A request's verdict on the backend's breaker."""
        if backend.breaker.record(ok):
            log.warning("%s %s: circuit breaker open after %d failed requests", self.role, backend.name,
                        backend.breaker.failures)
        if not ok or backend.breaker_shown:   # a success on a closed breaker changes nothing to show
            backend.breaker_shown = backend.breaker.state != "closed"
            self.metrics.breaker_open.labels(backend.name, self.role).set(1 if backend.breaker_shown else 0)


class Suspects:
    """One request's 5xx answers, held back from the breakers until it is known whose fault they were.

    A server that answers 5xx may be broken, or the request may be what breaks it (content that passes
    the router's checks but crashes the engine): the answer alone cannot tell. So the verdict waits for a
    second opinion: once another server serves the same request, the held answers count against their
    servers (`served`); if the request fails everywhere it was tried, it is the common factor and counts
    against none (`forgive`). Without this, three such requests opened both roles' breakers."""

    def __init__(self) -> None:
        self.held: list[tuple[Pool, Backend]] = []

    def hold(self, pool: Pool, backend: Backend) -> None:
        self.held.append((pool, backend))

    def served(self) -> None:
        for pool, backend in self.held:
            pool.record(backend, False)
        self.held.clear()

    def forgive(self) -> list[str]:
        names = [backend.name for _, backend in self.held]
        self.held.clear()
        return names


class HealthProber:
    """/health probes: of every backend every `interval` in the background, and at once for a pool that
    has no usable backend when a request needs it. A restarted server answers before the next scheduled
    probe; serving that request degraded on the other role would waste the restart (and leave D without
    the turn's blocks). A backend whose process is gone invalidates what it handed out (`on_down`)."""

    RECHECK_GAP = 0.5       # at most one on-demand probe of a pool per this many seconds
    RECHECK_WAIT = 0.2      # the most a request waits for it (the probe itself finishes in the background)

    def __init__(self, pools: list[Pool], session: aiohttp.ClientSession, interval: float,
                 on_down: Callable[[Backend], None], clock: Callable[[], float] = time.monotonic):
        self.pools = pools
        self.session = session
        self.interval = interval
        self.on_down = on_down
        self.clock = clock
        self.timeout = aiohttp.ClientTimeout(total=max(5.0, interval))
        self._rechecks: dict[str, tuple[float, asyncio.Task]] = {}     # pool role -> (started, probe)

    async def probe(self, b: Backend) -> None:
        ok = refused = False
        try:
            async with self.session.get(f"{b.url}/health", timeout=self.timeout) as resp:
                ok = resp.status == 200
        except aiohttp.ClientConnectorError:
            refused = True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        was_healthy = b.healthy
        if b.record_probe(ok, refused):
            self.on_down(b)
        if was_healthy and not b.healthy:
            log.warning("%s %s is down (%s)", b.role, b.name, "refused" if refused else "failed probes")
        elif b.healthy and not was_healthy:
            log.info("%s %s is healthy", b.role, b.name)
        self.pools[0].metrics.healthy.labels(b.name, b.role).set(1 if b.healthy else 0)

    async def forever(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(b) for pool in self.pools for b in pool.backends))
            await asyncio.sleep(self.interval)

    async def recheck(self, pool: Pool) -> None:
        """Probe the pool's down backends now; concurrent callers share one probe."""
        now = self.clock()
        started, task = self._rechecks.get(pool.role, (float("-inf"), None))
        if task is None or (task.done() and now - started >= self.RECHECK_GAP):
            down = [b for b in pool.backends if b.down]
            task = asyncio.ensure_future(asyncio.gather(*(self.probe(b) for b in down)))
            self._rechecks[pool.role] = (now, task)
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), self.RECHECK_WAIT)
