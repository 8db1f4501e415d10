"""`pdserve bench --workload agentic`'s generator holds the published shape of Claude Code traces (gaps, turn
sizes, reuse per turn, sub-agent groups), deterministically; its report adds up achieved against theoretical
reuse per source; its runner forks sub-agents from the parent's history with Claude Code's headers."""

from __future__ import annotations

import random
from pathlib import Path
import statistics

import pytest

from pdserve.bench import agentic
from pdserve.bench.agentic_report import agentic_report, context_bucket
from pdserve.bench.run import Endpoints


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[int(q * len(values))]


def test_gaps_have_the_published_quantiles_and_some_pass_ds_timer():
    rng = random.Random(1)
    gaps = [agentic.gap_seconds(rng.random()) for _ in range(20_000)]
    assert quantile(gaps, 0.5) == pytest.approx(2.0, rel=0.1)
    assert quantile(gaps, 0.9) == pytest.approx(24.0, rel=0.15)
    assert quantile(gaps, 0.99) == pytest.approx(684.0, rel=0.25)
    past = sum(g > agentic.DECODER_TTL_S for g in gaps) / len(gaps)
    assert 0.005 < past < 0.03          # p99 (11.4 min) is past 480 s: about 1.5% of gaps


def test_turns_add_the_published_median_and_nearly_all_reuse_90_percent_of_their_input():
    wl = agentic.generate(seed=3, sessions=20, turns=40, scale=1.0, time_scale=1.0, agent_turns=0)
    sizes, reusing = [], []
    for s in wl.sessions:
        context = len(wl.preamble.split())
        for t in s.turns:
            added = len(t.text.split()) - 3          # "Task step N:" words
            sizes.append(added)
            reusing.append(context / (context + added) >= 0.9)
            context += added
    assert statistics.median(sizes) == pytest.approx(agentic.TURN_TOKENS_P50, rel=0.1)
    assert sum(reusing) / len(reusing) >= 0.94      # published: 96% of turns


def test_subagent_groups_have_the_published_size_and_share_and_claude_codes_headers():
    wl = agentic.generate(seed=5, sessions=40, turns=20, scale=0.01, max_agents=16, agent_turns=3)
    groups = [g for s in wl.sessions for g in s.forks.values()]
    assert statistics.median(len(g) for g in groups) == pytest.approx(agentic.AGENTS_P50, abs=1)
    chains = wl.chains()
    sub = sum(len(c.turns) for c in chains if c.agent)
    assert 0.4 < sub / wl.requests < 0.6            # published: half the requests
    for s in wl.sessions:
        assert s.headers == {"X-Claude-Code-Session-Id": s.root}
        assert all(k < len(s.turns) - 1 for k in s.forks)             # a fork has a parent turn after it
        for group in s.forks.values():
            for a in group:
                assert a.headers == {"X-Claude-Code-Session-Id": s.root, "X-Claude-Code-Agent-Id": a.agent}
                assert a.turns[0].gap_s == 0
    assert len({c.id for c in chains}) == len(chains)
    small = agentic.generate(seed=5, sessions=2, turns=4, max_agents=2, agent_turns=2)
    assert all(len(g) <= 2 for s in small.sessions for g in s.forks.values())


def test_the_same_seed_gives_the_same_workload_and_gaps_scale_and_cap():
    a, b = (agentic.generate(seed=9, sessions=3, turns=6, time_scale=0.5) for _ in range(2))
    assert [(t.text, t.gap_s) for c in a.chains() for t in c.turns] == \
           [(t.text, t.gap_s) for c in b.chains() for t in c.turns]
    assert agentic.generate(seed=10, sessions=3, turns=6).preamble != a.preamble
    capped = agentic.generate(seed=9, sessions=3, turns=6, time_scale=0.5, max_gap=1.0)
    assert max(t.gap_s for c in capped.chains() for t in c.turns) <= 1.0
    assert [t.past_ttl for c in capped.chains() for t in c.turns] == [t.past_ttl for c in a.chains() for t in c.turns]


