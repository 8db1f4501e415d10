"""A per-backend circuit breaker on request outcomes.

Health probes only say a server answers `/health`; a server can do that and still fail every request
(a broken NIXL agent, a wedged engine). After `threshold` consecutive failed requests the breaker opens
and the backend gets no traffic; after `cooldown` seconds it is half-open and one trial request may go
through: success closes it, failure opens it again for twice as long (capped). A trial that ends with
no verdict (the client went away, or the failure was not this backend's) gives the slot back, so the
breaker can never stay half-open with no trial possible.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown: float = 5.0, max_cooldown: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.clock = clock
        self.failures = 0
        self.cooldown = cooldown
        self.opened_at = 0.0
        self._state = CLOSED
        self._trial_out = False

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() >= self.opened_at + self.cooldown:
            self._state = HALF_OPEN
            self._trial_out = False
        return self._state

    def allows(self) -> bool:
        """May a request be sent now? (Does not reserve the half-open trial; see `begin`.)"""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._trial_out)

    def begin(self) -> bool:
        """A request is being sent; in half-open state it is the one trial (returns True then)."""
        if self.state == HALF_OPEN and not self._trial_out:
            self._trial_out = True
            return True
        return False

    def abandon_trial(self) -> None:
        """The trial ended without an outcome about this backend: let another request be the trial."""
        if self._state == HALF_OPEN:
            self._trial_out = False

    def record(self, ok: bool) -> bool:
        """Record a request's outcome; True when this outcome opened the breaker."""
        if ok:
            self.failures = 0
            self.cooldown = self.base_cooldown
            self._state = CLOSED
            self._trial_out = False
            return False
        self.failures += 1
        state = self.state
        if state == HALF_OPEN:
            self.cooldown = min(self.cooldown * 2, self.max_cooldown)
        elif state == OPEN or self.failures < self.threshold:
            return False
        self._state = OPEN
        self.opened_at = self.clock()
        self._trial_out = False
        return True
