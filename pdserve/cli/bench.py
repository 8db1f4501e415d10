"""Measure what bidirectional KV reuse buys on a deployment, against what users run instead: for each arm
(on, timer, local, both, off, prefix-cache, affinity, vllm-router) bring the cluster up with that arm's
settings, run the same deterministic multi-turn workload through the router, bring it down, and write results.json,
results.csv and PNG plots to --out, with a summary per prompt-length bucket (TTFT p50/p90 per arm, each arm
over on, share of reusable tokens pulled from D), and per arm TTFT p50/p99, the requests that failed (no
whole answer within `--request-timeout`) or took over 10 s, and the reuse rate. `--restart-prefill-after-turn
N` restarts the prefill servers mid-run. With no FILE it runs configs/bench-cpu.yaml (the CPU default with the
larger `pdserve:mid` model); configs/bench-cpu-many.yaml has more conversations than D has room for
(`--arms timer,on`: D's fixed timer against the router's held-KV budget). `--attach NAME` measures a running
cluster instead (one arm, as it is). `--api` sends the workload as Anthropic Messages or OpenAI Responses
requests instead of chat completions. `--workload agentic` runs sessions shaped like real Claude Code traces
(pdserve/bench/agentic.py: a shared preamble, published turn sizes and gaps, sub-agent groups) and reports
TTFT by context size, achieved against theoretical reuse and where each turn's KV came from (P's cache, its
CPU tier, D); `--turn-scale` grows its turns alone, so that sessions reach long contexts in few turns."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import Progress
from rich.table import Table

from pdserve.bench import agentic
from pdserve.bench import session as bench
from pdserve.ui import console

NAME = "bench"


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: configs/bench-cpu.yaml)"),
    arms: str = typer.Option("on,off,prefix-cache", "--arms", help="Comma-separated arms to run."),
    conversations: int = typer.Option(2, "--conversations", min=1, help="Conversations in the generated workload."),
    turns: int = typer.Option(8, "--turns", min=1, help="User turns per conversation (generated workload)."),
    concurrency: int = typer.Option(None, "--concurrency", min=1, help="Conversations at once (default 1: exact "
                                                                       "per-request P metrics); with --workload "
                                                                       "agentic, sessions at once (default: all)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Reply length per turn."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated workload (and of a --workload "
                                              "generate_conversations config)."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Conversations run (not recorded) before measuring "
                                                         "each arm: a fresh server's first requests include "
                                                         "one-time costs (kernel compilation, NIXL handshakes)."),
    workload: Path = typer.Option(None, "--workload", help="vLLM multi_turn input: a list of {id, messages} "
                                                            "or a generate_conversations config (JSON); or "
                                                            "`agentic`: sessions shaped like Claude Code traces "
                                                            "(--conversations sessions of --turns main turns), or "
                                                            "a file of their settings ({\"filetype\": "
                                                            "\"agentic\", ...}: results.json's "
                                                            "agentic_workload)."),
    scale: float = typer.Option(1 / 32, "--scale", min=1e-4, help="Agentic: the published sizes (preamble 24k, "
                                                                   "turn p50 632 tokens) times this, in words."),
    turn_scale: float = typer.Option(1.0, "--turn-scale", min=1e-4, help="Agentic: the turns' sizes (not the "
                                                                         "preamble's) times this too, so that "
                                                                         "sessions reach long contexts in few "
                                                                         "turns."),
    time_scale: float = typer.Option(0.01, "--time-scale", min=0.0, help="Agentic: the published gaps between "
                                                                         "turns (p50 2 s, p90 24 s, p99 11.4 min) "
                                                                         "times this."),
    max_agents: int = typer.Option(16, "--max-agents", min=1, help="Agentic: sub-agents per group at most "
                                                                   "(published p50 7)."),
    agent_turns: int = typer.Option(3, "--agent-turns", min=0, help="Agentic: turns per sub-agent (0: no "
                                                                    "sub-agents)."),
    max_gap: float = typer.Option(0.0, "--max-gap", min=0.0, help="Agentic: every gap at most this many seconds "
                                                                  "(0: no cap)."),
    max_context: int = typer.Option(0, "--max-context", min=0, help="Agentic: each session or sub-agent ends "
                                                                    "before the turn that would take its words "
                                                                    "(preamble + turns, replies not counted) "
                                                                    "past this, so that no request passes the "
                                                                    "model's context (0: no cap)."),
    resume_context: int = typer.Option(0, "--resume-context", min=0, help="Agentic: each session opens with an "
                                                                          "earlier transcript of about this many "
                                                                          "tokens (times --scale, "
                                                                          f"+-{agentic.RESUME_SPREAD:.0%}), as a "
                                                                          "resumed session sends one (0: none)."),
    out: Path = typer.Option(None, "--out", help="Output folder (default: bench-<name>-<time>)."),
    attach: str = typer.Option(None, "--attach", help="Measure this running cluster as it is (no up/down)."),
    verbatim: bool = typer.Option(False, "--verbatim-replies", help="Sample replies only from whole-word tokens "
                                                                  "(allowed_token_ids), so that they re-tokenize "
                                                                  "to themselves, as a real model's do."),
    user_words: int = typer.Option(60, "--user-words", min=1, help="Words of each short user turn between the "
                                                                    "long tool results (generated workload)."),
    tool_words: int = typer.Option(450, "--tool-words", min=1, help="Words of each long tool result (generated "
                                                                    "workload)."),
    system_words: int = typer.Option(600, "--system-words", min=1, help="Words of the system prompt that opens "
                                                                        "each conversation (generated workload)."),
    stream: bool = typer.Option(False, "--stream", help="Stream every request and time its first answer chunk "
                                                         "(a turn served on D alone has its first token inside "
                                                         "the D leg, which Server-Timing cannot split)."),
    api: str = typer.Option("chat", "--api", help="Send every turn as chat (/v1/chat/completions), messages "
                                                  "(Anthropic /v1/messages) or responses (OpenAI /v1/responses, "
                                                  "store off); the same workload, its system prompt as "
                                                  "`system` / `instructions`."),
    request_timeout: float = typer.Option(60.0, "--request-timeout", min=1.0,
                                          help="Seconds a request may wait for its answer, and a streamed "
                                               "one for each chunk (its headers come after P's leg), before it "
                                               "counts as failed (its conversation goes on without the reply), "
                                               "so a turn stalled on D never hangs the bench."),
    give_up_after: int = typer.Option(0, "--give-up-after", min=0,
                                      help="End a conversation after this many failed turns, as a user who "
                                           "gives up (its later turns are not sent and not counted). 0: never."),
    restart_after: int = typer.Option(0, "--restart-prefill-after-turn", min=0,
                                      help="Restart every prefill server once all conversations have run this "
                                           "many turns (their caches are lost; D still holds the turns). 0: never."),
) -> None:
    prepared = bench.prepare(bench.Settings(
        config=config, arms=arms, conversations=conversations, turns=turns, concurrency=concurrency,
        max_tokens=max_tokens, seed=seed, warmup=warmup, workload=workload, out=out, attach=attach,
        verbatim=verbatim, restart_after=restart_after, stream=stream, api=api,
        user_words=user_words, tool_words=tool_words, system_words=system_words, request_timeout=request_timeout,
        give_up_after=give_up_after, scale=scale, turn_scale=turn_scale, time_scale=time_scale,
        max_agents=max_agents, agent_turns=agent_turns, max_gap=max_gap, max_context=max_context,
        resume_context=resume_context))
    with Progress(console=console.err, transient=False) as progress:
        task = progress.add_task("bench", total=prepared.requests_per_arm * len(prepared.arms))
        outcome = bench.run(prepared, lambda arm: progress.update(task, description=f"arm {arm}"),
                            lambda row: progress.advance(task), note=console.info)
    _print_summary(outcome.summary, outcome.meta, outcome.totals)
    _print_by_turn_size(outcome.meta.get("by_turn_size") or {})
    _print_per_arm(outcome.meta.get("per_arm") or {}, outcome.meta.get("request_timeout_s"))
    if outcome.after_restart:
        _print_after_restart(outcome.after_restart, restart_after)
    if outcome.meta.get("agentic"):
        _print_agentic(outcome.meta["agentic"])
    console.info("wrote " + ", ".join(str(f) for f in outcome.files))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _print_per_arm(arms: dict, timeout: float | None) -> None:
    table = Table(title=f"Per arm: TTFT of the answered requests; failed = no whole answer within {timeout:g} s",
                  title_justify="left")
    for column in ("arm", "requests", "TTFT p50 (ms)", "TTFT p99 (ms)", "failed", "over 10 s", "failed or over 10 s",
                   "follow-ups pulled from D", "reuse rate"):
        table.add_column(column)
    for arm, a in arms.items():
        errors = ", ".join(f"{n} {kind}" for kind, n in a["failed_by_error"].items())
        pulled = "-" if a["follow_ups_pulled"] is None else f"{a['follow_ups_pulled']} of {a['follow_ups']}"
        table.add_row(arm, str(a["requests"]), _ms(a["ttft_p50_ms"]), _ms(a["ttft_p99_ms"]),
                      f"{a['failed']} ({errors})" if errors else "0", str(a["over_10s"]), str(a["failed_or_over_10s"]),
                      pulled, "-" if a["reuse_rate"] is None else f"{100 * a['reuse_rate']:.0f}%")
    console.out.print(table)


def _print_agentic(arms: dict) -> None:
    table = Table(title="Agentic sessions: TTFT by context size (ms)", title_justify="left")
    labels = list(dict.fromkeys(label for a in arms.values() for label in a["ttft_by_context"]))
    table.add_column("context tokens")
    for arm in arms:
        table.add_column(f"{arm} p50")
        table.add_column(f"{arm} p90")
    for label in labels:
        cells = [label]
        for a in arms.values():
            b = a["ttft_by_context"].get(label)
            cells += [_ms(b["ttft_p50_ms"]), _ms(b["ttft_p90_ms"])] if b else ["-", "-"]
        table.add_row(*cells)
    console.out.print(table)
    table = Table(title="Agentic sessions per arm: reuse achieved of what any cache could have served, and where "
                        "each turn's KV came from (turns: P prefilled / P loaded from its CPU tier / P pulled "
                        "D's / D alone)", title_justify="left")
    for column in ("arm", "requests (sub-agents)", "failed", "over 10 s", "achieved / theoretical reuse",
                   "turns p / p_tier / d_pull / d_alone", "tokens: P cache / P CPU tier / D pull / D alone / P computed",
                   "gaps past D's TTL"):
        table.add_column(column)
    for arm, a in arms.items():
        share = "-" if a["achieved_share"] is None else f"{100 * a['achieved_share']:.0f}%"
        t, k = a["turns_by_kv_source"], a["reuse_tokens_by_source"]
        table.add_row(arm, f"{a['requests']} ({a['subagent_requests']})", str(a["failed"]), str(a["over_10s"]),
                      f"{a['achieved_reuse_tokens']:,.0f} / {a['theoretical_reuse_tokens']:,.0f} ({share})",
                      " / ".join(str(t[s]) for s in ("p", "p_tier", "d_pull", "d_alone")),
                      " / ".join(f"{k[s]:,.0f}" for s in ("p_prefix_cache", "p_cpu_tier", "d_pull", "d_alone",
                                                          "computed_on_p")),
                      f"{a['gaps_past_ttl']} of {a['gaps']}")
    console.out.print(table)


def _print_after_restart(after: dict, turn: int) -> None:
    table = Table(title=f"Turn {turn + 1}, right after the prefill restart", title_justify="left")
    for column in ("arm", "TTFT p50 (ms)", "P computed", "P's prefix cache", "pulled from D"):
        table.add_column(column)
    for arm, a in after.items():
        table.add_row(arm, f"{a['ttft_p50_ms']:.0f}", *(f"{a[k]:,.0f}" if a.get(k) is not None else "-"
                                                        for k in ("tokens_computed", "tokens_prefix_cache",
                                                                  "tokens_pulled")))
    console.out.print(table)


def _print_by_turn_size(sizes: dict) -> None:
    if not sizes:
        return
    table = Table(title="Turns after the first, by new tokens (prompt beyond D's previous sequence)",
                  title_justify="left")
    for column in ("arm", "turns", "new tokens p50", "TTFT p50 (ms)", "on/arm", "P computed", "pulled from D",
                   "served on D alone"):
        table.add_column(column)
    for size, arms in sizes.items():
        for arm, a in arms.items():
            table.add_row(f"{arm} ({size})", str(a["turns"]), f"{a['new_tokens_p50']:.0f}", f"{a['ttft_p50_ms']:.0f}",
                          f"{a['speedup_vs_on']:.2f}x" if a.get("speedup_vs_on") else "-",
                          *(f"{a[k]:,.0f}" if a.get(k) is not None else "-" for k in ("tokens_computed",
                                                                                       "tokens_pulled")),
                          str(a["decode_only"]))
    console.out.print(table)


def _print_summary(summary: list[dict], meta: dict, totals: dict) -> None:
    arms = meta["arms"]
    others = [a for a in arms if a != "on"] if "on" in arms else []
    api = f"{meta.get('api', 'chat')} API, {'streamed' if meta.get('streamed') else 'not streamed'}"
    table = Table(title=f"TTFT by prompt length (ms), {api}", title_justify="left")
    table.add_column("prompt tokens")
    for arm in arms:
        table.add_column(f"{arm} p50")
        table.add_column(f"{arm} p90")
    for ratio in others:
        table.add_column(f"{ratio}/on")
    if "on" in arms:
        table.add_column("pulled/reusable (on)")
    for row in summary:
        cells = [row["prompt_tokens"]]
        for arm in arms:
            cells += [f"{row.get(f'{arm}_ttft_p50_ms', float('nan')):.0f}",
                      f"{row.get(f'{arm}_ttft_p90_ms', float('nan')):.0f}"]
        for ratio in others:
            cells.append(f"{row[f'{ratio}_over_on']:.2f}x" if f"{ratio}_over_on" in row else "-")
        if "on" in arms:
            cells.append(f"{100 * row['on_pulled_share']:.0f}%" if "on_pulled_share" in row else "-")
        table.add_row(*cells)
    console.out.print(table)
    for arm in arms:
        t = totals.get(arm) or {}
        console.out.print(f"arm {arm}: P computed {t.get('tokens_computed', 0):,.0f} prompt tokens, its prefix cache "
                          f"served {t.get('tokens_prefix_cache', 0):,.0f}, pulled from D {t.get('tokens_pulled', 0):,.0f}",
                          highlight=False)
    if meta.get("pulled_share_on") is not None:
        console.out.print(f"arm on: {100 * meta['pulled_share_on']:.1f}% of the reusable tokens (previous prompt "
                          "+ reply, block-aligned) were pulled from D on turns after the first", highlight=False)
    if meta.get("outside_legs_p50_ms") is not None:
        console.out.print(f"client and router time outside the P and D legs: p50 {meta['outside_legs_p50_ms']:.1f} ms "
                          "per request (the benchmark's own overhead is below this)", highlight=False)
