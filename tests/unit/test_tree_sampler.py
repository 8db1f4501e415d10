"""`status --watch` samples the same process tree that stop and `down` signal: the leader's group and
session plus its marker, so a reparented EngineCore is counted (parentage alone misses it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil

from pdserve.launchers.local import environ_mark
from pdserve.observe.resources import TreeSampler

# The leader forks a child that forks two grandchildren and exits: both are reparented away from the
# leader. One keeps the leader's group; the other leaves group and session and keeps only the marker.
LEADER = """
import os, sys, time
first = os.fork()
if first == 0:
    for detach in (False, True):
        if os.fork() == 0:
            if detach:
                os.setsid()
            # one write each (lines never interleave), tagged: the two may print in either order
            os.write(1, b'%s %d\\n' % (b'detached' if detach else b'in_group', os.getpid()))
            time.sleep(60)
            os._exit(0)
    os._exit(0)
os.waitpid(first, 0)
time.sleep(60)
"""


def test_reparented_processes_of_the_group_and_the_marker_are_sampled():
    marker = f"test-{uuid.uuid4().hex}"
    env = {**os.environ, "PDSERVE_PROCESS": marker}
    leader = subprocess.Popen([sys.executable, "-c", LEADER], env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    grandchildren: list[int] = []
    try:
        pids = dict(leader.stdout.readline().split() for _ in range(2))
        grandchildren = [int(pids["in_group"]), int(pids["detached"])]
        in_group, detached = grandchildren
        assert os.getpgid(in_group) == leader.pid and os.getsid(detached) == detached

        def descendants() -> set[int]:
            return {c.pid for c in psutil.Process(leader.pid).children(recursive=True)}
        deadline = time.monotonic() + 10      # they print before their parent has exited: wait for that
        while {in_group, detached} & descendants() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not {in_group, detached} & descendants()
        start = psutil.Process(leader.pid).create_time()
        usage = TreeSampler().sample(leader.pid, {in_group: 1, detached: 10, leader.pid: 100},
                                     start_time=start, mark=environ_mark(marker))
        assert usage.gpu_bytes == 111
        assert usage.rss and usage.rss > 0
    finally:
        for pid in grandchildren:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leader.kill()
        leader.wait()
        leader.stdout.close()


def test_a_gone_leader_samples_as_nothing():
    assert TreeSampler().sample(None) == TreeSampler().sample(0)
    assert TreeSampler().sample(None).rss is None
