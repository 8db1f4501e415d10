"""Admission control: what the router lets through to the servers, per tenant and in all.

Per tenant (identity.tenant: a hash of the credentials), a cap on requests in flight (queued ones count, so
one tenant cannot fill the queue) and a token bucket on the request rate; over either, 429 with
`Retry-After`. For the deployment, a cap on requests in flight; past it a request waits in a bounded FIFO
queue at most `queue_timeout`, and when the queue is full (or the wait ran out) it gets 503 with
`Retry-After`. Every request ends in exactly one outcome (OUTCOMES), counted. Off by default: with no limit
set, the router installs nothing (build_app), so admission costs nothing.

AdmissionPolicy is the bookkeeping, synchronous and driven by an injected clock (unit tests run it in
milliseconds); Admission adds the waiting (asyncio futures) and the metrics; `middleware` puts it in front
of the completion routes only (/health, /metrics and /v1/models are never limited).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from pdserve.router import identity
from pdserve.router.api import WireFormat
from pdserve.router.errors import error_body

# Outcomes, exactly one per request that reaches admission.
ADMITTED = "admitted"                      # served at once
QUEUED = "queued"                          # served after a wait in the queue
REJECTED_TENANT_RATE = "rejected_tenant_rate"            # 429: the tenant's token bucket was empty
REJECTED_TENANT_IN_FLIGHT = "rejected_tenant_in_flight"  # 429: the tenant had its cap in flight (or queued)
REJECTED_SATURATED = "rejected_saturated"  # 503: the deployment at its cap and the queue full
QUEUE_TIMEOUT = "queue_timeout"            # 503: waited queue_timeout without a free slot
CLIENT_GONE = "client_gone"                # the client left while its request was queued
OUTCOMES = (ADMITTED, QUEUED, REJECTED_TENANT_RATE, REJECTED_TENANT_IN_FLIGHT, REJECTED_SATURATED, QUEUE_TIMEOUT,
            CLIENT_GONE)
WAIT = "wait"                              # a decision, not an outcome: the request joins the queue
TENANT_REJECTIONS = (REJECTED_TENANT_RATE, REJECTED_TENANT_IN_FLIGHT)
PRUNE_AT = 4096                            # tenants remembered before idle ones are forgotten


@dataclass(frozen=True)
class Limits:
    max_in_flight: int = 0           # requests in flight in all; 0: unlimited (then no queue)
    queue_size: int = 0              # requests that may wait for a slot past max_in_flight
    queue_timeout: float = 5.0       # seconds one may wait
    tenant_max_in_flight: int = 0    # per tenant, queued ones included; 0: unlimited
    tenant_rate: float = 0.0         # requests per second per tenant (token bucket); 0: unlimited
    tenant_burst: int = 0            # the bucket's size; 0: max(1, ceil(tenant_rate))

    @classmethod
    def from_config(cls, cfg) -> "Limits":
        return cls(cfg.max_in_flight, cfg.queue_size, cfg.queue_timeout, cfg.tenant_max_in_flight,
                   cfg.tenant_rate, cfg.tenant_burst)

    @property
    def enabled(self) -> bool:
        return bool(self.max_in_flight or self.tenant_max_in_flight or self.tenant_rate)

    @property
    def burst(self) -> float:
        return float(self.tenant_burst or max(1, math.ceil(self.tenant_rate)))


@dataclass(frozen=True)
class Verdict:
    outcome: str                     # ADMITTED, WAIT, or a rejection
    retry_after: int = 0             # seconds, for a rejection


class Tenant:
    __slots__ = ("in_flight", "tokens", "stamp")

    def __init__(self, tokens: float, now: float):
        self.in_flight = 0           # admitted and queued
        self.tokens = tokens
        self.stamp = now


class AdmissionPolicy:
    """Counts and decisions only; `now` comes from the clock. A caller that gets ADMITTED calls release()
    when the request is done; one that gets WAIT calls dequeued() when its wait ends, however it ends."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self.in_flight = 0           # admitted, all tenants
        self.queued = 0
        self.tenants: dict[str, Tenant] = {}
        self.prune_at = PRUNE_AT

    def _tenant(self, name: str, now: float) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            if len(self.tenants) >= self.prune_at:
                self._prune(now)
                self.prune_at = max(PRUNE_AT, 2 * len(self.tenants))   # amortized O(1) per new tenant
            t = self.tenants[name] = Tenant(self.limits.burst, now)
        elif self.limits.tenant_rate:
            t.tokens = min(self.limits.burst, t.tokens + (now - t.stamp) * self.limits.tenant_rate)
            t.stamp = now
        return t

    def _prune(self, now: float) -> None:
        """Forget tenants with nothing in flight and a full bucket: they are as a new one would be."""
        lim = self.limits
        for name in [n for n, t in self.tenants.items() if not t.in_flight and (
                not lim.tenant_rate or t.tokens + (now - t.stamp) * lim.tenant_rate >= lim.burst)]:
            del self.tenants[name]

    def arrive(self, tenant: str) -> Verdict:
        now = self.clock()
        lim = self.limits
        t = self._tenant(tenant, now)
        if lim.tenant_rate and t.tokens < 1.0:
            return Verdict(REJECTED_TENANT_RATE, max(1, math.ceil((1.0 - t.tokens) / lim.tenant_rate)))
        if lim.tenant_max_in_flight and t.in_flight >= lim.tenant_max_in_flight:
            return Verdict(REJECTED_TENANT_IN_FLIGHT, 1)
        if lim.max_in_flight and (self.in_flight >= lim.max_in_flight or self.queued):
            if self.queued >= lim.queue_size:
                # By the queue's longest wait every request now queued was served or gave up.
                return Verdict(REJECTED_SATURATED, max(1, math.ceil(lim.queue_timeout)) if lim.queue_size else 1)
            outcome = WAIT
            self.queued += 1
        else:
            outcome = ADMITTED
            self.in_flight += 1
        t.in_flight += 1
        if lim.tenant_rate:
            t.tokens -= 1.0
        return Verdict(outcome)

    def dequeued(self, admitted: bool, tenant: str) -> None:
        """A queued request's wait ended: it took a freed slot (admitted), or it left the queue."""
        self.queued -= 1
        if admitted:
            self.in_flight += 1
        else:
            self._tenant_done(tenant)

    def release(self, tenant: str) -> None:
        self.in_flight -= 1
        self._tenant_done(tenant)

    def _tenant_done(self, tenant: str) -> None:
        t = self.tenants.get(tenant)
        if t is not None:
            t.in_flight -= 1

    def slot_free(self) -> bool:
        return not self.limits.max_in_flight or self.in_flight < self.limits.max_in_flight


