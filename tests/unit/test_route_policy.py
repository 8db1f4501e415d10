"""The route policy as a table: inputs in, plan out, no network (router/route/policy.py)."""

from __future__ import annotations

import pytest

from pdserve.router.config import AFFINITY, BackendConfig, RouterConfig
from pdserve.router.kv.reuse import HIT, MISS, Decision
from pdserve.router.route.backends import Pool
from pdserve.router.route.cost import CostModel
from pdserve.router.route.policy import (DecodeOnly, Degraded, PrefillThenDecode, RoutePolicy, TurnInputs,
                                         new_tokens)
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.router.wire import DECODE_ONLY, DEGRADED, PREFILL_THEN_DECODE

BLOCK = 128


def cfg(**kw) -> RouterConfig:
    return RouterConfig(prefill=[BackendConfig("prefill-0", "http://p0")], decode=[BackendConfig("decode-0", "http://d0")],
                        model="m", **kw)


def hit(held: int, prompt: int, holder: str = "decode-0") -> Decision:
    return Decision(HIT, "continuation", {"remote_num_tokens": held}, held, holder, prompt_tokens=prompt)


def measured(local: float | None = None, recompute: float | None = 1e-3, pull: float | None = 1e-4) -> CostModel:
    costs = CostModel()
    if recompute is not None:
        costs.recompute["prefill-0"] = recompute
    if pull is not None:
        costs.pull[("prefill-0", "decode-0")] = pull
    if local is not None:
        costs.local["decode-0"] = local
    return costs


# D alone iff rate_D x n_D x (1 + load) <= pull x held + rate_P x n_P. By default here: rate_P = rate_D = 1 ms a
# token, a pull 0.1 ms a token, so the hand-over of the 1515 tokens D holds is 151.5 ms.
# held tokens, prompt tokens, D's load, cost model, config -> plan name (and why not D alone)
CASES = [
    # 40 new tokens: D computes 147 (beyond the 11 whole blocks, 1408, of the 1515 it holds) = 147 ms,
    # P then D 151.5 + 40 = 191.5 ms: D alone
    ("short_idle", hit(1515, 1515 + 40), 0, measured(), {}, DECODE_ONLY, ""),
    ("at_cap", hit(1515, 1408 + 256), 0, measured(), {}, DECODE_ONLY, ""),
    ("over_cap", hit(1515, 1408 + 257), 0, measured(), {}, PREFILL_THEN_DECODE, "too_long"),
    ("lower_cap", hit(1515, 1515 + 40), 0, measured(), {"decode_only_max_tokens": 128}, PREFILL_THEN_DECODE,
     "too_long"),
    ("long_turn", hit(1515, 1515 + 1200), 0, measured(), {}, PREFILL_THEN_DECODE, "too_long"),
    ("turned_off", hit(1515, 1515 + 40), 0, measured(), {"decode_only": False}, PREFILL_THEN_DECODE, ""),
    ("higher_cap", hit(1515, 1515 + 900), 0, measured(), {"decode_only_max_tokens": 1024}, DECODE_ONLY, ""),
    # a cheap pull (0.01 ms a token, as over shared memory): 15 + 40 ms through P beats D's 147: P then D ...
    ("cheap_pull", hit(1515, 1515 + 40), 0, measured(pull=1e-5), {}, PREFILL_THEN_DECODE, "prefill_faster"),
    # ... unless D holds whole blocks only, so that it computes no more than P would: 40 <= 15 + 40
    ("cheap_pull_aligned", hit(1536, 1536 + 40), 0, measured(pull=1e-5), {}, DECODE_ONLY, ""),
    # a busy holder: its 3 running decodes wait too: 147 ms x 4 > 191.5 ms -> P then D
    ("busy_costly", hit(1515, 1515 + 40), 3, measured(), {}, PREFILL_THEN_DECODE, "decode_busy"),
    ("busy_one", hit(1515, 1515 + 40), 1, measured(), {}, PREFILL_THEN_DECODE, "decode_busy"),
    # ... measured 10x faster on D itself: 14.7 ms x 4 <= 191.5 ms -> D alone
    ("busy_fast_d", hit(1515, 1515 + 40), 3, measured(local=1e-4), {}, DECODE_ONLY, ""),
    # nothing measured yet: an idle D takes it, a busy one does not
    ("busy_unmeasured", hit(1515, 1515 + 40), 1, CostModel(), {}, PREFILL_THEN_DECODE, "decode_busy"),
    ("idle_unmeasured", hit(1515, 1515 + 40), 0, CostModel(), {}, DECODE_ONLY, ""),
    ("idle_no_pull_yet", hit(1515, 1515 + 40), 0, measured(pull=None), {}, DECODE_ONLY, ""),
    # nothing held, or a miss: P then D, not a D-alone candidate
    ("no_entry", None, 0, measured(), {}, PREFILL_THEN_DECODE, ""),
    ("miss", Decision(MISS, "not_a_continuation", holder="decode-0", prompt_tokens=50), 0, measured(), {},
     PREFILL_THEN_DECODE, ""),
    ("untokenized", Decision(HIT, "continuation", {}, 1515, "decode-0"), 0, measured(), {}, PREFILL_THEN_DECODE,
     "unknown_length"),
]


