"""The held-KV ledger's policy (router/kv/held.py, held_ledger.py, held_control.py) with fakes: the budget's
victims, what is released when and with which grace, the lease, and what is never released (an entry handed to
P, a restarted server's)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.kv.held import LRU, RELEASED, HeldKV
from pdserve.router.kv.held_control import P_READ_MARGIN_S
from pdserve.router.kv.held_ledger import Ledger, capacity_of, held_tokens
from pdserve.router.kv.store_memory import MemoryTable
from pdserve.router.telemetry.metrics import RouterMetrics
from tests.kits.held_fakes import BLOCK, Clock, FakeControl, FakeTurn, cfg, params, put, rig, sample


# -- reading D -----------------------------------------------------------------------------------------
def test_capacity_from_vllms_cache_config_info():
    text = ('vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="23424",'
            'num_gpu_blocks="732"} 1.0\n')
    assert capacity_of(text) == (23424, 32)
    # without vLLM's group-aware count: blocks x block size; data-parallel engines add up
    two = ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
           'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0\n')
    assert capacity_of(two) == (3200, 16)
    assert capacity_of('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n') == (None, 16)
    assert capacity_of("") == (None, None)


def test_held_tokens_count_whole_blocks_once_the_block_size_is_known():
    p = params("r", 33)
    assert held_tokens(p, None) == 33
    assert held_tokens(p, BLOCK) == 3 * BLOCK


# -- the ledger's policy -------------------------------------------------------------------------------
def test_over_budget_releases_the_least_recently_used_of_that_decode_server_only():
    clock = Clock()
    ledger = Ledger(0.5, 3600, clock)
    for name in ("d0", "d1"):
        ledger.decode(name).capacity, ledger.decode(name).control = 1000, True
    for i, decode in enumerate(["d0", "d1", "d0", "d0"]):
        clock.t += 1
        ledger.add(("t", f"c{i}"), params(f"r{i}", 200), decode)
    assert ledger.budget("d0") == 500 and ledger.decode("d0").tokens == 600
    victims = ledger.over_budget("d0")
    assert [v.request_id for v in victims] == ["r0"]               # oldest first, d1's never
    assert ledger.decode("d0").tokens == 400 and ledger.decode("d1").tokens == 200
    assert ledger.over_budget("d0") == []


def test_an_entry_taken_for_a_turn_counts_but_is_never_a_victim_and_a_turn_over_the_whole_budget_goes_too():
    ledger = Ledger(0.5, 3600, Clock())
    ledger.decode("d0").capacity, ledger.decode("d0").control = 1000, True
    ledger.add(("t", "a"), params("ra", 300), "d0")
    ledger.take("ra")                            # handed to a turn: P may be reading it
    ledger.add(("t", "b"), params("rb", 300), "d0")
    assert [v.request_id for v in ledger.over_budget("d0")] == ["rb"]
    assert ledger.decode("d0").tokens == 300 and "ra" in ledger.by_id


def test_no_budget_without_a_capacity_a_share_or_a_server_that_can_release():
    ledger = Ledger(0.5, 3600, Clock())
    ledger.add(("t", "a"), params("ra", 900), "d0")
    assert ledger.budget("d0") is None and ledger.over_budget("d0") == []
    ledger.decode("d0").capacity = 1000
    ledger.decode("d0").control = False
    assert ledger.budget("d0") is None
    assert Ledger(0.0, 3600, Clock()).budget("d0") is None


def test_the_lease_renews_table_entries_near_their_expiry_under_budget_and_within_the_lease_only():
    clock = Clock()
    ledger = Ledger(0.5, 100, clock)
    ledger.decode("d0").capacity, ledger.decode("d0").control = 1000, True
    ledger.add(("t", "a"), params("ra", 100), "d0", expires=clock.t + 10, continued=True)
    ledger.add(("t", "b"), params("rb", 100), "d0", expires=clock.t + 60, continued=True)
    ledger.add(("t", "c"), params("rc", 100), "d0", expires=clock.t + 10, continued=True)
    ledger.take("rc")
    assert [h.request_id for h in ledger.due(lead=15)] == ["ra"]
    clock.t += 100                                  # used longer ago than the lease
    assert ledger.due(lead=1000) == []
    ledger.lease = 1000
    ledger.add(("t", "d"), params("rd", 400), "d0", expires=clock.t + 1, continued=True)    # now over budget
    assert ledger.due(lead=1000) == []
    assert Ledger(0.5, 0, clock).due(lead=1000) == []


# -- releases, wired to a table and a fake D -------------------------------------------------------------
async def test_an_lru_victim_leaves_the_table_first_is_released_at_once_and_its_next_turn_misses_released():
    held, table, control, clock, metrics = await rig(capacity=1024)     # budget 512 tokens
    for i in range(3):
        put(table, control, clock, f"c{i}", f"r{i}", 200)
        held.stored(FakeTurn(f"turn{i}"), "d0")
    await held.settled()
    assert control.released() == [(["r0"], 0.0)]
    assert ("t", "c0") not in table._entries and ("t", "c2") in table._entries
    assert held.ledger.decode("d0").tokens == 416 <= 512         # whole blocks: 13 x 16 each
    assert sample(metrics, "pdserve_router_held_kv_releases_total", reason=LRU) == 1
    assert sample(metrics, "pdserve_router_held_kv_tokens", decode="d0") == 416
    assert sample(metrics, "pdserve_router_held_kv_budget_tokens", decode="d0") == 512
    entry, why = table.take_first([("t", "c0")])
    assert held.taken(FakeTurn("turn3"), [("t", "c0")], entry, why) == RELEASED
    assert held.taken(FakeTurn("turn4"), [("t", "c0")], None, "no_entry") == "no_entry"   # said once
    # a client that rewrote c0's reply looks for it by its prompt: released too
    assert held.taken(FakeTurn("turn5"), [("t", "x"), ("t", "prompt-c0")], None, "no_entry") == RELEASED


@pytest.mark.parametrize("turn, grace", [
    (FakeTurn("t", prefill_ms=12.0, pulled=0), 0.0),            # P answered without reading: done with it
    (FakeTurn("t", plan="decode_only"), 0.0),                    # D alone: never handed to P
    (FakeTurn("t", prefill_ms=None), P_READ_MARGIN_S),           # P's leg did not end: it may be reading
    (FakeTurn("t", prefill_ms=12.0, pulled=None), 0.0),          # P does not count its pulls: release anyway
    (FakeTurn("t", prefill_ms=12.0, pulled=300), None),          # P read it: D freed it at the read
], ids=["miss", "decode_only", "p_leg_unfinished", "pull_unknown", "pulled"])
async def test_an_entry_taken_for_a_turn_is_released_when_the_turn_is_done_with_it(turn, grace):
    held, table, control, clock, metrics = await rig()
    put(table, control, clock, "c", "r1", 300)
    entry, why = table.take_first([("t", "c")])
    assert held.taken(turn, [("t", "c")], entry, why) == "ok"
    assert held.ledger.decode("d0").tokens == 304              # still held on D while the turn runs
    held.ended(turn)
    held.ended(turn)                                            # once
    await held.settled()
    assert control.released() == ([] if grace is None else [(["r1"], grace)])
    assert held.ledger.decode("d0").tokens == 0


async def test_replaced_evicted_and_expired_entries_are_released_a_restarted_servers_forgotten():
    held, table, control, clock, metrics = await rig()
    table.max_entries = 2
    put(table, control, clock, "a", "ra", 50)
    put(table, control, clock, "a", "ra2", 50)          # replaces ra
    put(table, control, clock, "b", "rb", 50)
    put(table, control, clock, "c", "rc", 50)           # evicts ra2 (the oldest)
    clock.t += 10_000
    table.purge_expired()                               # rb and rc expire
    await held.settled()
    reasons = {reason: sample(metrics, "pdserve_router_held_kv_releases_total", reason=reason)
               for reason in ("replaced", "evicted", "expired")}
    assert reasons == {"replaced": 1, "evicted": 1, "expired": 2}
    assert [ids for ids, _ in control.released()] == [["ra"], ["ra2"], ["rb"], ["rc"]]
    put(table, control, clock, "d", "rd", 50)
    put(table, control, clock, "e", "re", 50, engine="e2")      # a new engine: D restarted
    await held.settled()
    assert [ids for ids, _ in control.released()][-1] == ["rc"]  # rd is not released on the new engine
    assert set(held.ledger.by_id) == {"re"}


async def test_a_turn_the_router_keeps_nothing_of_is_released_at_once():
    held, table, control, clock, metrics = await rig()
    held.untracked(FakeTurn("t"), "d0", params("ru", 100))
    held.untracked(FakeTurn("t"), "d0", None)
    await held.settled()
    assert control.released() == [(["ru"], 0.0)]


async def test_the_lease_renews_before_the_routers_expiry_and_hands_p_the_new_deadline():
    held, table, control, clock, metrics = await rig(decoder_kv_blocks_ttl=480.0)
    put(table, control, clock, "a", "ra", 100, continued=True)
    put(table, control, clock, "b", "rb", 100, continued=True)
    control.held.discard("rb")                          # D let rb go (its timer)
    assert await held.renew_due() == 0                  # not due yet
    clock.t += 432 - held.lease.lead + 1
    assert await held.renew_due() == 1
    entry = table._entries[("t", "a")]
    assert entry.params["remote_blocks_expiry_time"] == control.now + 480   # what P is handed from now on
    assert entry.expires == pytest.approx(clock.t + 480 - held.lease.margin)
    assert ("t", "b") not in table._entries             # D no longer holds it: no turn may be handed it
    assert sample(metrics, "pdserve_router_held_kv_renewals_total") == 1
    clock.t += 432
    assert await held.renew_due() == 1                  # and again: the lease outlives decoder_kv_blocks_ttl
    assert table.take(("t", "a"))[1] == "ok"


async def test_pressure_wins_over_the_lease_a_renewed_idle_conversation_is_released_first():
    held, table, control, clock, metrics = await rig(capacity=1024, decoder_kv_blocks_ttl=480.0)   # budget 512
    put(table, control, clock, "idle", "r-idle", 200, continued=True)
    clock.t += 432 - held.lease.lead + 1
    assert await held.renew_due() == 1                  # renewed: alive past D's timer, as old as its last turn
    for i in range(2):
        put(table, control, clock, f"busy{i}", f"r{i}", 200)
        held.stored(FakeTurn(f"turn{i}"), "d0")
    await held.settled()
    assert control.released() == [(["r-idle"], 0.0)]   # over the budget: the idle one goes first
    assert ("t", "idle") not in table._entries and ("t", "busy0") in table._entries


async def test_a_server_without_the_control_is_said_once_and_never_budgeted(caplog):
    clock, control, metrics = Clock(), FakeControl(status=404), RouterMetrics()
    c = cfg()
    table = MemoryTable(c.reuse_ttl, clock)
    held = HeldKV(c, ["d0"], metrics, control, clock)

    class Store:
        pass
    store = Store()
    store.table = table
    held.attach(store)
    await held.learn("d0")
    for i in range(5):
        put(table, control, clock, f"c{i}", f"r{i}", 200)
        held.stored(FakeTurn(f"t{i}"), "d0")
    await held.settled()
    assert len(table) == 5 and control.released() == []
    assert sample(metrics, "pdserve_router_held_kv_control", decode="d0") == 0
    assert sum("has no held-KV control" in r.message for r in caplog.records) == 1


async def test_turned_off_nothing_is_watched_or_released():
    clock, control, metrics = Clock(), FakeControl(), RouterMetrics()
    held = HeldKV(cfg(held_kv=False), ["d0"], metrics, control, clock)

    class Store:
        pass
    store = Store()
    store.table = MemoryTable(432, clock)
    assert not held.attach(store)
    entry_params = params("r", 100)
    store.table.put(("t", "c"), entry_params, "d0", 0, None)
    entry, why = store.table.take_first([("t", "c")])
    held.taken(FakeTurn("t"), [("t", "c")], entry, why)
    held.ended(FakeTurn("t", prefill_ms=1.0))
    held.untracked(FakeTurn("u"), "d0", params("u", 10))
    await asyncio.sleep(0)
    assert control.calls == []


async def test_with_a_shared_store_only_what_this_router_took_and_did_not_use_is_released():
    clock, control, metrics = Clock(), FakeControl(), RouterMetrics()
    held = HeldKV(cfg(), ["d0"], metrics, control, clock)
    assert not held.attach(object())             # a Redis store: no table to withdraw from or renew in
    from pdserve.router.kv.reuse import ReuseEntry
    entry = ReuseEntry(params("r", 100), "d0", None, float("inf"))
    held.taken(FakeTurn("t"), [("t", "c")], entry, "ok")
    held.stored(FakeTurn("t", prefill_ms=3.0, pulled=0), "d0")
    await held.settled()
    assert control.released() == [(["r"], 0.0)]
    assert await held.renew_due() == 0


# -- status -------------------------------------------------------------------------------------------------
HELD_METRICS = '''pdserve_router_held_kv_tokens{decode="decode-0"} 9216.0
pdserve_router_held_kv_budget_tokens{decode="decode-0"} 11712.0
pdserve_router_held_kv_capacity_tokens{decode="decode-0"} 23424.0
pdserve_router_held_kv_control{decode="decode-0"} 1.0
pdserve_router_held_kv_tokens{decode="decode-1"} 0.0
pdserve_router_held_kv_control{decode="decode-1"} 0.0
pdserve_router_held_kv_releases_total{reason="lru"} 10.0
pdserve_router_held_kv_releases_total{reason="unused"} 2.0
pdserve_router_held_kv_releases_total{reason="expired"} 0.0
pdserve_router_held_kv_renewals_total 3.0
pdserve_router_held_kv_control_failures_total{op="release"} 1.0
'''


def test_status_shows_held_tokens_per_decode_server_releases_by_reason_and_renewals():
    from rich.console import Console

    from pdserve.cli.status import _view
    from pdserve.observe.routerstats import add_held, parse_metrics
    from pdserve.orchestrate.view import ClusterView
    from pdserve.state.records import Phase
    held = parse_metrics(HELD_METRICS)["held_kv"]
    assert held["tokens"] == {"decode-0": 9216, "decode-1": 0} and held["budget"] == {"decode-0": 11712}
    assert held["releases"] == {"lru": 10, "unused": 2, "expired": 0} and held["renewals"] == 3
    both = add_held(held, held)
    assert both["tokens"]["decode-0"] == 2 * 9216 and both["releases"]["lru"] == 20 and both["renewals"] == 6

    def shown(text: str) -> str:
        console = Console(width=250, record=True)
        console.print(_view(ClusterView(name="c", phase=Phase.RUNNING, running=True, supervisor_alive=True,
                                        error=None, router_url="http://r", processes=[],
                                        router=parse_metrics(text), transfers=None, state_dir="",
                                        scrape_targets="")))
        return console.export_text()

    out = shown(HELD_METRICS)
    assert ("held KV on decode (tokens/budget): decode-0 9216/11712, decode-1 0/-; released: lru 10, unused 2; "
            "renewed 3; failed control calls 1") in out
    assert "no held-KV control on decode-1" in out
    assert "held KV" not in shown('pdserve_router_turns_total{outcome="stored"} 3\n')


def test_entries_stored_before_the_block_size_was_known_are_counted_again_in_whole_blocks():
    ledger = Ledger(0.5, 3600, Clock())
    ledger.add(("t", "a"), params("ra", 33), "d0")
    assert ledger.decode("d0").tokens == 33
    ledger.learned("d0", 1024, BLOCK)
    assert ledger.decode("d0").tokens == 48 and ledger.by_id["ra"].tokens == 48


@pytest.mark.parametrize("answer", [{"now": 100.0, "results": ["ra"]}, {"now": 100.0, "results": {"ra": "renewed"}},
                                    {"now": "x", "results": {"ra": {"status": "renewed", "deadline": 580.0}}},
                                    {"results": 7}, [1, 2]])
async def test_a_malformed_renew_answer_is_a_counted_failure_said_once_and_the_other_decode_still_renews(answer, caplog):
    """Issue 45: a malformed renew answer raised in the lease round (a traceback every ~0.4 s) and aborted the
    renewals of every other decode server too."""
    held, table, control, clock, metrics = await rig(decoder_kv_blocks_ttl=480.0)
    put(table, control, clock, "a", "ra", 100, decode="d0", continued=True)
    put(table, control, clock, "b", "rb", 100, decode="d1", continued=True)
    real = control.call

    async def call(decode, method, path, body=None):
        if decode == "d0" and path.endswith("/renew"):
            control.calls.append((decode, method, path, body))
            return 200, answer
        return await real(decode, method, path, body)
    control.call = call
    clock.t += 432 - held.lease.lead + 2
    for _ in range(3):
        assert await held.renew_due() == 1                 # d1's entry; d0's answer could not be read
        clock.t += 432                                      # due again
    assert ("t", "a") in table._entries                     # not withdrawn: the router's own expiry stands
    assert sample(metrics, "pdserve_router_held_kv_control_failures_total", op="renew") == 3
    assert not [r for r in caplog.records if r.exc_info]
    assert len([r for r in caplog.records if "renew" in r.getMessage() and "d0" in r.getMessage()]) == 1