class Refusal(Exception):
    def __init__(self, verdict: Verdict):
        super().__init__(verdict.outcome)
        self.verdict = verdict

    def response(self, shape: Callable[[dict, int], dict] = lambda body, status: body) -> web.Response:
        """The refusal (429 or 503, with Retry-After), its body in the client's shape (`shape`)."""
        v = self.verdict
        if v.outcome in TENANT_REJECTIONS:
            what = "request rate" if v.outcome == REJECTED_TENANT_RATE else "requests in flight"
            status, body = 429, error_body(f"too many requests: this API key is over its limit on {what}; "
                                           f"retry after {v.retry_after} s", "rate_limit_exceeded", 429)
        else:
            why = "the wait queue is full" if v.outcome == REJECTED_SATURATED else "no slot freed in time"
            status, body = 503, error_body(f"the deployment is at capacity ({why}); retry after {v.retry_after} s",
                                           "server_overloaded", 503)
        return web.json_response(shape(body, status), status=status, headers={"Retry-After": str(v.retry_after)})


class Admission:
    """The policy with its queue: enter() returns once the request may go on (or raises Refusal)."""

    def __init__(self, limits: Limits, metrics, clock: Callable[[], float] = time.monotonic):
        self.policy = AdmissionPolicy(limits, clock)
        self.metrics = metrics
        self.waiters: deque[tuple[str, asyncio.Future]] = deque()
        metrics.admission_in_flight.set_function(lambda: self.policy.in_flight)

    def _count(self, outcome: str) -> None:
        self.metrics.admission.labels(outcome).inc()

    async def enter(self, tenant: str) -> None:
        verdict = self.policy.arrive(tenant)
        if verdict.outcome == ADMITTED:
            self._count(ADMITTED)
            return
        if verdict.outcome != WAIT:
            self._count(verdict.outcome)
            raise Refusal(verdict)
        await self._wait(tenant)

    async def _wait(self, tenant: str) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        entry = (tenant, fut)
        self.waiters.append(entry)
        self.metrics.admission_queue.set(self.policy.queued)
        timer = loop.call_later(self.policy.limits.queue_timeout, self._expire, entry)
        started = time.perf_counter()
        try:
            admitted = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.exit(tenant)            # a slot was handed over just as the client left: give it on
            elif entry in self.waiters:
                self.waiters.remove(entry)
                self.policy.dequeued(False, tenant)
            self._count(CLIENT_GONE)
            raise
        finally:
            timer.cancel()
            self.metrics.admission_queue.set(self.policy.queued)
        self.metrics.admission_wait.observe(time.perf_counter() - started)
        if not admitted:
            self._count(QUEUE_TIMEOUT)
            raise Refusal(Verdict(QUEUE_TIMEOUT, max(1, math.ceil(self.policy.limits.queue_timeout))))
        self._count(QUEUED)

    def _expire(self, entry: tuple[str, asyncio.Future]) -> None:
        if not entry[1].done() and entry in self.waiters:
            self.waiters.remove(entry)
            self.policy.dequeued(False, entry[0])
            entry[1].set_result(False)

    def exit(self, tenant: str) -> None:
        self.policy.release(tenant)
        while self.waiters and self.policy.slot_free():
            waiter, fut = self.waiters.popleft()
            if fut.done():
                # Its client just left: the cancel reached the future, its task has not run yet (and will
                # find itself out of the queue). It leaves the queue here; the slot goes to the next one.
                self.policy.dequeued(False, waiter)
                continue
            self.policy.dequeued(True, waiter)
            fut.set_result(True)


def middleware(admission: Admission, formats: dict[str, WireFormat], on_refused: Callable[[WireFormat], None]):
    """Admission in front of the completion routes (`formats`: route -> wire format); every other path goes
    straight through."""

    @web.middleware
    async def admit(request: web.Request, handler):
        fmt = formats.get(request.path)
        if fmt is None:
            return await handler(request)
        tenant = identity.tenant(request)
        try:
            await admission.enter(tenant)
        except Refusal as refusal:
            on_refused(fmt)
            return refusal.response(fmt.client_error)
        try:
            return await handler(request)
        finally:
            admission.exit(tenant)

    return admit
