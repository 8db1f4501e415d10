"""Router building blocks without a network: circuit breaker, cost model, conversation identity, stats."""

from __future__ import annotations

from pdserve.router.identity import history_keys, prompt_digest, prompt_key, reply_key
from pdserve.router.route.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pdserve.router.route.cost import CostModel
from pdserve.observe.routerstats import parse_metrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_consecutive_failures_only():
    b = CircuitBreaker(threshold=3, cooldown=5, clock=Clock())
    assert not b.record(False) and not b.record(False)
    b.record(True)                                   # a success resets the count
    assert not b.record(False) and not b.record(False)
    assert b.record(False) and b.state == OPEN and not b.allows()


def test_breaker_half_open_allows_one_trial_and_backs_off_on_failure():
    clock = Clock()
    b = CircuitBreaker(threshold=1, cooldown=5, max_cooldown=12, clock=clock)
    b.record(False)
    clock.t += 4.9
    assert b.state == OPEN
    clock.t += 0.2
    assert b.state == HALF_OPEN and b.allows()
    b.begin()
    assert not b.allows()                            # only one trial in flight
    assert b.record(False) and b.state == OPEN and b.cooldown == 10
    clock.t += 10
    b.begin()
    b.record(False)
    assert b.cooldown == 12                          # capped
    clock.t += 12
    b.begin()
    assert not b.record(True) and b.state == CLOSED and b.cooldown == 5


def test_cost_model_pulls_until_it_knows_better():
    clock = Clock()
    m = CostModel(alpha=0.5, probe_every=3, probe_interval=100, clock=clock)
    assert m.should_pull("p", "d")                   # nothing learned: pull
    m.observe("p", None, seconds=1.0, prompt_tokens=1000, cached_tokens=0, pulled=False)
    assert m.recompute["p"] == 0.001
    m.observe("p", "d", seconds=9.0, prompt_tokens=1000, cached_tokens=900, pulled=True)
    assert ("p", "d") not in m.pull                  # the first pull of a pair includes the handshake
    clock.t += 10
    # 900 pulled + 100 computed in 2.0 s: 0.1 s of compute, 1.9 s of transfer for 900 tokens.
    m.observe("p", "d", seconds=2.0, prompt_tokens=1000, cached_tokens=900, pulled=True)
    assert abs(m.pull[("p", "d")] - 1.9 / 900) < 1e-9
    assert [m.should_pull("p", "d") for _ in range(6)] == [False, False, True, False, False, True]
    assert m.should_pull("p", "other")               # another pair is learned on its own


def test_cost_model_reprobe_replaces_a_stale_estimate_and_time_triggers_it():
    clock = Clock()
    m = CostModel(alpha=0.1, probe_every=100, probe_interval=30, clock=clock)
    m.observe("p", None, 1.0, 1000, 0, False)
    m.observe("p", "d", 3.0, 1000, 900, True)
    clock.t += 10
    m.observe("p", "d", 3.0, 1000, 900, True)
    assert not m.should_pull("p", "d")
    clock.t += 31
    assert m.should_pull("p", "d")                   # the last pull is old: measure again
    m.observe("p", "d", 0.15, 1000, 900, True)       # fast now: 0.05 s for 900 tokens
    assert m.pull[("p", "d")] < m.recompute["p"] and m.should_pull("p", "d")


def test_cost_model_ignores_tiny_samples():
    m = CostModel()
    m.observe("p", None, 0.5, 10, 0, False)
    m.observe("p", "d", 0.5, 100, 10, True)
    m.observe("p", "d", 0.5, 100, 10, True)
    assert m.recompute == {} and m.pull == {}


def test_cost_model_keeps_pulling_when_only_slightly_slower():
    clock = Clock()
    m = CostModel(clock=clock)
    m.observe("p", None, 1.0, 1000, 0, False)       # 1 ms per token
    for _ in range(2):
        clock.t += 10
        m.observe("p", "d", 1.3, 1000, 900, True)   # (1.3 - 0.1) / 900 = 1.33 ms per token: within the margin
    assert ("p", "d") in m.pull and m.should_pull("p", "d")


