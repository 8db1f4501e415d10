"""The Slurm launcher against a real one-node Slurm: steps named after cluster and process, found and
cancelled by name from a handle alone (as `down` does after the supervisor died). No vLLM: seconds."""

from __future__ import annotations

import signal
import sys
import time

from pdserve.launchers.base import Handle, LauncherKind
from pdserve.launchers.slurm import SlurmLauncher
from pdserve.plan.records import MARKER_ENV, ClusterPlan, HostPlan, ProcessPlan
from tests.kits.leader import LEADER
from tests.kits.slurm_rig import NODE
from tests.kits.waits import wait_value


def cluster(job_id: str) -> ClusterPlan:
    return ClusterPlan(name="t", processes=[], router_config={}, router_config_path="", builtin_model=None,
                       model_path="", supervisor={}, launcher="slurm",
                       hosts=[HostPlan(NODE, "127.0.0.1", python=sys.executable)],
                       launcher_settings={"job_id": job_id})


def test_a_server_is_a_named_step_that_down_cancels_from_its_handle(slurm, tmp_path):
    launcher = SlurmLauncher(cluster(slurm.job_id))
    proc = ProcessPlan(name="decode-0", role="decode", argv=[sys.executable, "-c", LEADER],
                       env={"HOSTNAME_TAG": NODE, MARKER_ENV: f"t#decode-0#{time.time()}"}, host="127.0.0.1",
                       port=0, health_url="", host_name=NODE)
    handle = launcher.start(proc, tmp_path / "decode-0.log")
    try:
        # alive at once, while its step is not in squeue yet (the supervisor looks within ms of the start: in CI
        # a server was once taken for dead and cancelled there); that moment pinned by an empty squeue answer
        listed = launcher.steps
        launcher.steps = lambda h: []
        assert launcher.is_alive(handle)
        launcher.steps = listed
        assert (handle.launcher, handle.job_id, handle.step_name) == (LauncherKind.SLURM, slurm.job_id, "pdserve.t.decode-0")
        assert wait_value(lambda: bool(launcher.steps(handle)))
        assert slurm.steps() == ["pdserve.t.decode-0"]
        assert wait_value(lambda: "hello from pdnode" in launcher.read_log(handle, 20))
        # A new launcher with only the handle from state.json: the supervisor and its srun client are gone.
        later = SlurmLauncher(cluster(slurm.job_id))
        again = Handle.from_dict(handle.to_dict())
        assert later.adopt(again) == again and later.tree_alive(again) >= 1
        launcher._clients.signal(launcher._client(handle), signal.SIGKILL)     # the srun client dies
        assert later.is_alive(again), "the step outlives its srun client"
        assert later.signal(again, signal.SIGKILL) >= 1
        assert wait_value(lambda: not later.is_alive(again), timeout=30)
        assert slurm.steps() == [] and later.adopt(again) is None
    finally:
        launcher.signal(handle, signal.SIGKILL)


def test_probe_runs_on_the_node_as_a_step(slurm):
    facts = SlurmLauncher(cluster(slurm.job_id)).probe(NODE, "127.0.0.1", [], efa=False)
    assert facts["vllm"] and facts["cpus"] >= 1

