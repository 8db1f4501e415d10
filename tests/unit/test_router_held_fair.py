"""Fair held KV (issue 45, item 5), the policy with fakes: the budget's victims come from the tenant most over
its equal share (router/kv/held_ledger.py's over_budget), counted `lru` (the crossing tenant's own) or
`over_share` (another's); and the lease's bound: only conversations that came back are renewed, never past
held_kv_lease after their last turn (held_ledger.py's due, held_control.py's Lease), kept across a drained
restart (store_file.py)."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.router.kv import store_file
from pdserve.router.kv.held import LRU, OVER_SHARE, RELEASED, came_back
from pdserve.router.kv.held_ledger import Ledger
from pdserve.router.kv.reuse import FIRST, HIT, MISS, NO_ENTRY
from pdserve.router.kv.store_memory import MemoryTable
from tests.kits.held_fakes import Clock, FakeTurn, params, put, rig, sample

CHAT = SimpleNamespace(messages=[{"role": "user", "content": "hi"}])    # a turn's Conversation, with a history
COMPLETIONS = SimpleNamespace(messages=None)                             # ... and one without (completions)


def ledger(capacity: int = 1000) -> tuple[Ledger, Clock]:
    clock = Clock()
    led = Ledger(0.5, 3600, clock)
    led.decode("d0").capacity, led.decode("d0").control = capacity, True
    return led, clock


def add(led: Ledger, clock: Clock, tenant: str, name: str, tokens: int) -> None:
    clock.t += 1
    led.add((tenant, name), params(name, tokens), "d0")


def test_a_flood_releases_its_own_oldest_and_a_tenant_within_its_share_keeps_its_conversation():
    """Before: plain LRU over the whole budget released b's conversation (the oldest entry) for a's flood."""
    led, clock = ledger()                                  # budget 500 tokens; 250 a tenant while two hold any
    add(led, clock, "b", "b0", 100)
    for i in range(5):
        add(led, clock, "a", f"a{i}", 100)
    assert [v.request_id for v in led.over_budget("d0")] == ["a0"]
    assert led.decode("d0").tenant_tokens == {"a": 400, "b": 100}
    # b grows past its share: whoever holds the most gives way, each its least recently used first
    add(led, clock, "b", "b1", 250)                        # a 400, b 350: 750 over 500
    assert [v.request_id for v in led.over_budget("d0")] == ["a1", "b0", "a2"]
    assert led.decode("d0").tenant_tokens == {"a": 200, "b": 250} and led.decode("d0").tokens == 450


def test_a_tenant_within_its_share_is_not_released_even_when_the_one_over_has_only_turns_in_flight():
    led, clock = ledger(capacity=400)                      # budget 200: 100 a tenant
    for i in range(3):
        add(led, clock, "a", f"a{i}", 100)
        led.take(f"a{i}")                                  # handed to turns: never victims
    add(led, clock, "b", "b0", 100)
    assert led.over_budget("d0") == [] and "b0" in led.by_id   # over by turns in flight only, for now
    led.remove("a0")                                       # a's turns end
    led.remove("a1")
    led.remove("a2")
    assert led.decode("d0").tenant_tokens == {"b": 100} and set(led.decode("d0").tenants) == {"b"}


async def test_releases_are_counted_lru_for_the_crossing_tenants_own_over_share_for_anothers():
    held, table, control, clock, metrics = await rig(capacity=1024)     # budget 512: 256 a tenant with two
    for i in range(4):                                     # 160 tokens each (whole blocks)
        put(table, control, clock, f"a{i}", f"ra{i}", 150, tenant="a")
        held.stored(FakeTurn(f"turn-a{i}"), "d0", params(f"ra{i}", 150))
    await held.settled()
    assert control.released() == [(["ra0"], 0.0)]          # a's fourth turn: a alone, its own oldest
    put(table, control, clock, "b0", "rb0", 150, tenant="b")
    held.stored(FakeTurn("turn-b0"), "d0", params("rb0", 150))
    await held.settled()
    assert control.released()[-1] == (["ra1"], 0.0)       # b's turn: a holds more than its half
    assert sample(metrics, "pdserve_router_held_kv_releases_total", reason=LRU) == 1
    assert sample(metrics, "pdserve_router_held_kv_releases_total", reason=OVER_SHARE) == 1
    entry, why = table.take_first([("a", "a1")])
    assert held.taken(FakeTurn("turn-a1b"), [("a", "a1")], entry, why) == RELEASED


def test_a_turn_came_back_when_it_took_its_entry_its_entry_was_released_or_its_history_has_a_reply():
    assert came_back(FakeTurn("t"), took=True)
    assert came_back(FakeTurn("t", reuse=(MISS, RELEASED)), took=False)
    assert came_back(FakeTurn("t", reuse=(MISS, NO_ENTRY), conversation=CHAT), took=False)    # a follow-up
    assert came_back(FakeTurn("t", reuse=(HIT, "continuation"), conversation=CHAT), took=False)
    assert not came_back(FakeTurn("t", reuse=(FIRST, NO_ENTRY), conversation=CHAT), took=False)
    assert not came_back(FakeTurn("t", reuse=(MISS, NO_ENTRY), conversation=COMPLETIONS), took=False)
    assert not came_back(FakeTurn("t"), took=False)


async def run_lease(held, table, clock, until: float) -> list[float]:
    """The lease's rounds and the table's purge, every 5 s until `until`: when each renewal landed."""
    renewed = []
    while clock.t < until:
        clock.t += 5
        if await held.renew_due():
            renewed.append(clock.t)
        table.purge_expired()
    await held.settled()
    return renewed


async def test_a_conversation_that_never_came_back_is_not_renewed_and_goes_at_reuse_ttl():
    """Before: renewed until held_kv_lease (3600 s) after its one turn, though nobody came back."""
    held, table, control, clock, metrics = await rig(decoder_kv_blocks_ttl=480.0, held_kv_lease=3600.0)
    put(table, control, clock, "one", "r1", 100)
    held.stored(FakeTurn("t1", reuse=(FIRST, NO_ENTRY), conversation=CHAT), "d0", params("r1", 100))
    used = clock.t
    assert await run_lease(held, table, clock, used + 440) == []
    assert control.released() == [(["r1"], 0.0)] and held.ledger.by_id == {}      # expired at reuse_ttl
    assert sample(metrics, "pdserve_router_held_kv_releases_total", reason="expired") == 1


async def test_a_conversation_that_came_back_is_renewed_but_never_held_past_held_kv_lease_after_its_last_turn():
    held, table, control, clock, metrics = await rig(decoder_kv_blocks_ttl=480.0, held_kv_lease=1000.0)
    put(table, control, clock, "conv", "r2", 100)
    held.stored(FakeTurn("t2", reuse=(HIT, "continuation"), conversation=CHAT), "d0", params("r2", 100))
    used = clock.t
    assert table._entries[("t", "conv")].continued and held.ledger.by_id["r2"].continued
    renewed = await run_lease(held, table, clock, used + 1000)
    assert len(renewed) == 1 and renewed[0] > used + 432 - held.lease.lead     # once: a second would pass 1000 s
    assert control.released() == [(["r2"], 0.0)] and held.ledger.by_id == {} and len(table) == 0
    assert sample(metrics, "pdserve_router_held_kv_renewals_total") == 1


def test_whether_a_conversation_came_back_is_kept_across_a_drained_restart(tmp_path):
    clock, wall = Clock(), Clock()
    table = MemoryTable(100.0, clock)
    table.put(("t", "back"), params("rb", 48), "d0", 0, None, continued=True)
    table.put(("t", "once"), params("ro", 48), "d0", 0, None)
    path = tmp_path / "reuse-store.json"
    assert store_file.save(table, path, "c", clock=clock, wall=wall) == 2
    saved, _ = store_file.load(path, "c", 1 << 20, ["d0"], wall=wall)
    again = MemoryTable(100.0, clock)
    assert store_file.restore(again, saved, lambda d: 0, clock=clock, wall=wall) == 2
    assert {k[1]: e.continued for k, e in again.entries()} == {"back": True, "once": False}


def test_status_shows_the_tenants_sharing_a_decode_servers_budget_and_over_share_releases():
    from rich.console import Console

    from pdserve.cli.status import _held_lines
    from pdserve.observe.routerstats import add_held, parse_metrics
    text = ('pdserve_router_held_kv_tokens{decode="decode-0"} 900.0\n'
            'pdserve_router_held_kv_budget_tokens{decode="decode-0"} 1000.0\n'
            'pdserve_router_held_kv_tenants{decode="decode-0"} 3.0\n'
            'pdserve_router_held_kv_tokens{decode="decode-1"} 10.0\n'
            'pdserve_router_held_kv_tenants{decode="decode-1"} 1.0\n'
            'pdserve_router_held_kv_releases_total{reason="lru"} 7.0\n'
            'pdserve_router_held_kv_releases_total{reason="over_share"} 2.0\n')
    router = parse_metrics(text)
    assert router["held_kv"]["tenants"] == {"decode-0": 3, "decode-1": 1}
    assert add_held(router["held_kv"], router["held_kv"])["tenants"] == {"decode-0": 3, "decode-1": 1}
    console = Console(width=250, record=True)
    for line in _held_lines(router):
        console.print(line)
    assert ("held KV on decode (tokens/budget): decode-0 900/1000 (3 tenants), decode-1 10/-; released: lru 7, "
            "over_share 2; renewed 0") in console.export_text()
