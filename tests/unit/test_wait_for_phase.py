"""`up` waits for the phase its own supervisor writes. On re-attach, state.json still says "running" from
the supervisor that died; returning on that let `up` finish before the new supervisor had taken over."""

from pdserve.orchestrate import start
from pdserve.state.folder import ClusterDir
from pdserve.state.records import ClusterState, Phase, SupervisorRecord


class FakeSupervisor:
    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None   # still running


def state_of(phase: Phase, pid: int, error: str | None = None, url: str = "") -> ClusterState:
    return ClusterState("c", phase, url, supervisor=SupervisorRecord(pid, 1.0), error=error)


def test_a_terminal_phase_from_the_dead_supervisor_is_not_ours(tmp_path):
    cdir = ClusterDir("c", home=tmp_path)
    cdir.root.mkdir(parents=True)
    cdir.write_state(state_of(Phase.RUNNING, 111))   # left by the one that died
    seen: list[Phase] = []

    def on_update(state: ClusterState) -> None:
        seen.append(state.phase)
        if len(seen) == 3:   # the new supervisor takes over, then reports its own phase
            cdir.write_state(state_of(Phase.RUNNING, 222, url="adopted"))

    state = start.wait_for_phase(cdir, FakeSupervisor(222), on_update, poll=0.01)
    assert state.supervisor.pid == 222 and state.router_url == "adopted"
    assert len(seen) == 4


def test_its_own_failure_is_returned_at_once(tmp_path):
    cdir = ClusterDir("c", home=tmp_path)
    cdir.root.mkdir(parents=True)
    cdir.write_state(state_of(Phase.FAILED, 7, "boom"))
    state = start.wait_for_phase(cdir, FakeSupervisor(7), lambda s: None, poll=0.01)
    assert state.phase == Phase.FAILED and state.error == "boom"


class ExitedSupervisor(FakeSupervisor):
    def poll(self):
        return 1


def test_a_new_supervisor_that_dies_at_once_is_a_failure_not_the_old_running(tmp_path):
    cdir = ClusterDir("c", home=tmp_path)
    cdir.logs_dir.mkdir(parents=True)
    cdir.supervisor_log.write_text("Traceback ...\nImportError: no module named x\n")
    cdir.write_state(state_of(Phase.RUNNING, 111, "an old error"))
    state = start.wait_for_phase(cdir, ExitedSupervisor(222), lambda s: None, poll=0.01)
    assert state.phase == Phase.FAILED and "ImportError" in state.error and "old error" not in state.error
