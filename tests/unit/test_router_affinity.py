"""Prefill policy `affinity`: one prefill server per conversation, stable, spread, and failing over."""

from __future__ import annotations

from pdserve.router.config import BackendConfig
from pdserve.router.route import affinity
from pdserve.router.route.backends import Pool
from pdserve.router.telemetry.metrics import RouterMetrics


def _pool(n: int) -> Pool:
    pool = Pool("prefill", [BackendConfig(f"prefill-{i}", f"http://p{i}") for i in range(n)], RouterMetrics())
    for b in pool.backends:
        b.healthy = True
    return pool


def _history(c: int, turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "tools"}, {"role": "user", "content": f"task {c}"}]
    for t in range(turns):
        msgs += [{"role": "assistant", "content": f"reply {t}"}, {"role": "user", "content": f"more {t}"}]
    return msgs


def test_a_conversation_stays_on_one_prefill_server_across_turns_and_load():
    pool = _pool(4)
    picked = set()
    for turn in range(6):
        key = affinity.anchor(None, "tenant", _history(7, turn))
        backend = affinity.pick(pool, key, set())
        backend.in_flight += 3          # load elsewhere must not move it (least-loaded would)
        picked.add(backend.name)
    assert len(picked) == 1
    # an explicit id anchors too, and differs per tenant-scoped id
    assert affinity.anchor(("t", "id:a"), "t", None) != affinity.anchor(("t", "id:b"), "t", None)
    assert affinity.anchor(None, "t", None) is None and affinity.anchor(None, "t", [{"role": "system"}]) is None


def test_conversations_spread_over_servers_and_tenants_do_not_share_an_anchor():
    pool = _pool(4)
    counts: dict[str, int] = {}
    for c in range(400):
        name = affinity.pick(pool, affinity.anchor(None, "tenant", _history(c, 1)), set()).name
        counts[name] = counts.get(name, 0) + 1
    assert len(counts) == 4 and min(counts.values()) > 60, counts
    assert affinity.anchor(None, "a", _history(1, 0)) != affinity.anchor(None, "b", _history(1, 0))


def test_fails_over_to_least_loaded_and_returns_home_when_healthy():
    pool = _pool(3)
    key = affinity.anchor(None, "t", _history(3, 0))
    home = affinity.pick(pool, key, set())
    others = [b for b in pool.backends if b is not home]
    others[0].in_flight = 5
    home.healthy = False
    assert affinity.pick(pool, key, set()) is others[1]           # least loaded of the rest
    home.healthy = True
    assert affinity.pick(pool, key, {home.name}) is others[1]     # already tried for this request
    for _ in range(3):
        home.breaker.record(False)
    assert affinity.pick(pool, key, set()) is not home            # breaker open
    assert affinity.pick(_pool(3), None, set()) is not None       # no anchor: plain least-loaded


def test_removing_a_server_moves_only_its_conversations():
    names = [f"prefill-{i}" for i in range(4)]
    keys = [f"k{i}" for i in range(200)]
    before = {k: affinity.ranked(k, names)[0] for k in keys}
    after = {k: affinity.ranked(k, names[:3])[0] for k in keys}
    assert all(before[k] == after[k] for k in keys if before[k] != "prefill-3")
