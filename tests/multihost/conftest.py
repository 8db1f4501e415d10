"""Fixtures: the two-namespace ssh rig (module-scoped: sshd start-up is cheap, but tests share it)."""

from __future__ import annotations

import pytest

from tests.multihost.netns import make_rig, missing_capability, teardown


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    why = missing_capability()
    if why:
        pytest.skip(f"network-namespace ssh rig: {why}")
    rig = make_rig(tmp_path_factory.mktemp("netns"))
    try:
        yield rig
    finally:
        teardown(rig)
