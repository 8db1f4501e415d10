"""Process-state rules the supervisor relies on, checked as properties of the transition table (a table
edited into something unsafe fails here), plus the state file's typed records."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import PdserveError
from pdserve.launchers.base import Handle, LauncherKind
from pdserve.state.folder import ClusterDir
from pdserve.state.records import STATE_VERSION, ClusterState, Phase, ProcessRecord, ProcState, SupervisorRecord
from pdserve.supervise.transitions import ALLOWED, InvalidTransition, check_transition

S = ProcState


def reachable(start: ProcState, avoid: set[ProcState] = frozenset()) -> set[ProcState]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in ALLOWED[todo.pop()] - avoid:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_from_stopped():
    assert reachable(S.STOPPED) == set(ProcState)


def test_a_live_process_reaches_stopped_or_a_restart_only_through_stopping():
    """Nothing that has a process goes to stopped, backoff or fatal without the timed stop (so its tree
    is always killed first)."""
    for st in (S.STARTING, S.READY, S.UNHEALTHY):
        assert not ALLOWED[st] & {S.STOPPED, S.BACKOFF, S.FATAL}
        assert S.STOPPING in ALLOWED[st]
    assert ALLOWED[S.STOPPING] == {S.STOPPED, S.BACKOFF, S.FATAL}


def test_ready_is_reached_only_from_a_probed_state():
    assert {st for st in ProcState if S.READY in ALLOWED[st]} == {S.STARTING, S.UNHEALTHY}


def test_invalid_transitions_raise():
    with pytest.raises(InvalidTransition):
        check_transition(S.READY, S.STARTING)
    with pytest.raises(InvalidTransition):
        check_transition(S.STOPPED, S.READY)
    assert check_transition(S.STOPPING, S.BACKOFF) == S.BACKOFF


def test_has_process_only_where_a_death_is_news():
    assert {st for st in ProcState if st.has_process} == {S.STARTING, S.READY, S.UNHEALTHY}


def sample_state() -> ClusterState:
    h = Handle(LauncherKind.LOCAL, "local", 42, 1.5, "/h#prefill-0", "/h/logs/prefill-0.log")
    return ClusterState("c", Phase.DEGRADED, "http://127.0.0.1:8000",
                        {"prefill-0": ProcessRecord("prefill-0", "prefill", S.READY, "127.0.0.1", 8100, h, 9.0, 2, "ok"),
                         "router": ProcessRecord("router", "router", S.BACKOFF, "127.0.0.1", 8000)},
                        SupervisorRecord(7, 3.25), "boom")


def test_state_round_trips_through_the_one_writer_and_reader(tmp_path):
    cdir = ClusterDir("c", home=tmp_path)
    cdir.write_state(sample_state())
    raw = json.loads(cdir.state_path.read_text())
    assert raw["version"] == STATE_VERSION and raw["processes"]["prefill-0"]["handle"]["pid"] == 42
    back = cdir.read_state()
    want = sample_state()
    assert back.processes == want.processes and back.phase == Phase.DEGRADED and back.supervisor == want.supervisor


def test_a_version_1_file_is_read_as_the_same_records(tmp_path):
    cdir = ClusterDir("c", home=tmp_path)
    cdir.root.mkdir(parents=True)
    cdir.state_path.write_text(json.dumps({
        "cluster": "c", "phase": "running", "error": None, "updated_at": 1.0,
        "supervisor": {"pid": 7, "create_time": 3.25}, "router_url": "http://127.0.0.1:8000",
        "processes": {"decode-0": {"role": "decode", "state": "ready", "pid": 55, "create_time": 4.5,
                                   "host": "127.0.0.1", "port": 8200, "started_at": 2.0, "restarts": 1,
                                   "message": "", "marker": "/h#decode-0"}}}))
    st = cdir.read_state()
    d = st.processes["decode-0"]
    assert st.phase == Phase.RUNNING and st.supervisor == SupervisorRecord(7, 3.25)
    assert (d.handle.pid, d.handle.start_time, d.handle.marker, d.restarts) == (55, 4.5, "/h#decode-0", 1)
    assert d.handle.log_path.endswith("logs/decode-0.log")


def test_a_newer_file_is_refused_with_a_clear_error(tmp_path):
    cdir = ClusterDir("c", home=tmp_path)
    cdir.root.mkdir(parents=True)
    cdir.state_path.write_text(json.dumps({"version": STATE_VERSION + 1, "phase": "running"}))
    with pytest.raises(PdserveError, match="reads up to"):
        cdir.read_state()
