"""Admission control: what the router lets through to the servers, per tenant and in all.

Per tenant (identity.tenant: a hash of the credentials), a cap on requests in flight (queued ones count, so
one tenant cannot fill the queue) and a token bucket on the request rate; over either, 429 with
`Retry-After`. The same per client address (an IPv6 address's /64), which a caller cannot escape by sending
new credentials with every request (each would be a new tenant), nor share with others by using one key. For the deployment, a cap on requests in flight; past it a request waits in a bounded FIFO
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
from pdserve.router.api.inputs import BadInput, read_body
from pdserve.router.errors import error_body

# Outcomes, exactly one per request that reaches admission.
ADMITTED = "admitted"                      # served at once
QUEUED = "queued"                          # served after a wait in the queue
REJECTED_TENANT_RATE = "rejected_tenant_rate"            # 429: the tenant's token bucket was empty
REJECTED_TENANT_IN_FLIGHT = "rejected_tenant_in_flight"  # 429: the tenant had its cap in flight (or queued)
REJECTED_CLIENT_RATE = "rejected_client_rate"            # 429: the client address's token bucket was empty
REJECTED_CLIENT_IN_FLIGHT = "rejected_client_in_flight"  # 429: the client address had its cap in flight (or queued)
REJECTED_SATURATED = "rejected_saturated"  # 503: the deployment at its cap and the queue full
QUEUE_TIMEOUT = "queue_timeout"            # 503: waited queue_timeout without a free slot
CLIENT_GONE = "client_gone"                # the client left while its request was queued
OUTCOMES = (ADMITTED, QUEUED, REJECTED_TENANT_RATE, REJECTED_TENANT_IN_FLIGHT, REJECTED_CLIENT_RATE,
            REJECTED_CLIENT_IN_FLIGHT, REJECTED_SATURATED, QUEUE_TIMEOUT, CLIENT_GONE)
WAIT = "wait"                              # a decision, not an outcome: the request joins the queue
TENANT_REJECTIONS = (REJECTED_TENANT_RATE, REJECTED_TENANT_IN_FLIGHT)
CLIENT_REJECTIONS = (REJECTED_CLIENT_RATE, REJECTED_CLIENT_IN_FLIGHT)
PRUNE_AT = 4096                            # tenants (or clients) remembered before idle ones are forgotten


@dataclass(frozen=True)
class Limits:
    max_in_flight: int = 0           # requests in flight in all; 0: unlimited (then no queue)
    queue_size: int = 0              # requests that may wait for a slot past max_in_flight
    queue_timeout: float = 5.0       # seconds one may wait
    tenant_max_in_flight: int = 0    # per tenant, queued ones included; 0: unlimited
    tenant_rate: float = 0.0         # requests per second per tenant (token bucket); 0: unlimited
    tenant_burst: int = 0            # the bucket's size; 0: max(1, ceil(tenant_rate))
    client_max_in_flight: int = 0    # per client address (IPv6: its /64), queued ones included; 0: unlimited
    client_rate: float = 0.0         # requests per second per client address; 0: unlimited
    client_burst: int = 0            # its bucket's size; 0: max(1, ceil(client_rate))

    @classmethod
    def from_config(cls, cfg) -> "Limits":
        return cls(cfg.max_in_flight, cfg.queue_size, cfg.queue_timeout, cfg.tenant_max_in_flight,
                   cfg.tenant_rate, cfg.tenant_burst, cfg.client_max_in_flight, cfg.client_rate, cfg.client_burst)

    @property
    def enabled(self) -> bool:
        return bool(self.max_in_flight or self.tenant_max_in_flight or self.tenant_rate or self.per_client)

    @property
    def per_client(self) -> bool:
        return bool(self.client_max_in_flight or self.client_rate)

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


class Table:
    """One kind of caller (tenants, or client addresses): each one's requests in flight or queued, and its
    token bucket; idle callers with a full bucket are forgotten (they are as a new one would be)."""

    def __init__(self, rate: float, burst: int, cap: int, rejections: tuple[str, str]):
        self.rate = rate
        self.burst = float(burst or max(1, math.ceil(rate)))
        self.cap = cap
        self.over_rate, self.over_cap = rejections
        self.entries: dict[str, Tenant] = {}
        self.prune_at = PRUNE_AT

    def get(self, name: str, now: float) -> Tenant:
        t = self.entries.get(name)
        if t is None:
            if len(self.entries) >= self.prune_at:
                self._prune(now)
                self.prune_at = max(PRUNE_AT, 2 * len(self.entries))   # amortized O(1) per new caller
            t = self.entries[name] = Tenant(self.burst, now)
        elif self.rate:
            t.tokens = min(self.burst, t.tokens + (now - t.stamp) * self.rate)
            t.stamp = now
        return t

    def _prune(self, now: float) -> None:
        for name in [n for n, t in self.entries.items() if not t.in_flight and (
                not self.rate or t.tokens + (now - t.stamp) * self.rate >= self.burst)]:
            del self.entries[name]

    def refusal(self, t: Tenant) -> Verdict | None:
        if self.rate and t.tokens < 1.0:
            return Verdict(self.over_rate, max(1, math.ceil((1.0 - t.tokens) / self.rate)))
        if self.cap and t.in_flight >= self.cap:
            return Verdict(self.over_cap, 1)
        return None

    def take(self, t: Tenant) -> None:
        t.in_flight += 1
        if self.rate:
            t.tokens -= 1.0

    def done(self, name: str) -> None:
        t = self.entries.get(name)
        if t is not None:
            t.in_flight -= 1


class AdmissionPolicy:
    """Counts and decisions only; `now` comes from the clock. A caller that gets ADMITTED calls release()
    when the request is done; one that gets WAIT calls dequeued() when its wait ends, however it ends.
    Every request counts against its tenant and, with per-client limits, its client address too: a caller
    who makes up a new credential per request is a new tenant each time, but not a new address."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self.in_flight = 0           # admitted, all tenants
        self.queued = 0
        self.by_tenant = Table(limits.tenant_rate, limits.tenant_burst, limits.tenant_max_in_flight, TENANT_REJECTIONS)
        self.by_client = Table(limits.client_rate, limits.client_burst, limits.client_max_in_flight,
                               CLIENT_REJECTIONS) if limits.per_client else None

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self.by_tenant.entries

    def refusal(self, tenant: str, client: str = "") -> Verdict | None:
        """The refusal arrive() would give now, taking nothing: checked before a request's body is read, so
        a refused request costs no body, and a request does not hold a slot while its body trickles in."""
        now = self.clock()
        refused = self.by_tenant.refusal(self.by_tenant.get(tenant, now))
        if refused is None and self.by_client is not None:
            refused = self.by_client.refusal(self.by_client.get(client, now))
        return refused or self._saturated()

    def _saturated(self) -> Verdict | None:
        lim = self.limits
        if lim.max_in_flight and (self.in_flight >= lim.max_in_flight or self.queued) and self.queued >= lim.queue_size:
            # By the queue's longest wait every request now queued was served or gave up.
            return Verdict(REJECTED_SATURATED, max(1, math.ceil(lim.queue_timeout)) if lim.queue_size else 1)
        return None

    def arrive(self, tenant: str, client: str = "") -> Verdict:
        now = self.clock()
        lim = self.limits
        t = self.by_tenant.get(tenant, now)
        refused = self.by_tenant.refusal(t)
        if refused is not None:
            return refused
        c = None
        if self.by_client is not None:
            c = self.by_client.get(client, now)
            refused = self.by_client.refusal(c)
            if refused is not None:
                return refused
        if lim.max_in_flight and (self.in_flight >= lim.max_in_flight or self.queued):
            saturated = self._saturated()
            if saturated is not None:
                return saturated
            outcome = WAIT
            self.queued += 1
        else:
            outcome = ADMITTED
            self.in_flight += 1
        self.by_tenant.take(t)
        if c is not None:
            self.by_client.take(c)     # type: ignore[union-attr]
        return Verdict(outcome)

    def dequeued(self, admitted: bool, tenant: str, client: str = "") -> None:
        """A queued request's wait ended: it took a freed slot (admitted), or it left the queue."""
        self.queued -= 1
        if admitted:
            self.in_flight += 1
        else:
            self._done(tenant, client)

    def release(self, tenant: str, client: str = "") -> None:
        self.in_flight -= 1
        self._done(tenant, client)

    def _done(self, tenant: str, client: str) -> None:
        self.by_tenant.done(tenant)
        if self.by_client is not None:
            self.by_client.done(client)

    def slot_free(self) -> bool:
        return not self.limits.max_in_flight or self.in_flight < self.limits.max_in_flight