def test_cost_model_pulls_that_overlapped_the_handshake_are_no_samples():
    clock = Clock()
    m = CostModel(alpha=1.0, clock=clock)
    m.observe("p", None, 1.0, 1000, 0, False)
    clock.t = 100.0
    m.observe("p", "d", 5.0, 1000, 900, True)        # the first pull: started at 95, ended at 100
    clock.t = 100.5
    m.observe("p", "d", 5.0, 1000, 900, True)        # started at 95.5: it waited for the same handshake
    assert ("p", "d") not in m.pull and m.should_pull("p", "d")
    clock.t = 110.0
    m.observe("p", "d", 0.2, 1000, 900, True)        # started after the first one ended: a sample
    assert abs(m.pull[("p", "d")] - 0.1 / 900) < 1e-9


def test_cost_model_prices_a_pull_by_pulled_tokens_only():
    clock = Clock()
    m = CostModel(alpha=1.0, clock=clock)
    m.observe("p", None, 1.0, 1000, 0, False)       # 1 ms per computed token
    m.observe("p", "d", 0.5, 1000, 0, True, pulled_tokens=0)     # the pair's first pull (handshake)
    clock.t += 10
    # 900 tokens not computed, but only 100 came from D (800 from P's own prefix cache): 0.2 s / 100.
    m.observe("p", "d", 0.3, 1000, 900, True, pulled_tokens=100)
    assert abs(m.pull[("p", "d")] - 0.002) < 1e-9
    # P's prefix cache alone (nothing pulled) is no pull sample at all
    m.observe("p", "d", 0.1, 1000, 900, True, pulled_tokens=0)
    assert abs(m.pull[("p", "d")] - 0.002) < 1e-9


def test_cost_model_pulls_that_queued_behind_other_prefills_do_not_stop_pulls():
    # Under load a follow-up's P leg also waits in P's queue; spread over its few pulled tokens, that wait priced
    # the pull above recompute (one H200, 32k workload: 15 follow-ups sent to recompute 20-30k tokens each).
    clock = Clock()
    m = CostModel(clock=clock)
    m.observe("p", None, 1.5, 36000, 0, False)        # ~42 us a computed token
    m.observe("p", "d", 0.5, 36000, 35000, True)      # the pair's first pull (handshake)
    clock.t += 10
    m.observe("p", "d", 0.12, 36000, 35000, True)     # alone: ~2 us a pulled token
    for _ in range(2):
        clock.t += 1
        m.observe("p", "d", 0.9, 8000, 5500, True)    # waited ~0.7 s: ~145 us a pulled token
    assert m.pull[("p", "d")] < 3e-6
    assert m.should_pull("p", "d")


def test_cost_model_forgets_a_fast_pull_after_a_window_of_slow_ones():
    clock = Clock()
    m = CostModel(clock=clock, window=3)
    m.observe("p", None, 1.0, 1000, 0, False)         # 1 ms a computed token
    m.observe("p", "d", 0.5, 1000, 900, True)         # handshake
    clock.t += 10
    m.observe("p", "d", 0.19, 1000, 900, True)        # 0.1 ms a pulled token
    verdicts = []
    for _ in range(3):
        clock.t += 1
        m.observe("p", "d", 4.6, 1000, 900, True)     # 5 ms a pulled token: the transport got slow
        verdicts.append(m.should_pull("p", "d"))
    assert verdicts == [True, True, False]


def test_history_keys_match_the_stored_reply_only():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    reply = {"role": "assistant", "content": "a1", "tool_calls": []}
    stored = reply_key("t", msgs, [reply])
    nxt = msgs + [{"role": "assistant", "content": "a1", "refusal": None, "reasoning_content": "dropped"},
                  {"role": "user", "content": "u2"}]
    assert history_keys("t", nxt) == [stored, prompt_key("t", prompt_digest(msgs))]
    assert stored not in history_keys("other-tenant", nxt)
    edited = msgs + [{"role": "assistant", "content": "a1!"}, {"role": "user", "content": "u2"}]
    # the reply rewritten: the stored reply's key is not a candidate, the prompt's is (its entry's alias)
    assert history_keys("t", edited) == [reply_key("t", msgs, [edited[2]]), prompt_key("t", prompt_digest(msgs))]
    assert stored not in history_keys("t", edited)
    assert history_keys("t", msgs) == []             # no reply, nothing after the prompt: nothing to continue


