"""Settings every test package shares."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config):
    # One built-in model build per run: every PDSERVE_HOME a test makes (and every `pdserve` subprocess)
    # reads the models from this one folder, unless the caller named one already.
    if not os.environ.get("PDSERVE_MODELS"):
        os.environ["PDSERVE_MODELS"] = tempfile.mkdtemp(prefix="pdserve-test-models-")


def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (scripts/test.sh: --dist loadgroup), one worker runs the real-engine tests and the
    # network-namespace rigs one after another, in collection order: they share a cluster, pin cores and
    # use fixed bridge names. Every other test waits on sockets and subprocesses and spreads over workers.
    import pytest
    for item in items:
        if item.get_closest_marker("e2e") or item.path.parent.name == "multihost":
            item.add_marker(pytest.mark.xdist_group("serial"))