class Refusal(Exception):
    def __init__(self, verdict: Verdict):
        super().__init__(verdict.outcome)
        self.verdict = verdict

    def response(self, shape: Callable[[dict, int], dict] = lambda body, status: body) -> web.Response:
        """The refusal (429 or 503, with Retry-After), its body in the client's shape (`shape`)."""
        v = self.verdict
        if v.outcome in TENANT_REJECTIONS or v.outcome in CLIENT_REJECTIONS:
            who = "this API key" if v.outcome in TENANT_REJECTIONS else "this client address"
            what = "request rate" if v.outcome in (REJECTED_TENANT_RATE, REJECTED_CLIENT_RATE) else "requests in flight"
            status, body = 429, error_body(f"too many requests: {who} is over its limit on {what}; "
                                           f"retry after {v.retry_after} s", "rate_limit_exceeded", 429)
        else:
            why = "the wait queue is full" if v.outcome == REJECTED_SATURATED else "no slot freed in time"
            status, body = 503, error_body(f"the deployment is at capacity ({why}); retry after {v.retry_after} s",
                                           "server_overloaded", 503)
        return web.json_response(shape(body, status), status=status, headers={"Retry-After": str(v.retry_after)})


Waiter = tuple[str, str, asyncio.Future]     # tenant, client, the future the slot is handed over on