def test_history_keys_find_a_turn_whose_reply_had_no_items():
    """A Responses answer with no output items (empty text, or reasoning only): the client's next input follows
    its last one at once, and the turn is found by its prompt."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    nxt = msgs + [{"role": "user", "content": "u2"}]
    assert history_keys("t", nxt) == [prompt_key("t", prompt_digest(msgs))]
    after_tool = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "ok"}]
    assert prompt_key("t", prompt_digest(after_tool)) in history_keys("t", after_tool + [{"role": "user",
                                                                                          "content": "u2"}])


def test_history_keys_longest_first_and_tool_calls_count():
    call = {"id": "x1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    h = [{"role": "user", "content": "u1"}, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "content": "42", "tool_call_id": "x1"}, {"role": "assistant", "content": "a2"},
         {"role": "user", "content": "u3"}]
    keys = history_keys("t", h)
    assert keys[0] == reply_key("t", h[:3], [{"role": "assistant", "content": "a2"}])
    assert keys[1] == prompt_key("t", prompt_digest(h[:3]))
    assert keys[2] == reply_key("t", h[:1], [{"role": "assistant", "content": "",
                                              "tool_calls": [{**call, "id": "other-id"}]}])
    assert keys[3:] == [prompt_key("t", prompt_digest(h[:1]))]


def test_history_keys_match_tool_arguments_a_client_reserialised():
    """The reply's arguments as D streamed them; the client sends them back re-serialised (spacing, order)."""
    ours = {"type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [1, 2]}'}}
    theirs = {"id": "c9", "type": "function", "function": {"name": "f", "arguments": '{"a":[1,2],"b":1}'}}
    msgs = [{"role": "user", "content": "u1"}]
    stored = reply_key("t", msgs, [{"role": "assistant", "content": "", "tool_calls": [ours]}])
    nxt = msgs + [{"role": "assistant", "content": None, "tool_calls": [theirs]},
                  {"role": "tool", "content": "ok", "tool_call_id": "c9"}]
    assert history_keys("t", nxt)[0] == stored
    changed = {**theirs, "function": {"name": "f", "arguments": '{"a":[1,2],"b":2}'}}
    assert stored not in history_keys("t", msgs + [{"role": "assistant", "content": None, "tool_calls": [changed]},
                                                   {"role": "tool", "content": "ok"}])


def test_parse_router_metrics():
    text = """
pdserve_router_turns_total{outcome="stored"} 4.0
pdserve_router_turns_total{outcome="client_gone"} 1.0
pdserve_router_reuse_decisions_total{reason="continuation",result="hit"} 3.0
pdserve_router_reuse_decisions_total{reason="no_entry",result="miss"} 1.0
pdserve_router_reuse_decisions_total{reason="pull_slower",result="miss"} 1.0
pdserve_router_reuse_tokens_pulled_total 640.0
pdserve_router_prefill_tokens_local_cached_total 128.0
pdserve_router_backend_healthy{backend="decode-0",role="decode"} 1.0
pdserve_router_backend_breaker_open{backend="decode-0",role="decode"} 1.0
pdserve_router_backend_in_flight{backend="decode-0"} 2.0
"""
    r = parse_metrics(text)
    assert r["turns"] == 5 and r["reuse_hit_rate"] == 0.6 and r["reuse_tokens_pulled"] == 640
    assert r["prefill_tokens_local_cached"] == 128
    assert r["misses_by_reason"] == {"no_entry": 1, "pull_slower": 1}
    assert r["turn_outcomes"] == {"stored": 4, "client_gone": 1}
    assert r["backends"]["decode-0"] == {"healthy": 1, "breaker_open": 1, "in_flight": 2}


def test_parse_router_metrics_by_api():
    r = parse_metrics("""
pdserve_router_turns_total{api="chat",outcome="stored"} 4.0
pdserve_router_turns_total{api="messages",outcome="stored"} 2.0
pdserve_router_turns_total{api="messages",outcome="failed"} 1.0
pdserve_router_turns_total{api="responses",outcome="stored"} 0.0
pdserve_router_reuse_decisions_total{api="messages",reason="continuation",result="hit"} 1.0
pdserve_router_reuse_decisions_total{api="messages",reason="no_entry",result="miss"} 2.0
pdserve_router_reuse_decisions_total{api="messages",reason="decode_only",result="hit"} 1.0
pdserve_router_reuse_decisions_total{api="messages",reason="no_entry",result="first"} 1.0
""")
    assert r["turns"] == 7 and r["turn_outcomes"] == {"stored": 6, "failed": 1}
    # a turn on D alone is a hit; a first turn neither a hit nor a miss
    assert r["by_api"] == {"chat": {"turns": 4, "hits": 0, "decode_only": 0, "misses": 0, "first": 0},
                           "messages": {"turns": 3, "hits": 2, "decode_only": 1, "misses": 2, "first": 1}}
    assert (r["reuse_hits"], r["reuse_misses"], r["reuse_first"], r["reuse_decode_only"]) == (2, 2, 1, 1)
    assert r["reuse_hit_rate"] == 0.5 and r["misses_by_reason"] == {"no_entry": 2}


def test_parse_router_metrics_degraded_mode():
    r = parse_metrics("""
pdserve_router_degraded_requests_total{served_by="prefill"} 4.0
pdserve_router_degraded_requests_total{served_by="decode"} 1.0
pdserve_router_degraded{missing="decode"} 1.0
pdserve_router_degraded{missing="prefill"} 0.0
""")
    assert r["degraded_requests"] == {"prefill": 4, "decode": 1} and r["degraded_missing"] == ["decode"]


def test_parse_router_metrics_turn_plans():
    r = parse_metrics("""
pdserve_router_turn_plans_total{plan="prefill_then_decode"} 5.0
pdserve_router_turn_plans_total{plan="decode_only"} 3.0
""")
    assert r["turn_plans"] == {"prefill_then_decode": 5, "decode_only": 3} and r["decode_only_turns"] == 3
    assert parse_metrics("")["decode_only_turns"] == 0


def test_fd_budget_splits_a_low_limit_between_clients_and_the_upstream_pool():
    import pytest
    from pdserve.router.front.limits import FD_RESERVE, TooFewDescriptors, fd_budget
    assert fd_budget(1_048_576, 4096, 1024) == (4096, 1024)          # fits: as configured
    clients, upstream = fd_budget(1024, 4096, 1024)
    assert clients + upstream == 1024 - FD_RESERVE and clients >= upstream >= 300, (clients, upstream)
    assert fd_budget(1024, 4096, 100) == (1024 - FD_RESERVE - 100, 100)   # a small pool stays as it is
    with pytest.raises(TooFewDescriptors, match="open-file limit 100 is too low"):
        fd_budget(100, 4096, 1024)


def test_the_router_process_freezes_its_startup_heap_and_collects_rarely():
    """The served router leaves startup objects out of the collector and raises its thresholds (the
    defaults cost ~80 us a request and paused the loop up to 57 ms under 64 clients: docs/router.md)."""
    import subprocess
    import sys
    code = ("import gc; from pdserve.router.__main__ import GC_THRESHOLDS, quiet_gc; quiet_gc(); "
            "print(gc.get_threshold() == GC_THRESHOLDS, gc.get_freeze_count() > 10_000, GC_THRESHOLDS[0] >= 10_000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]


def test_admission_outcomes_in_router_stats():
    text = ('pdserve_router_admission_total{outcome="admitted"} 7\n'
            'pdserve_router_admission_total{outcome="rejected_tenant_rate"} 2\n'
            'pdserve_router_admission_total{outcome="queued"} 0\n'
            'pdserve_router_admission_queue_depth 3\n')
    stats = parse_metrics(text)
    assert stats["admission"] == {"admitted": 7, "rejected_tenant_rate": 2}
    assert stats["admission_queue_depth"] == 3


def test_status_shows_admission_outcomes_only_while_admission_is_on():
    from rich.console import Console

    from pdserve.cli.status import _view
    from pdserve.orchestrate.view import ClusterView
    from pdserve.state.records import Phase
    base = parse_metrics('pdserve_router_turns_total{outcome="stored"} 3\n')
    on = parse_metrics('pdserve_router_admission_total{outcome="admitted"} 4\n'
                       'pdserve_router_admission_total{outcome="rejected_tenant_rate"} 1\n'
                       'pdserve_router_admission_queue_depth 2\n')

    def shown(router: dict) -> str:
        console = Console(width=200, record=True)
        console.print(_view(ClusterView(name="c", phase=Phase.RUNNING, running=True, supervisor_alive=True,
                                        error=None, router_url="http://r", processes=[], router=router,
                                        transfers=None, state_dir="", scrape_targets="")))
        return console.export_text()

    assert "admission: admitted 4, rejected_tenant_rate 1; queued now 2" in shown(on)
    assert "admission" not in shown(base)
