"""One `pdserve bench` invocation: its arms (or the attached cluster), the workload they share, running
each arm in turn and the files and summary that come of it. The CLI parses the options into a Settings,
shows progress and renders the summary; everything else is here."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.bench import agentic, report, vrouter
from pdserve.bench.agentic_report import agentic_report
from pdserve.bench.arms import ARMS, arm_config, deployed
from pdserve.bench.run import API_PATHS, REQUEST_TIMEOUT_S, Endpoints, chat, run_arm, verbatim_token_ids
from pdserve.bench.workload import WORDS, Conversation, generate, load
from pdserve.errors import NotRunningError, UsageError
from pdserve.observe.promtext import api_key_of
from pdserve.orchestrate import ops
from pdserve.roles import DECODE, PREFILL
from pdserve.spec.load import SHIPPED_CONFIGS, load_spec

BENCH_CONFIG = SHIPPED_CONFIGS / "bench-cpu.yaml"
AGENTIC = "agentic"     # `--workload agentic`: agentic.py's generated sessions instead of a file


@dataclass(frozen=True)
class Settings:
    """The command's options, as given."""
    config: Path | None = None
    arms: str = "on,off,prefix-cache"
    conversations: int = 2
    turns: int = 8
    concurrency: int | None = None      # None: 1, or every session at once with --workload agentic
    max_tokens: int = 32
    seed: int = 0
    warmup: int = 1
    workload: Path | None = None
    out: Path | None = None
    attach: str | None = None
    verbatim: bool = False
    restart_after: int = 0
    stream: bool = False
    api: str = "chat"
    user_words: int = 60
    tool_words: int = 450
    system_words: int = 600
    request_timeout: float = REQUEST_TIMEOUT_S
    give_up_after: int = 0
    scale: float = 1 / 32             # agentic: sizes of the published shape, times this
    turn_scale: float = 1.0           # agentic: the turns' sizes (not the preamble's), times this too
    time_scale: float = 0.01          # agentic: gaps between turns, times this
    max_agents: int = 16              # agentic: sub-agents per group at most
    agent_turns: int = 3              # agentic: turns per sub-agent
    max_gap: float = 0.0              # agentic: every gap at most this long (0: no cap)
    max_context: int = 0              # agentic: a chain ends before its words pass this (0: no cap)
    resume_context: int = 0           # agentic: an earlier transcript of this many tokens opens each session


@dataclass(frozen=True)
class Arm:
    name: str
    config: dict[str, Any] | None     # the arm's cluster.yaml; None: measure the attached cluster as it is
    cluster: str | None               # the attached cluster's name


@dataclass
class Workload:
    """What every arm runs: the measured conversations, the warm-up ones, and how."""
    convs: list[Conversation]
    warm: list[Conversation]
    max_tokens: int
    concurrency: int
    info: dict[str, Any]              # results.json's settings; arms add what they learn (token ids, timings)
    note: Callable[[str], None] = lambda message: None
    agentic: agentic.AgenticWorkload | None = None    # `--workload agentic`: run instead of convs
    agentic_warm: agentic.AgenticWorkload | None = None


@dataclass
class Session:
    settings: Settings
    arms: list[Arm]
    workload: Workload
    out: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_arm(self) -> int:
        if self.workload.agentic is not None:
            return self.workload.agentic.requests
        return sum(len(c.user_turns) for c in self.workload.convs)


@dataclass
class Outcome:
    summary: list[dict[str, Any]]
    meta: dict[str, Any]
    totals: dict[str, Any]
    after_restart: dict[str, Any] | None
    files: list[Path]