class Admission:
    """The policy with its queue: enter() returns once the request may go on (or raises Refusal)."""

    def __init__(self, limits: Limits, metrics, clock: Callable[[], float] = time.monotonic):
        self.policy = AdmissionPolicy(limits, clock)
        self.metrics = metrics
        self.waiters: deque[Waiter] = deque()
        metrics.admission_in_flight.set_function(lambda: self.policy.in_flight)

    def count(self, outcome: str) -> None:
        self.metrics.admission.labels(outcome).inc()

    async def enter(self, tenant: str, client: str = "") -> None:
        verdict = self.policy.arrive(tenant, client)
        if verdict.outcome == ADMITTED:
            self.count(ADMITTED)
            return
        if verdict.outcome != WAIT:
            self.count(verdict.outcome)
            raise Refusal(verdict)
        await self._wait(tenant, client)

    async def _wait(self, tenant: str, client: str) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        entry = (tenant, client, fut)
        self.waiters.append(entry)
        self.metrics.admission_queue.set(self.policy.queued)
        timer = loop.call_later(self.policy.limits.queue_timeout, self._expire, entry)
        started = time.perf_counter()
        try:
            admitted = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.exit(tenant, client)    # a slot was handed over just as the client left: give it on
            elif entry in self.waiters:
                self.waiters.remove(entry)
                self.policy.dequeued(False, tenant, client)
            self.count(CLIENT_GONE)
            raise
        finally:
            timer.cancel()
            self.metrics.admission_queue.set(self.policy.queued)
        self.metrics.admission_wait.observe(time.perf_counter() - started)
        if not admitted:
            self.count(QUEUE_TIMEOUT)
            raise Refusal(Verdict(QUEUE_TIMEOUT, max(1, math.ceil(self.policy.limits.queue_timeout))))
        self.count(QUEUED)

    def _expire(self, entry: Waiter) -> None:
        if not entry[2].done() and entry in self.waiters:
            self.waiters.remove(entry)
            self.policy.dequeued(False, entry[0], entry[1])
            entry[2].set_result(False)

    def exit(self, tenant: str, client: str = "") -> None:
        self.policy.release(tenant, client)
        while self.waiters and self.policy.slot_free():
            waiter, address, fut = self.waiters.popleft()
            if fut.done():
                # Its client just left: the cancel reached the future, its task has not run yet (and will
                # find itself out of the queue). It leaves the queue here; the slot goes to the next one.
                self.policy.dequeued(False, waiter, address)
                continue
            self.policy.dequeued(True, waiter, address)
            fut.set_result(True)


def middleware(admission: Admission, formats: dict[str, WireFormat], on_refused: Callable[[str, WireFormat], None],
               body_timeout: float):
    """Admission in front of the routes that reach a server (`formats`: route -> wire format: the completion
    routes and count_tokens); every other path goes straight through. `on_refused(path, fmt)` on a refusal,
    and on a body refused before admission (the route would have counted it). A request is checked when its
    head comes (a refusal costs no body), then its body is read, then it takes its slot: a client that sends
    its body slowly holds no slot meanwhile (issue 45: half-sent bodies held theirs until body_timeout)."""
    per_client = admission.policy.by_client is not None

    @web.middleware
    async def admit(request: web.Request, handler):
        fmt = formats.get(request.path)
        if fmt is None:
            return await handler(request)
        tenant = identity.tenant(request)
        client = identity.client_address(request) if per_client else ""
        try:
            refused = admission.policy.refusal(tenant, client)
            if refused is not None:
                admission.count(refused.outcome)
                raise Refusal(refused)
            try:
                await read_body(request, body_timeout)     # kept on the request: the route reads it from there
            except BadInput as bad:
                on_refused(request.path, fmt)
                return bad.response(fmt)
            await admission.enter(tenant, client)
        except Refusal as refusal:
            on_refused(request.path, fmt)
            return refusal.response(fmt.client_error)
        try:
            return await handler(request)
        finally:
            admission.exit(tenant, client)

    return admit
