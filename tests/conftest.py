"""Settings and fixtures every test package shares (the helpers themselves are in tests/kits/)."""

from __future__ import annotations

import os
import tempfile

import pytest

import pytest


def pytest_configure(config):
    # One built-in model build per run: every PDSERVE_HOME a test makes (and every `pdserve` subprocess)
    # reads the models from this one folder, unless the caller named one already.
    if not os.environ.get("PDSERVE_MODELS"):
        os.environ["PDSERVE_MODELS"] = tempfile.mkdtemp(prefix="pdserve-test-models-")


@pytest.hookimpl(tryfirst=True)        # before xdist's own hook reads the group marks into the node ids
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (scripts/test.sh: --dist loadgroup), one worker runs the real-engine tests and the
    # network-namespace rigs one after another, in collection order: they share a cluster, pin cores and
    # use fixed bridge names. Every other test waits on sockets and subprocesses and spreads over workers.
    for item in items:
        if item.get_closest_marker("e2e") or item.path.parent.name == "multihost":
            item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A PDSERVE_HOME of the test's own (in its temp dir), set for `pdserve` subprocesses too; no colours."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"
