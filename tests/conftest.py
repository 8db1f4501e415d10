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


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A PDSERVE_HOME of the test's own (in its temp dir), set for `pdserve` subprocesses too; no colours."""
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NO_COLOR", "1")
    return tmp_path / "home"
