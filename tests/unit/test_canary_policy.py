"""The supervisor's canary decisions, with scripted canary outcomes (no processes): start-up gives up
after CANARY_TRIES failures; after a prefill restart, a path that keeps failing restarts the decode
servers (stale NIXL agent state); after a decode restart it does not."""

from __future__ import annotations

import itertools
from pathlib import Path

from pdserve.state.records import Phase
from pdserve.supervise.canary import CANARY_TRIES
from pdserve.supervise.supervisor import Supervisor
from tests.kits.supervisor_rig import Rig


def supervisor(tmp_path: Path, outcomes: list[bool]) -> Supervisor:
    return Rig(tmp_path, canary=outcomes).sup


def later():
    """Monotonic-looking times far enough apart that no try waits for the 2 s pause."""
    return (1e9 + 10 * i for i in itertools.count())


def test_start_up_fails_after_the_tries_and_passes_on_a_success(tmp_path):
    sup, t = supervisor(tmp_path, [False] * CANARY_TRIES), later()
    results = [sup._canary_passes(next(t)) for _ in range(CANARY_TRIES)]
    assert results == [False] * CANARY_TRIES and sup.phase == Phase.FAILED and "no KV" in sup.error
    ok = supervisor(tmp_path, [False, True])
    assert [ok._canary_passes(next(t)) for _ in range(2)] == [False, True] and ok.phase == Phase.STARTING


def test_a_failed_try_waits_before_the_next(tmp_path):
    sup = supervisor(tmp_path, [False, True])
    assert sup._canary_passes(0.0) is False
    assert sup._canary_passes(0.0) is False          # too soon: no second canary yet
    assert sup.canary.failures == 1


def test_prefill_restart_with_a_failing_path_restarts_decode(tmp_path):
    sup, t = supervisor(tmp_path, [False] * CANARY_TRIES), later()
    sup._verify = {"prefill-0"}
    for _ in range(CANARY_TRIES):
        sup._verify_restarted(next(t))
    assert list(sup.restart_queue) == ["decode-0"] and not sup._verify


def test_decode_restart_with_a_failing_path_restarts_nothing_more(tmp_path):
    sup, t = supervisor(tmp_path, [False] * CANARY_TRIES), later()
    sup._verify = {"decode-0"}
    for _ in range(CANARY_TRIES):
        sup._verify_restarted(next(t))
    assert not sup.restart_queue and not sup._verify


def test_a_passing_canary_clears_the_check_and_the_count(tmp_path):
    sup, t = supervisor(tmp_path, [False, True, False]), later()
    sup._verify = {"prefill-0"}
    sup._verify_restarted(next(t))
    assert sup._verify and sup.canary.failures == 1
    sup._verify_restarted(next(t))
    assert not sup._verify and sup.canary.failures == 0 and not sup.restart_queue


def test_canary_text_is_fresh_from_its_first_token():
    # D's prefix cache held a repeated canary: D then read 2 tokens from P and the check proved nothing.
    from pdserve.supervise.canary import canary_text
    a, b = canary_text(), canary_text()
    assert a.split()[0] != b.split()[0] and len(a.split()) > 160
