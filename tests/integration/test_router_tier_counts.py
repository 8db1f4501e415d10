"""Where each turn's KV came from, with a CPU KV tier on P (issue 43 item 3), through the real router and the fake
vLLM (tests/kits/fake_tier.py: P's NIXL reads D's offer first, its CPU tier loads when NIXL reads nothing):
the client's X-PDServe-Tier-Tokens header, the access line, the router's counter and `status` tell P's CPU tier
apart from P's prefix cache and from D; a turn whose offer of D's KV went unread because the tier loaded it is a
`cpu_tier` miss, neither a hit from D nor an unexplained miss."""

from __future__ import annotations

import logging

from pdserve.cli.status import _reuse_lines
from pdserve.observe.promtext import parse, total
from pdserve.observe.routerstats import parse_metrics
from pdserve.router.kv.reuse import CPU_TIER, MISS, Decision, engine_outcome
from pdserve.router.wire import PULLED_HEADER, TIER_HEADER
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"
DECISIONS = "pdserve_router_reuse_decisions_total"
TIER_TOTAL = "pdserve_router_reuse_tokens_tier_total"


async def two_turns(dep) -> list[dict[str, str]]:
    """A conversation's two turns; the response headers of each."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "alpha " * 40}], "max_tokens": 4,
            "conversation_id": "c-tier"}
    seen = []
    for words in ("beta " * 20, None):
        async with dep.session.post(dep.url + CHAT, json=body) as resp:
            assert resp.status == 200
            seen.append(dict(resp.headers))
            reply = (await resp.json())["choices"][0]["message"]
        if words:
            body = {**body, "messages": [*body["messages"], reply, {"role": "user", "content": words}]}
    return seen


async def test_a_turn_p_loaded_from_its_cpu_tier_is_counted_there_not_as_pulled_from_d(caplog):
    """D's offer is below P's NIXL threshold, so P's CPU tier loads the prompt: the tier's tokens on the header,
    the access line, the counter and status; 0 pulled; the turn a cpu_tier miss (before: no tier count at all,
    and the turn counted a hit from D though nothing was read)."""
    caplog.set_level(logging.INFO, logger="pdserve.router.access")
    p_args = ["--cpu-tier-tokens", "100000", "--recompute-threshold", "100000"]
    async with deployment(prefill_args=(p_args,)) as dep:
        first, follow_up = await two_turns(dep)
        tier = int(follow_up[TIER_HEADER])
        assert tier > 40 and follow_up[PULLED_HEADER] == "0"
        assert int(first[TIER_HEADER]) > 0               # the fake's tier holds every prompt (fake_tier.py)
        m = parse(await dep.metrics())
        assert total(m, DECISIONS, result="miss", reason=CPU_TIER) == 1
        assert total(m, DECISIONS, result="hit") == 0
        assert total(m, TIER_TOTAL) == tier + int(first[TIER_HEADER])
        stats = parse_metrics(await dep.metrics())
        assert stats["prefill_tokens_tier"] == total(m, TIER_TOTAL) and stats["reuse_tokens_pulled"] == 0
        assert stats["misses_by_reason"] == {CPU_TIER: 1}
        shown = _reuse_lines("http://router", stats)[0].plain
        assert f"from P's CPU tier {tier + int(first[TIER_HEADER])}" in shown and "pulled from D 0" in shown
        assert dep.decode[0][FAKE].leaked_counts == 0    # the counts never reach D
    line = [r.getMessage() for r in caplog.records if r.name == "pdserve.router.access"][-1]
    assert f"p_tier={tier} " in line and "pulled=0 " in line and "p_cached=0 " in line
    assert f"reuse=miss/{CPU_TIER}" in line


async def test_an_offer_the_router_checked_itself_and_the_tier_loaded_instead_is_no_hit_from_d():
    """Two prefill servers, one not yet seen with pdserve's counts: the router checks the offer against P's
    /tokenize itself (a `trimmed` hit when P reads it). P's NIXL leaves it unread and its CPU tier loads the
    prompt: a cpu_tier miss (before: a trimmed hit, 0 pulled)."""
    p_args = ["--cpu-tier-tokens", "100000", "--recompute-threshold", "100000"]
    async with deployment(prefill_args=(p_args, p_args)) as dep:
        prompt = "alpha " * 40
        for _ in range(2):
            body = {"model": "fake", "prompt": prompt, "max_tokens": 4, "conversation_id": "c-tier-completions"}
            async with dep.session.post(dep.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                prompt += (await resp.json())["choices"][0]["text"] + " beta" * 10
                headers = dict(resp.headers)
        assert headers[PULLED_HEADER] == "0" and int(headers[TIER_HEADER]) > 40
        m = parse(await dep.metrics())
        assert total(m, DECISIONS, result="miss", reason=CPU_TIER, api="completions") == 1
        assert total(m, DECISIONS, result="hit") == 0


async def test_a_read_of_ds_kv_is_a_hit_with_no_tier_tokens():
    """A P with a tier that NIXL reads D's offer on: pulled, 0 from the tier, a hit."""
    async with deployment(prefill_args=(["--cpu-tier-tokens", "100000"],)) as dep:
        _, follow_up = await two_turns(dep)
        assert int(follow_up[PULLED_HEADER]) > 40 and follow_up[TIER_HEADER] == "0"
        m = parse(await dep.metrics())
        assert total(m, DECISIONS, result="hit") == 1 and total(m, DECISIONS, result="miss") == 0


def test_an_engine_checked_offer_the_tier_loaded_instead_is_a_cpu_tier_miss():
    offer = Decision("hit", "engine_checked", holder="decode-0", tokens=60)
    assert engine_outcome(offer, 0, 60, block_size=16, local=0, tier=48) == Decision(MISS, CPU_TIER,
                                                                                      holder="decode-0")
    # an edited history is still that, whatever the tier held; without the tier, as before
    assert engine_outcome(offer, 0, 8, block_size=16, local=0, tier=48).reason == "not_a_continuation"
    assert engine_outcome(offer, 0, 60, block_size=16, local=0, tier=0).reason == "below_threshold"
