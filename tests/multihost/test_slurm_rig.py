"""The Slurm rig itself cleans up: no daemon or slurmstepd of it outlives the tests (its own module, so
no other rig of the same node name runs meanwhile)."""

from __future__ import annotations

import pytest

from tests.kits.slurm_rig import _rig_processes, missing_capability, start_slurm, stop_slurm


def test_the_rig_leaves_no_slurm_process_behind(tmp_path):
    if missing_capability():
        pytest.skip(missing_capability())
    rig = start_slurm(tmp_path / "own")
    assert len(_rig_processes(rig.env["SLURM_CONF"])) >= 4      # munged, slurmctld, slurmd, the job's stepd
    stop_slurm(rig)
    assert _rig_processes(rig.env["SLURM_CONF"]) == []
