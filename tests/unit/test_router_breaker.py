"""The half-open trial slot: held by one request, freed when that request ends with no verdict."""

from __future__ import annotations

from pdserve.router.config import BackendConfig
from pdserve.router.route.backends import Pool
from pdserve.router.route.breaker import CircuitBreaker
from pdserve.router.telemetry.metrics import RouterMetrics


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def half_open_pool() -> tuple[Pool, Clock]:
    clock = Clock()
    pool = Pool("prefill", [BackendConfig("prefill-0", "http://x")], RouterMetrics(),
                lambda: CircuitBreaker(threshold=1, cooldown=1.0, clock=clock))
    b = pool.backends[0]
    pool.release(b, False, pool.acquire(b))       # opens
    clock.now = 2.0                               # cooldown over
    assert b.breaker.state == "half_open" and b.breaker.allows()
    return pool, clock


def test_a_trial_without_a_verdict_frees_the_slot():
    pool, _ = half_open_pool()
    b = pool.backends[0]
    trial = pool.acquire(b)
    assert trial and not b.breaker.allows()
    pool.release(b, None, trial)                  # client gone / not this backend's fault
    assert b.breaker.allows() and b.breaker.state == "half_open"


def test_another_requests_missing_verdict_does_not_free_the_trial():
    pool, _ = half_open_pool()
    b = pool.backends[0]
    trial = pool.acquire(b)
    other = pool.acquire(b)                       # e.g. a request begun before (not the trial)
    assert trial and not other
    pool.release(b, None, other)
    assert not b.breaker.allows()
    pool.release(b, True, trial)
    assert b.breaker.state == "closed"