def prepare(s: Settings) -> Session:
    """Check the options and the config (exit 2 on a bad one, before anything starts), make the workload
    and the output folder."""
    if s.api not in API_PATHS:
        raise UsageError(f"--api: unknown API {s.api}", hint=f"choose from {', '.join(API_PATHS)}")
    if s.api != "chat" and s.verbatim:
        raise UsageError("--verbatim-replies needs --api chat",
                         hint="vLLM's /v1/messages and /v1/responses take no allowed_token_ids")
    sizes = {"system_words": s.system_words, "user_words": s.user_words, "tool_words": s.tool_words}
    agentic_warm = None
    agentic_wl = _agentic(s)
    if agentic_wl is not None:
        if s.restart_after or s.verbatim:
            raise UsageError("--workload agentic runs without --restart-prefill-after-turn and --verbatim-replies")
        # one short session on the same preamble: warms P as the traces' ever-present preamble would
        agentic_warm = dataclasses.replace(agentic_wl, sessions=[
            agentic.Chain(f"warmup-{s.seed}-{i}", f"warmup-{s.seed}-{i}", None, agentic_wl.sessions[0].turns[:2])
            for i in range(min(1, s.warmup))])
        convs = []
    else:
        convs = load(s.workload, s.seed) if s.workload else generate(s.seed, s.conversations, s.turns, **sizes)
    if s.restart_after and s.restart_after >= max(len(c.user_turns) for c in convs):
        raise UsageError(f"--restart-prefill-after-turn: {s.restart_after} leaves no turn after the restart",
                         hint="use a number below the turns per conversation")
    # The warm-up conversations have the measured ones' sizes, so they warm the same shapes.
    warm = generate(s.seed + 1000, s.warmup, max(len(c.user_turns) for c in convs), **sizes) \
        if s.warmup and convs else []
    if s.attach:
        if not ops.stored_plan(s.attach) or not ops.is_running(s.attach):
            raise NotRunningError(f"cluster {s.attach} is not running", hint="`pdserve status` lists clusters")
        arms = [Arm("attached", None, s.attach)]
        base_name = s.attach
    else:
        path = s.config or BENCH_CONFIG
        spec = load_spec(path)                  # exit 2 on a bad file, before anything starts
        data = yaml.safe_load(Path(path).read_text())
        chosen = [a.strip() for a in s.arms.split(",") if a.strip()]
        unknown = [a for a in chosen if a not in ARMS]
        if unknown or not chosen:
            raise UsageError(f"--arms: unknown arm {unknown[0] if unknown else '(none)'}",
                             hint=f"choose from {', '.join(ARMS)}")
        if s.api != "chat" and "vllm-router" in chosen:
            raise UsageError("--arms: the vllm-router arm is measured with --api chat only",
                             hint="leave it out of --arms, or use --api chat")
        arms = [Arm(arm, arm_config(data, arm), None) for arm in chosen]
        base_name = spec.name
    out = s.out or Path(f"bench-{base_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    info = {**sizes, "verbatim_replies": s.verbatim, "restart_prefill_after_turn": s.restart_after, "streamed": s.stream,
            "api": s.api, "request_timeout_s": s.request_timeout, "give_up_after": s.give_up_after,
            **({"agentic_workload": agentic_wl.settings} if agentic_wl else {})}
    concurrency = s.concurrency or (0 if agentic_wl else 1)       # 0: every agentic session at once
    return Session(s, arms, Workload(convs, warm, s.max_tokens, concurrency, info, agentic=agentic_wl,
                                     agentic_warm=agentic_warm), out)


def _agentic(s: Settings) -> agentic.AgenticWorkload | None:
    """`--workload agentic` (the flags' shape), or a workload file of agentic settings (agentic.FILETYPE)."""
    if s.workload is None:
        return None
    if str(s.workload) == AGENTIC:
        try:
            return agentic.generate(s.seed, s.conversations, s.turns, s.scale, s.time_scale, s.max_agents,
                                    s.agent_turns, s.max_gap, s.turn_scale, s.max_context, s.resume_context)
        except ValueError as exc:     # a --max-context below the preamble and a first turn
            raise UsageError(f"--max-context: {exc}") from None
    try:
        data = json.loads(Path(s.workload).read_text())
    except (OSError, ValueError):
        return None                   # workload.load says what is wrong with it
    if not (isinstance(data, dict) and data.get("filetype") == agentic.FILETYPE):
        return None
    try:
        return agentic.from_config(data, s.seed)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--workload {s.workload}: {exc}") from None


def run(session: Session, on_arm: Callable[[str], None], on_request: Callable[[dict], None],
        note: Callable[[str], None] = lambda message: None) -> Outcome:
    """Every arm in turn (each brought up, measured and brought down), then the report files."""
    session.workload.note = note
    for arm in session.arms:
        on_arm(arm.name)
        rows, session.totals[arm.name] = _run_one(arm, session.out, session.workload, on_request)
        session.rows += rows
    s, w = session.settings, session.workload
    rows = report.answered(session.rows)        # the failed requests count in per_arm only
    summary = report.summarize(rows)
    after_restart = report.after_pause(rows) if s.restart_after else None
    meta = {"config": str(s.config or BENCH_CONFIG) if not s.attach else s.attach,
            "arms": [a.name for a in session.arms],
            "conversations": len(w.convs) if w.agentic is None else len(w.agentic.chains()),
            "requests_per_arm": session.requests_per_arm,
            "concurrency": w.concurrency, "max_tokens": s.max_tokens, "seed": s.seed, "warmup_conversations": s.warmup,
            "pulled_share_on": report.pulled_share(rows), "outside_legs_p50_ms": report.outside_legs_ms(rows),
            "by_turn_size": report.by_turn_size(rows), "per_arm": report.per_arm(session.rows),
            "host": report.host_facts(),
            **({"agentic": agentic_report(session.rows, session.totals)} if w.agentic is not None else {}),
            **w.info, **({"after_prefill_restart": after_restart} if after_restart else {})}
    files = report.write_files(session.out, meta, session.rows, summary, session.totals)
    return Outcome(summary, meta, session.totals, after_restart, files)