@pytest.mark.parametrize("name,decision,load,costs,settings,plan,why", CASES, ids=[c[0] for c in CASES])
def test_route_policy_table(name, decision, load, costs, settings, plan, why):
    got = RoutePolicy(cfg(**settings), costs).plan(TurnInputs(decision=decision, block_size=BLOCK, holder_load=load))
    assert got.name == plan
    if isinstance(got, PrefillThenDecode):
        assert got.local_refused == why and got.decision is decision
    else:
        assert isinstance(got, DecodeOnly) and got.holder == "decode-0" and got.held_tokens == decision.tokens


def test_new_tokens_are_counted_beyond_whole_blocks_d_holds():
    assert new_tokens(hit(1515, 1555), 128) == 1555 - 1408     # D's prefix cache hits 11 whole blocks
    assert new_tokens(hit(1515, 1555), None) == 40             # block size unknown: the common prefix
    assert new_tokens(hit(100, 100), 128) == 100               # under one block: D computes all of it


@pytest.mark.parametrize("missing,role", [(("decode",), "prefill"), (("prefill",), "decode"),
                                          (("decode", "prefill"), None)])
def test_degraded_when_a_role_has_no_usable_server(missing, role):
    got = RoutePolicy(cfg(), CostModel()).plan(TurnInputs(missing=missing, decision=hit(1515, 1555)))
    assert isinstance(got, Degraded) and got.name == DEGRADED and got.role == role
    assert got.why == f"no {missing[0]} server usable"


def test_cost_guard_withdraws_the_offer_only_when_cost_aware_and_a_pull_is_slower():
    slow = measured(pull=1e-2)                               # a pull 10x slower than recompute ...
    slow._last_pull[("prefill-0", "decode-0")] = slow.clock()   # ... measured just now (no re-probe due)
    offer = hit(1515, 1555)
    use, outcome = RoutePolicy(cfg(), slow).offer("prefill-0", offer)
    assert use is None and outcome is not None and (outcome.result, outcome.reason) == (MISS, "pull_slower")
    assert RoutePolicy(cfg(cost_aware=False), measured(pull=1e-2)).offer("prefill-0", offer) == (offer, None)
    assert RoutePolicy(cfg(), measured()).offer("prefill-0", offer) == (offer, None)
    assert RoutePolicy(cfg(), slow).offer("prefill-0", None) == (None, None)


def test_prefill_pick_comes_from_the_registry():
    c = cfg(prefill_policy=AFFINITY)
    c = RouterConfig(prefill=[BackendConfig(f"prefill-{i}", f"http://p{i}") for i in range(3)], decode=c.decode,
                     model="m", prefill_policy=AFFINITY)
    pool = Pool("prefill", c.prefill, RouterMetrics(), lambda: __import__(
        "pdserve.router.route.breaker", fromlist=["CircuitBreaker"]).CircuitBreaker(3, 5))
    for b in pool.backends:
        b.healthy = True
    policy = RoutePolicy(c, CostModel())
    anchor = policy.anchor(("t", "conv-1"), "t", None)
    first = {policy.pick_prefill(pool, anchor, set()).name for _ in range(5)}
    assert len(first) == 1                                  # affinity: the same server every time
    home = first.pop()
    assert policy.pick_prefill(pool, anchor, {home}).name != home   # tried already: another one
    assert RoutePolicy(cfg(), CostModel()).anchor(("t", "conv-1"), "t", None) is None   # least_loaded: no pin


