from __future__ import annotations

import pytest

from pdserve.state.records import ALLOWED, InvalidTransition, ProcState, check_transition

LEGAL = [(a, b) for a, bs in ALLOWED.items() for b in bs]
ILLEGAL = [(a, b) for a in ProcState for b in ProcState if b not in ALLOWED[a]]


@pytest.mark.parametrize("a,b", LEGAL, ids=[f"{a.value}->{b.value}" for a, b in LEGAL])
def test_allowed(a, b):
    assert check_transition(a, b) is b


@pytest.mark.parametrize("a,b", ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_refused(a, b):
    with pytest.raises(InvalidTransition):
        check_transition(a, b)


def test_key_paths():
    assert ProcState.READY in ALLOWED[ProcState.STARTING]
    assert ProcState.READY not in ALLOWED[ProcState.STOPPED]     # ready only after starting (a health check)
    assert ProcState.FATAL not in ALLOWED[ProcState.READY]       # a ready process dies into backoff first
    assert {s for s in ProcState if s.running} == {ProcState.STARTING, ProcState.READY, ProcState.UNHEALTHY}
