"""Fixtures: the two-namespace ssh rig (module-scoped: sshd start-up is cheap, but tests share it)."""

from __future__ import annotations

import pytest

from tests.kits.netns_rig import make_rig, missing_capability, teardown


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


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, monkeypatch_module):
    from tests.kits.slurm_rig import missing_capability as slurm_missing, start_slurm, stop_slurm
    why = slurm_missing()
    if why:
        pytest.skip(f"one-node Slurm rig: {why}")
    rig = start_slurm(tmp_path_factory.mktemp("slurm"))
    for key, value in rig.env.items():           # srun/squeue/scancel, here and in pdserve subprocesses
        monkeypatch_module.setenv(key, value)
    try:
        yield rig
    finally:
        stop_slurm(rig)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
