"""The router's buffered bytes, bounded in all (router.max_buffered_mb).

Each request is bounded on its own (a body by max_body_mb, an answer or a stream line by max_answer_mb), but
their sum was not: 6 concurrent 31 MB streams took the router from 44 to 542 MB. Here every request gets a
Charge on one BufferBudget: its body's bytes as they arrive, the lines and token ids a stream relay keeps for
the conversation, a whole answer while it is written to the client. A request that finds no room gets a 503
with Retry-After (front/app.py); a stream relay that finds none stops keeping (the turn is served, not
remembered, as a stream over max_answer_mb is). Everything a request took is given back when it ends.
"""

from __future__ import annotations

from aiohttp import web

RETRY_AFTER_S = 1     # buffers drain as turns end: a second is a turn's typical length on a loaded router


class OverBudget(Exception):
    """No room left for a request's body: answered 503 with Retry-After."""


class BufferBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def room(self, size: int) -> bool:
        return self.held + size <= self.limit

    def charge(self) -> "Charge":
        return Charge(self)


class Charge:
    """One request's share of the budget; close() gives it all back."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: BufferBudget):
        self.budget = budget
        self.held = 0

    def take(self, size: int) -> bool:
        """Charge `size` bytes if they fit; False (nothing charged) if not."""
        budget = self.budget
        if budget.held + size > budget.limit:
            return False
        budget.held += size
        self.held += size
        return True

    def force(self, size: int) -> None:
        """Charge bytes already held (an answer being written): they count against new requests."""
        self.budget.held += size
        self.held += size

    def give(self, size: int) -> None:
        size = min(size, self.held)
        self.held -= size
        self.budget.held -= size

    def close(self) -> None:
        self.give(self.held)


CHARGE = web.RequestKey("buffer_charge", Charge)
