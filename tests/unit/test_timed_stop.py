"""The one timed stop: the supervisor steps it on its ticks, `down` runs it to the end (stop_tree)."""

from __future__ import annotations

import signal

from pdserve.launchers.stop import KILL_GRACE, stop_tree


class Tree:
    def __init__(self, dies_on: int | None):
        self.dies_on, self.alive, self.signals = dies_on, 2, []

    def tree_alive(self, handle) -> int:
        return self.alive

    def signal(self, handle, sig: int) -> int:
        self.signals.append(sig)
        if sig == self.dies_on:
            self.alive = 0
        return 2


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_tree_that_obeys_sigterm_gets_nothing_else():
    tree, clock = Tree(signal.SIGTERM), Clock()
    assert stop_tree(tree, "h", 5.0, clock=clock, sleep=clock.sleep)
    assert tree.signals == [signal.SIGTERM] and clock.now == 100.0


def test_sigkill_after_the_timeout_and_again_until_the_kill_grace_ends():
    tree, clock = Tree(None), Clock()
    assert stop_tree(tree, "h", 5.0, clock=clock, sleep=clock.sleep)
    assert tree.signals[0] == signal.SIGTERM and tree.signals.count(signal.SIGKILL) >= 2
    assert 105.0 + KILL_GRACE <= clock.now < 105.0 + KILL_GRACE + 1


def test_nothing_alive_is_not_signalled():
    tree = Tree(None)
    tree.alive = 0
    assert not stop_tree(tree, "h", 5.0) and tree.signals == []