def _run_one(arm: Arm, out: Path, w: Workload, on_request: Callable[[dict], None]):
    if arm.config is None:
        return _measure(arm.name, endpoints(arm.cluster), w, on_request, arm.cluster)
    arm_file = out / f"{arm.name}.yaml"
    arm_file.write_text(yaml.safe_dump(arm.config, sort_keys=False))
    name = arm.config["name"]
    with deployed(arm.name, arm_file):
        ep = endpoints(name)
        if arm.name != "vllm-router":
            return _measure(arm.name, ep, w, on_request, name)
        if ep.api_key:
            raise UsageError("arm vllm-router: the cluster has an API key (router.api_key_env); "
                             "run that arm without one")
        # The same servers, reached through vllm-router instead of pdserve's router (which stays idle).
        with vrouter.running(ep.prefill, ep.decode, out / "vllm-router.log") as vr:
            w.info["vllm_router"] = {"version": vr.version, "argv": vr.argv}
            return _measure(arm.name, dataclasses.replace(ep, router=vr.url, stream=True), w, on_request, name)


def _measure(arm: str, ep: Endpoints, w: Workload, on_request: Callable[[dict], None], cluster_name: str):
    extra = None
    ep = dataclasses.replace(ep, api=w.info.get("api", "chat"))
    if w.info.get("streamed"):
        ep = dataclasses.replace(ep, stream=True)
    if w.info["verbatim_replies"]:
        ids = verbatim_token_ids(ep, WORDS)       # same model in every arm: the same ids
        w.info["verbatim_token_ids"] = ids
        extra = {"allowed_token_ids": ids}
    timeout = w.info["request_timeout_s"]
    if w.agentic is not None:
        if w.agentic_warm is not None and w.agentic_warm.sessions:
            agentic.run_arm(f"{arm}-warmup", ep, w.agentic_warm, w.max_tokens, request_timeout=timeout)
        return agentic.run_arm(arm, ep, w.agentic, w.max_tokens, w.concurrency, on_request, request_timeout=timeout)
    if w.warm:
        run_arm(f"{arm}-warmup", ep, w.warm, w.max_tokens, 1, extra=extra, request_timeout=timeout)
    turn = w.info["restart_prefill_after_turn"]

    def restart() -> None:
        w.info.setdefault("prefill_restart_s", {})[arm] = restart_prefill(cluster_name, ep, w.note)
    pause = (turn, restart) if turn else None
    return run_arm(arm, ep, w.convs, w.max_tokens, w.concurrency, on_request, extra=extra, pause=pause,
                   request_timeout=timeout, give_up_after=w.info.get("give_up_after", 0))


def restart_prefill(name: str, ep: Endpoints, note: Callable[[str], None]) -> float:
    """Every prefill server restarted through the supervisor, as `pdserve restart` does, then one request
    outside the workload: a fresh server's first request carries one-time costs, as after `--warmup`.
    Returns the seconds until they were ready again."""
    started = time.monotonic()
    ops.restart(name, ops.processes_of(name, PREFILL), ops.STARTUP_TIMEOUT_S,
                on_ready_again=lambda n, took: note(f"{n} restarted in {took:.1f}s"))
    took = time.monotonic() - started
    chat(ep, [{"role": "user", "content": f"warm-up after restart {time.time_ns()}"}], 2)
    return round(took, 1)


def endpoints(name: str) -> Endpoints:
    """Where a running cluster's router and servers answer, and the key its router wants."""
    plan = ops.stored_plan(name)
    return Endpoints(plan.router_url, [p.url for p in plan.processes if p.role == PREFILL],
                     plan.router_config.get("model", ""), api_key_of(plan.router_config),
                     [p.url for p in plan.processes if p.role == DECODE])