def test_the_runner_forks_subagents_from_the_parents_history_and_reports_reuse(monkeypatch):
    wl = agentic.generate(seed=2, sessions=1, turns=3, scale=0.002, max_agents=2, agent_turns=2)
    wl.sessions[0].forks = {0: wl.sessions[0].forks.get(0) or next(iter(wl.sessions[0].forks.values()))}
    sent: list[tuple[list, dict]] = []

    def fake_chat(ep, messages, max_tokens, timeout, headers):
        sent.append((messages, headers))
        prompt = 100 * len(messages)
        return {"reply": f"r{len(sent)}", "prompt_tokens": prompt, "completion_tokens": 5, "latency_s": 0.1,
                "ttft_s": 0.05, "pulled": 50 if len(messages) > 2 else 0, "plan": "prefill_then_decode"}
    monkeypatch.setattr(agentic, "chat", fake_chat)
    monkeypatch.setattr(agentic, "summed_metrics", lambda urls: {})
    monkeypatch.setattr(agentic, "preamble_tokens", lambda ep, preamble: 40)
    rows, totals = agentic.run_arm("on", Endpoints("http://r", ["http://p"], "m"), wl, 4, sleep=lambda s: None)
    assert len(rows) == wl.requests == 3 + 2 * 2
    first = sent[0][0]
    for messages, headers in sent:
        if "X-Claude-Code-Agent-Id" in headers:
            assert messages[:len(first) + 1] == [*first, {"role": "assistant", "content": "r1"}]   # the fork
    sub_first = [r for r in rows if r["agent"] and r["turn"] == 1]
    assert all(r["theoretical_tokens"] == 200 + 5 - 1 for r in sub_first)      # the parent's sequence
    assert next(r for r in rows if not r["agent"] and r["turn"] == 1)["theoretical_tokens"] == 40   # preamble
    report = agentic_report(rows, {"on": {**totals, "tokens_prefix_cache": 10.0}})["on"]
    assert report["failed"] == 0 and report["subagent_requests"] == 4
    assert report["achieved_reuse_tokens"] == 10 + 50 * sum(r["kv_source"] == "d_pull" for r in rows)
    assert report["theoretical_reuse_tokens"] == sum(r["theoretical_tokens"] for r in rows)
    assert report["turns_by_kv_source"]["d_pull"] == 6 and report["turns_by_kv_source"]["p"] == 1
    assert list(report["ttft_by_context"]) == ["0-1k"]


def test_context_buckets_double():
    assert [context_bucket(n)[1] for n in (0, 1023, 1024, 5000, 70_000)] == ["0-1k", "0-1k", "1-2k", "4-8k",
                                                                              "64-128k"]


def test_a_workload_file_of_the_settings_results_json_records_gives_the_same_workload():
    wl = agentic.generate(seed=7, sessions=2, turns=5, scale=0.01, time_scale=0.1, max_agents=3, agent_turns=2,
                          max_gap=5.0)
    again = agentic.from_config({"filetype": agentic.FILETYPE, **wl.settings}, seed=99)
    assert again.settings == wl.settings
    assert [(c.id, t.text, t.gap_s) for c in again.chains() for t in c.turns] == \
           [(c.id, t.text, t.gap_s) for c in wl.chains() for t in c.turns]
    assert agentic.from_config({"filetype": "agentic", "turns": 2}, seed=3).settings["seed"] == 3
    with pytest.raises(ValueError, match="unknown agentic setting 'sesions'"):
        agentic.from_config({"filetype": "agentic", "sesions": 2})


