"""Measure what bidirectional KV reuse buys on a deployment, against what users run instead: for each arm
(on, off, prefix-cache, affinity, vllm-router) bring the cluster up with that arm's settings, run the same
deterministic multi-turn workload through the router, bring it down, and write results.json, results.csv
and PNG plots to --out, with a summary per prompt-length bucket (TTFT p50/p90 per arm, each arm over on,
share of reusable tokens pulled from D). `--restart-prefill-after-turn N` restarts the prefill servers
mid-run. With no FILE it runs configs/bench-cpu.yaml (the CPU default with the larger `pdserve:mid`
model). `--attach NAME` measures a running cluster instead (one arm, as it is)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import typer
import yaml
from rich.progress import Progress
from rich.table import Table

from pdserve.orchestrate import cluster
from pdserve.bench import report, vrouter
from pdserve.bench.arms import ARMS, arm_config, deployed
from pdserve.bench.run import Endpoints, chat, run_arm, verbatim_token_ids
from pdserve.bench.workload import WORDS, generate, load
from pdserve.errors import PdserveError, UsageError
from pdserve.spec.load import SHIPPED_CONFIGS, load_spec
from pdserve.state.folder import ClusterDir
from pdserve.ui import console

NAME = "bench"
BENCH_CONFIG = SHIPPED_CONFIGS / "bench-cpu.yaml"


def command(
    config: Path = typer.Argument(None, help="cluster.yaml (default: configs/bench-cpu.yaml)"),
    arms: str = typer.Option("on,off,prefix-cache", "--arms", help="Comma-separated arms to run."),
    conversations: int = typer.Option(2, "--conversations", min=1),
    turns: int = typer.Option(8, "--turns", min=1, help="User turns per conversation (generated workload)."),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Conversations at once (1 gives exact "
                                                                    "per-request P metrics)."),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1, help="Reply length per turn."),
    seed: int = typer.Option(0, "--seed"),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Conversations run (not recorded) before measuring "
                                                         "each arm: a fresh server's first requests include "
                                                         "one-time costs (kernel compilation, NIXL handshakes)."),
    workload: Path = typer.Option(None, "--workload", help="vLLM multi_turn input: a list of {id, messages} "
                                                            "or a generate_conversations config (JSON)."),
    out: Path = typer.Option(None, "--out", help="Output folder (default: bench-<name>-<time>)."),
    attach: str = typer.Option(None, "--attach", help="Measure this running cluster as it is (no up/down)."),
    verbatim: bool = typer.Option(False, "--verbatim-replies", help="Sample replies only from whole-word tokens "
                                                                  "(allowed_token_ids), so that they re-tokenize "
                                                                  "to themselves, as a real model's do."),
    restart_after: int = typer.Option(0, "--restart-prefill-after-turn", min=0,
                                      help="Restart every prefill server once all conversations have run this "
                                           "many turns (their caches are lost; D still holds the turns). 0: never."),
) -> None:
    convs = load(workload, seed) if workload else generate(seed, conversations, turns)
    if restart_after and restart_after >= max(len(c.user_turns) for c in convs):
        raise UsageError(f"--restart-prefill-after-turn: {restart_after} leaves no turn after the restart",
                         hint="use a number below the turns per conversation")
    warm = generate(seed + 1000, warmup, max(len(c.user_turns) for c in convs)) if warmup else []
    if attach:
        plan_dict = ClusterDir(attach).read_plan()
        if not plan_dict or not cluster.has_live_processes(ClusterDir(attach)):
            raise PdserveError(f"cluster {attach} is not running", hint="`pdserve status` lists clusters", exit_code=3)
        runs = [("attached", None, attach)]
        base_name = attach
    else:
        path = config or BENCH_CONFIG
        spec = load_spec(path)                  # exit 2 on a bad file, before anything starts
        data = yaml.safe_load(Path(path).read_text())
        chosen = [a.strip() for a in arms.split(",") if a.strip()]
        unknown = [a for a in chosen if a not in ARMS]
        if unknown or not chosen:
            raise UsageError(f"--arms: unknown arm {unknown[0] if unknown else '(none)'}",
                              hint=f"choose from {', '.join(ARMS)}")
        runs = [(arm, arm_config(data, arm), None) for arm in chosen]
        base_name = spec.name
    out = out or Path(f"bench-{base_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    requests = sum(len(c.user_turns) for c in convs)
    rows, totals = [], {}
    info = {"verbatim_replies": verbatim, "restart_prefill_after_turn": restart_after}
    with Progress(console=console.err, transient=False) as progress:
        task = progress.add_task("bench", total=requests * len(runs))
        for arm, cfg, name in runs:
            progress.update(task, description=f"arm {arm}")
            rows_arm, totals[arm] = _run_one(arm, cfg, name, out, convs, warm, max_tokens, concurrency,
                                             lambda row: progress.advance(task), info)
            rows += rows_arm
    summary = report.summarize(rows)
    after_restart = report.after_pause(rows) if restart_after else None
    meta = {"config": str(config or BENCH_CONFIG) if not attach else attach, "arms": [r[0] for r in runs],
            "conversations": len(convs), "requests_per_arm": requests, "concurrency": concurrency,
            "max_tokens": max_tokens, "seed": seed, "warmup_conversations": warmup,
            "pulled_share_on": report.pulled_share(rows), "outside_legs_p50_ms": report.outside_legs_ms(rows),
            "host": report.host_facts(),
            **info, **({"after_prefill_restart": after_restart} if after_restart else {})}
    files = report.write_files(out, meta, rows, summary, totals)
    _print_summary(summary, meta, totals)
    if after_restart:
        _print_after_restart(after_restart, restart_after)
    console.info("wrote " + ", ".join(str(f) for f in files))


def _run_one(arm, cfg, name, out, convs, warm, max_tokens, concurrency, on_request, info):
    if cfg is None:
        return _measure(arm, _endpoints(name), convs, warm, max_tokens, concurrency, on_request, info, name)
    arm_file = out / f"{arm}.yaml"
    arm_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with deployed(arm, arm_file):
        ep = _endpoints(cfg["name"])
        if arm != "vllm-router":
            return _measure(arm, ep, convs, warm, max_tokens, concurrency, on_request, info, cfg["name"])
        if ep.api_key:
            raise UsageError("arm vllm-router: the cluster has an API key (router.api_key_env); "
                             "run that arm without one")
        # The same servers, reached through vllm-router instead of pdserve's router (which stays idle).
        with vrouter.running(ep.prefill, ep.decode, out / "vllm-router.log") as vr:
            info["vllm_router"] = {"version": vr.version, "argv": vr.argv}
            return _measure(arm, dataclasses.replace(ep, router=vr.url, stream=True), convs, warm, max_tokens,
                            concurrency, on_request, info, cfg["name"])


def _measure(arm, ep, convs, warm, max_tokens, concurrency, on_request, info, cluster_name):
    extra = None
    if info["verbatim_replies"]:
        ids = verbatim_token_ids(ep, WORDS)       # same model in every arm: the same ids
        info["verbatim_token_ids"] = ids
        extra = {"allowed_token_ids": ids}
    if warm:
        run_arm(f"{arm}-warmup", ep, warm, max_tokens, 1, extra=extra)
    turn = info["restart_prefill_after_turn"]

    def restart() -> None:
        info.setdefault("prefill_restart_s", {})[arm] = _restart_prefill(cluster_name, ep)
    pause = (turn, restart) if turn else None
    return run_arm(arm, ep, convs, max_tokens, concurrency, on_request, extra=extra, pause=pause)


def _restart_prefill(name: str, ep: Endpoints) -> float:
    """Every prefill server restarted through the supervisor, as `pdserve restart` does, then one request
    outside the workload: a fresh server's first request carries one-time costs, as after `--warmup`.
    Returns the seconds until they were ready again."""
    cdir = ClusterDir(name)
    state = cdir.read_state()
    prefill = [n for n, p in (state.processes if state else {}).items() if p.role == "prefill"]
    before = cluster.request_restart(cdir, prefill)
    started = time.monotonic()
    cluster.wait_restarted(cdir, before, 900.0,
                           lambda n: console.info(f"{n} restarted in {time.monotonic() - started:.1f}s"))
    took = time.monotonic() - started
    chat(ep, [{"role": "user", "content": f"warm-up after restart {time.time_ns()}"}], 2)
    return round(took, 1)


def _endpoints(name: str) -> Endpoints:
    from pdserve.plan.records import ClusterPlan
    plan = ClusterPlan.from_dict(ClusterDir(name).read_plan())
    key_env = plan.router_config.get("api_key_env")
    return Endpoints(plan.router.url, [p.url for p in plan.processes if p.role == "prefill"],
                     plan.router_config.get("model", ""), os.environ.get(key_env) if key_env else None,
                     [p.url for p in plan.processes if p.role == "decode"])


def _print_after_restart(after: dict, turn: int) -> None:
    table = Table(title=f"Turn {turn + 1}, right after the prefill restart", title_justify="left")
    for column in ("arm", "TTFT p50 (ms)", "P computed", "P's prefix cache", "pulled from D"):
        table.add_column(column)
    for arm, a in after.items():
        table.add_row(arm, f"{a['ttft_p50_ms']:.0f}", *(f"{a[k]:,.0f}" if a.get(k) is not None else "-"
                                                        for k in ("tokens_computed", "tokens_prefix_cache",
                                                                  "tokens_pulled")))
    console.out.print(table)


def _print_summary(summary: list[dict], meta: dict, totals: dict) -> None:
    arms = meta["arms"]
    others = [a for a in arms if a != "on"] if "on" in arms else []
    table = Table(title="TTFT by prompt length (ms)", title_justify="left")
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
