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


# Under pytest-xdist (scripts/test.sh: -n N --dist loadgroup), two chains run each on one worker, in
# collection order, beside each other from the start: the real-engine tests (they share one cluster) and the
# network-namespace rigs (fixed bridge names; their own clusters). Every other test waits on sockets and
# subprocesses and goes to any worker on its own. (xdist's own xdist_group marks grouped nothing under
# pytest 9.2: their node-id suffix never reached the scheduler; this scheduler groups by path instead.)
CHAINS = {"tests/e2e/": "e2e", "tests/multihost/": "netns"}


def _chain(nodeid: str) -> str | None:
    return next((name for prefix, name in CHAINS.items() if nodeid.startswith(prefix)), None)


def pytest_collection_modifyitems(config, items):
    # the chains first, so that each has a worker from the start (the scheduler hands out work in this order)
    order = list(CHAINS.values())
    items.sort(key=lambda item: order.index(c) if (c := _chain(item.nodeid)) else len(order))


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
