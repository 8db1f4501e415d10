"""Settings every test package shares."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config):
    # One built-in model build per run: every PDSERVE_HOME a test makes (and every `pdserve` subprocess)
    # reads the models from this one folder, unless the caller named one already.
    if not os.environ.get("PDSERVE_MODELS"):
        os.environ["PDSERVE_MODELS"] = tempfile.mkdtemp(prefix="pdserve-test-models-")