def test_d_rate_is_measured_on_d_net_of_its_first_token_and_falls_back_to_p():
    costs = measured(recompute=2e-3)
    assert costs.local_rate("decode-0") == 2e-3
    costs.observe_local("decode-0", 0.05, 100)               # no P-then-D D leg timed yet: no sample
    assert costs.local_rate("decode-0") == 2e-3
    costs.observe_first_token("decode-0", 0.03)              # what a D leg costs when D computes nothing
    costs.observe_local("decode-0", 0.05, 100)
    assert costs.local_rate("decode-0") == pytest.approx(2e-4)
    costs.observe_local("decode-0", 1.0, 5)                  # too few tokens: no sample
    assert costs.local_rate("decode-0") == pytest.approx(2e-4)
    assert costs.handover("decode-0", 1000) == pytest.approx(0.1)
    assert costs.prefill_rate() == 2e-3
    assert costs.handover("decode-9", 1000) is None
    faster = measured()
    faster.observe_first_token("decode-0", 0.2)
    faster.observe_local("decode-0", 0.1, 100)               # faster than a D leg: computing cost ~nothing
    assert faster.local_rate("decode-0") == 0.0


def test_short_turns_stay_on_d_when_d_is_faster_by_its_fixed_cost_alone():
    """One H200 (docs/benchmark.md): a D leg reaches its first token in ~100 ms whatever it computes, a D-alone
    turn of ~170 tokens in ~120 ms, P then D costs ~80 ms more. Timed gross (120 ms / 170 tokens), D's rate
    came out 0.7 ms a token, 25x P's, and the rule sent such turns to P; net of the fixed part it does not."""
    costs = measured(recompute=3e-5, pull=2e-6)               # hand-over of 25k held tokens: 50 ms
    for _ in range(3):
        costs.observe_first_token("decode-0", 0.100)
        costs.observe_local("decode-0", 0.120, 170)
    got = RoutePolicy(cfg(), costs).plan(TurnInputs(decision=hit(25_000, 25_000 + 110), block_size=64))
    assert isinstance(got, DecodeOnly), got
    gross = measured(recompute=3e-5, pull=2e-6, local=0.120 / 170)
    got = RoutePolicy(cfg(), gross).plan(TurnInputs(decision=hit(25_000, 25_000 + 110), block_size=64))
    assert isinstance(got, PrefillThenDecode) and got.local_refused == "prefill_faster"


def test_every_prefill_policy_the_schema_offers_has_a_pick():
    from pdserve.router.config import PREFILL_POLICIES
    from pdserve.router.route.policy import PREFILL_PICKS
    assert set(PREFILL_PICKS) == set(PREFILL_POLICIES)


A = {"role": "assistant", "content": "done"}
PER = 16    # TEMPLATE_TOKENS_PER_MESSAGE


@pytest.mark.parametrize("messages,bound", [
    ([{"role": "user", "content": "hi"}, A, {"role": "user", "content": "yes"}], PER + 3 + PER),
    ([A, {"role": "user", "content": "é"}], PER + 2 + PER),                       # bytes, not characters
    ([A, {"role": "tool", "content": "out", "tool_call_id": "1"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "bc"}]}], PER + (3 + PER) + (3 + PER)),
    ([A], PER),                                                                  # nothing new: the generation prompt
    ([{"role": "user", "content": "hi"}], None),                                 # no reply: nothing held to count from
    ([A, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None),
    ([A, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}], PER),  # the last reply is the anchor
    ([A, {"role": "user", "content": "x", "extra": 1}], None),                   # a field the bound does not know
    (None, None),
])
def test_new_tokens_are_bounded_by_the_bytes_of_the_messages_after_the_last_reply(messages, bound):
    from pdserve.router.route.policy import new_tokens_bound
    assert new_tokens_bound(messages) == bound


def test_the_bound_counts_every_message_after_what_d_holds_and_the_template_inputs_have_a_digest():
    import json

    from pdserve.router.route.policy import new_tokens_bound, template_digest
    held = [{"role": "user", "content": "hi"}, A]
    fabricated = held + [{"role": "user", "content": "x" * 1000}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "yes"}]
    assert new_tokens_bound(fabricated) == PER + 3 + PER                      # after the last reply: blind
    assert new_tokens_bound(fabricated, 2) == PER + (1000 + PER) + (2 + PER) + (3 + PER)   # after what D holds
    assert new_tokens_bound(held, 3) is None and new_tokens_bound(held, 0) is None
    tools = [{"type": "function", "function": {"name": "run"}}]
    assert template_digest({"messages": held}) == ""
    # Each turn's body is parsed anew: equal JSON, equal digest.
    assert template_digest(json.loads(json.dumps({"tools": tools}))) == template_digest(
        json.loads(json.dumps({"messages": [], "tools": tools})))
    assert len({template_digest(b) for b in ({"tools": tools}, {"tools": tools, "documents": []},
                                             {"chat_template_kwargs": {"a": 1}}, {"tools": tools[:0]})}) == 4
