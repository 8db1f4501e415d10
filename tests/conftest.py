"""Settings and fixtures every test package shares (the helpers themselves are in tests/kits/)."""

from __future__ import annotations

import os
import tempfile

import pytest


def pytest_configure(config):
    # One built-in model build per run: every PDSERVE_HOME a test makes (and every `pdserve` subprocess)
    # reads the models from this one folder, unless the caller named one already.
    if not os.environ.get("PDSERVE_MODELS"):
        os.environ["PDSERVE_MODELS"] = tempfile.mkdtemp(prefix="pdserve-test-models-")


# Under pytest-xdist (scripts/test.sh: -n 2 --dist loadgroup), one worker runs the real-engine tests and the
# network-namespace rigs one after another, in collection order, from the start: they share a cluster, pin
# cores and use fixed bridge names. The other worker takes every other test (they wait on sockets and
# subprocesses). On 2 cores, four workers with the rigs as a second chain took 25 min and failed five
# timing-bound tests; three workers and this one chain, 20 min and none. (xdist's own xdist_group marks grouped nothing
# under pytest 9.2: their node-id suffix never reached the scheduler; this scheduler groups by path.)
CHAINS = {"tests/e2e/": "serial", "tests/multihost/": "serial"}


def _chain(nodeid: str) -> str | None:
    return next((name for prefix, name in CHAINS.items() if nodeid.startswith(prefix)), None)


def pytest_collection_modifyitems(config, items):
    # the chain first, so that it has a worker from the start (the scheduler hands out work in this order)
    prefixes = list(CHAINS)
    items.sort(key=lambda item: next((i for i, p in enumerate(prefixes) if item.nodeid.startswith(p)), len(prefixes)))


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Chains(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _chain(nodeid) or nodeid

    return Chains(config, log)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A PDSERVE_HOME of the test's own (in its temp dir), set for `pdserve` subprocesses too; no colours."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"