def test_turn_scale_grows_the_turns_alone_and_is_recorded_and_read_back():
    one = agentic.generate(seed=4, sessions=3, turns=12, scale=1.0, agent_turns=2)
    ten = agentic.generate(seed=4, sessions=3, turns=12, scale=1.0, agent_turns=2, turn_scale=10.0)
    assert ten.preamble == one.preamble              # the shared preamble keeps its published size
    words = lambda wl: [len(t.text.split()) - 3 for c in wl.chains() for t in c.turns]    # noqa: E731
    assert statistics.median(words(ten)) == pytest.approx(10 * agentic.TURN_TOKENS_P50, rel=0.2)
    assert statistics.median(words(one)) == pytest.approx(agentic.TURN_TOKENS_P50, rel=0.2)
    assert ten.settings["turn_scale"] == 10.0 and one.settings["turn_scale"] == 1.0
    # the default is the old shape: the same workload as leaving it out
    same = agentic.generate(seed=4, sessions=3, turns=12, scale=1.0, agent_turns=2, turn_scale=1.0)
    assert [t.text for c in same.chains() for t in c.turns] == [t.text for c in one.chains() for t in c.turns]
    again = agentic.from_config({"filetype": agentic.FILETYPE, **ten.settings})
    assert [t.text for c in again.chains() for t in c.turns] == [t.text for c in ten.chains() for t in c.turns]
    old = {k: v for k, v in one.settings.items() if k != "turn_scale"}    # a file written before turn_scale
    assert agentic.from_config({"filetype": agentic.FILETYPE, **old}).settings == one.settings


def test_fewer_sessions_are_the_first_sessions_of_more():
    """An arm run with fewer sessions (the expensive `off`) runs the same sessions as the first of a bigger
    run: the same texts, gaps and sub-agent forks, so TTFT by context size compares like with like."""
    def shape(wl):
        return [(c.id, c.root, c.agent, [(t.text, t.gap_s, t.past_ttl) for t in c.turns],
                 {k: [a.id for a in g] for k, g in c.forks.items()}) for c in wl.chains()]
    settings = {"seed": 11, "turns": 12, "scale": 0.05, "turn_scale": 10.0, "time_scale": 0.1, "agent_turns": 3}
    few, many = agentic.generate(sessions=2, **settings), agentic.generate(sessions=8, **settings)
    assert few.preamble == many.preamble and any(s.forks for s in few.sessions)
    assert shape(few) == shape(many)[:len(few.chains())]
    assert [s.id for s in many.sessions[:2]] == [s.id for s in few.sessions]


def test_max_context_ends_each_chain_before_its_words_pass_it_and_changes_nothing_else():
    settings = {"seed": 6, "sessions": 6, "turns": 12, "scale": 0.05, "turn_scale": 10.0, "agent_turns": 3}
    free, capped = agentic.generate(**settings), agentic.generate(**settings, max_context=3000)
    preamble = len(free.preamble.split())

    def longest(chain, context):      # the most words any request of the chain sends (replies left out)
        most = context
        for k, t in enumerate(chain.turns):
            context += len(t.text.split())
            most = max(most, context, *(longest(a, context) for a in chain.forks.get(k, [])))
        return most
    assert max(longest(s, preamble) for s in free.sessions) > 3000
    assert max(longest(s, preamble) for s in capped.sessions) <= 3000
    for f, c in zip(free.sessions, capped.sessions, strict=True):
        assert [t.text for t in c.turns] == [t.text for t in f.turns[:len(c.turns)]]    # a prefix, same draws
        assert all(k < len(c.turns) - 1 and g for k, g in c.forks.items())
        for k, group in c.forks.items():
            for a in group:
                assert [t.text for t in a.turns] == [t.text for t in next(x for x in f.forks[k] if x.id == a.id)
                                                     .turns[:len(a.turns)]]
    assert capped.settings["max_context"] == 3000 and free.settings["max_context"] == 0
    assert agentic.from_config({"filetype": "agentic", **capped.settings}).requests == capped.requests
    with pytest.raises(ValueError, match="leaves session 0 no turn"):
        agentic.generate(**settings, max_context=preamble)


