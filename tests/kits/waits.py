"""Polling until something holds, for tests that wait on processes, files or servers."""

from __future__ import annotations

import time


def wait_for(predicate, timeout=30.0, what="condition"):
    """Until predicate() is true (every 0.2 s); AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def wait_value(predicate, timeout: float = 10.0):
    """predicate()'s first true value (polled every 0.1 s), or its value at the deadline: for `assert`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return predicate()
