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


# Under pytest-xdist (scripts/test.sh: -n N --dist loadgroup), one worker runs the real-engine tests and the
# network-namespace rigs one after another, in collection order: they share a cluster, pin cores and use
# fixed bridge names. Every other test waits on sockets and subprocesses and goes to any worker on its own.
# (xdist's own xdist_group marks did not group anything under pytest 9: their node-id suffix never reached
# the scheduler; this scheduler groups by path instead.)
SERIAL = ("tests/e2e/", "tests/multihost/")


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SerialGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "serial" if nodeid.startswith(SERIAL) else nodeid

    return SerialGroup(config, log)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A PDSERVE_HOME of the test's own (in its temp dir), set for `pdserve` subprocesses too; no colours."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"