def test_concurrency_bounds_the_agentic_sessions_at_once_and_defaults_to_all(monkeypatch, tmp_path):
    """`--concurrency` reached the agentic runner as 0 (every session at once) whatever was asked: a GPU run of
    8 long sessions could not keep fewer in D's memory at a time."""
    from pdserve.bench import session
    seen = []
    monkeypatch.setattr(agentic, "run_arm", lambda arm, ep, wl, max_tokens, concurrency, *a, **k:
                        seen.append(concurrency) or ([], {}))
    ep = Endpoints("http://r", ["http://p"], "m")
    for asked, expected in ((3, 3), (None, 0)):
        s = session.prepare(session.Settings(workload=Path("agentic"), concurrency=asked, warmup=0,
                                             out=tmp_path / str(asked), arms="on"))
        assert s.workload.concurrency == expected
        session._measure("on", ep, s.workload, lambda row: None, "x")
    assert seen == [3, 0]
    assert session.prepare(session.Settings(out=tmp_path / "plain", arms="on")).workload.concurrency == 1


def test_resume_context_opens_each_session_with_an_earlier_transcript_and_fewer_turns_keep_it():
    """`resume_context` (tokens of the published shape, times `scale`) puts an earlier transcript before each
    session's first turn, as `claude --resume` sends one, so sessions pass 100k tokens in tens of turns; a run
    of fewer turns (the expensive `off` arm) starts with the same transcripts and turns."""
    settings = {"seed": 2, "sessions": 6, "scale": 0.25, "agent_turns": 3, "max_agents": 3}
    plain = agentic.generate(turns=10, **settings)
    resumed = agentic.generate(turns=10, resume_context=60_000, **settings)
    fewer = agentic.generate(turns=4, resume_context=60_000, **settings)
    assert plain.preamble == resumed.preamble
    for s, f in zip(resumed.sessions, fewer.sessions, strict=True):
        head, _, first = s.turns[0].text.partition("\n")
        assert head.startswith("Resumed session, earlier transcript: ") and first.startswith("Task step 1: ")
        words = len(head.split()) - 4
        assert 60_000 * 0.25 * 0.85 <= words <= 60_000 * 0.25 * 1.15
        assert f.turns[0].text.partition("\n")[0] == head               # the same transcript, whatever `turns`
        assert all("Resumed" not in t.text for t in s.turns[1:])
        assert all("Resumed" not in t.text for g in s.forks.values() for a in g for t in a.turns)
    # session 0 (the `off` arm's one session) starts with the same turns
    assert [t.text for t in fewer.sessions[0].turns] == [t.text for t in resumed.sessions[0].turns[:4]]
    sizes = [len(s.turns[0].text.split()) for s in resumed.sessions]
    assert len(set(sizes)) == len(sizes)                  # drawn per session
    assert resumed.settings["resume_context"] == 60_000 and plain.settings["resume_context"] == 0
    again = agentic.from_config({"filetype": agentic.FILETYPE, **resumed.settings})
    assert [t.text for c in again.chains() for t in c.turns] == [t.text for c in resumed.chains() for t in c.turns]
    # left out, the workload is the one before the setting existed (no draw taken)
    old = {k: v for k, v in plain.settings.items() if k != "resume_context"}
    assert [t.text for c in agentic.from_config({"filetype": "agentic", **old}).chains() for t in c.turns] == \
        [t.text for c in plain.chains() for t in c.turns]


def test_the_resume_context_flag_reaches_the_workload(tmp_path):
    from pdserve.bench import session
    s = session.prepare(session.Settings(workload=Path("agentic"), resume_context=4000, warmup=0,
                                         out=tmp_path / "r", arms="on"))
    assert s.workload.agentic.settings["resume_context"] == 4000
    assert all(c.turns[0].text.startswith("Resumed session") for c in s.workload.agentic.sessions)
