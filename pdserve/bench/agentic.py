"""`pdserve bench --workload agentic`: sessions shaped like published Claude Code traces (219 sessions, 78,099
requests; llm-d's agentic guide, SemiAnalysis' AgentX), scaled down by flags to run on a CPU.

- Every session opens with one shared preamble (system prompt + tool definitions, PREAMBLE_TOKENS).
- Each turn adds a user message or tool result of TURN_TOKENS_P50 tokens at the median (log-normal,
  TURN_SIGMA), so nearly every turn reuses >= 90% of its input, as 96% of the traces' turns do.
- Between turns the session pauses for a gap drawn from the traces' quantiles (GAP_QUANTILES: p50 2 s, p90
  24 s, p99 11.4 min), times `time_scale`; a gap that was longer than D's timer (`decoder_kv_blocks_ttl`,
  480 s) in published time is marked `past_ttl` (`max_gap` caps every gap, for CI).
- Sub-agent groups fork a parent's prefix (its history so far) after one of its turns: group size p50 7
  (AGENTS_P50, capped by `max_agents`), groups added until about SUBAGENT_SHARE of the requests are
  sub-agents'. A sub-agent sends Claude Code's headers: the parent's `X-Claude-Code-Session-Id` and its own
  `X-Claude-Code-Agent-Id`; a main session the session id alone.

Sizes are in words, each standing for a token of the published shape, times `scale`; the turns' (not the
preamble's) also times `turn_scale`, so that sessions reach long contexts in few turns. The assumptions the
published figures leave open (the spread of turn sizes and group sizes, the shortest and longest gap, the
preamble's size, how many turns a sub-agent runs) are the constants below. `resume_context` opens each session
with an earlier transcript of about that many tokens (RESUME_SPREAD either side), as `claude --resume` sends
one: sessions then reach 100k tokens in tens of turns of the published size, not the ~100 a session from the
preamble alone takes. The generator is deterministic
in its seed, and a run of fewer sessions is the first sessions of a run of more (the same texts, gaps and
forks), so arms run with different `sessions` compare the same sessions; `run_arm` sends it (every session at once, up to `concurrency`; a group's agents together) and
returns rows that `agentic_report` reads.
"""

from __future__ import annotations

import bisect
import http.client
import json
import math
import random
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.metrics import prefill_deltas
from pdserve.bench.run import NO_REPLY, Endpoints, chat, failure, summed_metrics
from pdserve.bench.workload import WORDS
from pdserve.observe.promtext import auth_headers

PREAMBLE_TOKENS = 24_000        # Claude Code's system prompt + tools (11-31k measured here, README)
TURN_TOKENS_P50 = 632           # tokens a turn adds, median (published)
TURN_SIGMA = 0.8                # log-normal spread (assumed): ~5% of turns over 10% of the preamble
# (quantile, seconds) of the gap between turns: p50, p90, p99 published; the ends assumed
GAP_QUANTILES = ((0.0, 0.25), (0.5, 2.0), (0.9, 24.0), (0.99, 684.0), (1.0, 3600.0))
DECODER_TTL_S = 480.0           # D's default decoder_kv_blocks_ttl: a longer gap finds D's blocks expired
AGENTS_P50 = 7                  # sub-agents per group, median (published); log-normal spread AGENTS_SIGMA
AGENTS_SIGMA = 0.5
SUBAGENT_SHARE = 0.5            # half the requests come in sub-agent groups (published)
RESUME_SPREAD = 0.15            # a resumed transcript's size: resume_context times 1 +- this, uniform (assumed)
SESSION_HEADER, AGENT_HEADER = "X-Claude-Code-Session-Id", "X-Claude-Code-Agent-Id"


@dataclass
class Turn:
    text: str
    gap_s: float                # pause before this turn (0 for a chain's first)
    past_ttl: bool = False      # the gap was longer than D's timer in published time


@dataclass
class Chain:
    """One agent's conversation: a main session, or a sub-agent forked from its parent's history."""
    id: str
    root: str                   # the session id every request of the session sends
    agent: str | None           # a sub-agent's id (None: the main agent)
    turns: list[Turn]
    forks: dict[int, list[Chain]] = field(default_factory=dict)   # after turn index k: these agents, together

    @property
    def headers(self) -> dict[str, str]:
        return {SESSION_HEADER: self.root, **({AGENT_HEADER: self.agent} if self.agent else {})}

    def all_chains(self) -> list[Chain]:
        return [self, *(c for group in self.forks.values() for agent in group for c in agent.all_chains())]


@dataclass
class AgenticWorkload:
    preamble: str
    sessions: list[Chain]
    settings: dict[str, Any]

    def chains(self) -> list[Chain]:
        return [c for s in self.sessions for c in s.all_chains()]

    @property
    def requests(self) -> int:
        return sum(len(c.turns) for c in self.chains())


def gap_seconds(u: float) -> float:
    """The published gap at quantile u (0..1): log-linear between GAP_QUANTILES."""
    qs = [q for q, _ in GAP_QUANTILES]
    i = max(1, min(len(qs) - 1, bisect.bisect_right(qs, u)))
    (q0, s0), (q1, s1) = GAP_QUANTILES[i - 1], GAP_QUANTILES[i]
    w = (u - q0) / (q1 - q0)
    return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))


def turn_tokens(rng: random.Random) -> float:
    return TURN_TOKENS_P50 * math.exp(rng.gauss(0.0, TURN_SIGMA))


def group_size(rng: random.Random, max_agents: int) -> int:
    return max(1, min(max_agents, round(AGENTS_P50 * math.exp(rng.gauss(0.0, AGENTS_SIGMA)))))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def _turns(rng: random.Random, n: int, scale: float, time_scale: float, max_gap: float, what: str) -> list[Turn]:
    """`scale`: the turns' own (generate's scale * turn_scale)."""
    out = []
    for t in range(n):
        published = gap_seconds(rng.random()) if t else 0.0
        gap = published * time_scale
        out.append(Turn(f"{what} {t + 1}: " + _words(rng, round(turn_tokens(rng) * scale)),
                        min(gap, max_gap) if max_gap else gap, published > DECODER_TTL_S))
    return out


def generate(seed: int = 0, sessions: int = 2, turns: int = 8, scale: float = 1 / 32, time_scale: float = 0.01,
             max_agents: int = 16, agent_turns: int = 3, max_gap: float = 0.0,
             turn_scale: float = 1.0, max_context: int = 0, resume_context: int = 0) -> AgenticWorkload:
    """Sessions of `turns` main turns; sub-agent groups of `agent_turns` turns each, forked after main turns
    (never the last; at most one group per turn) while each brings the sub-agents' share of the session's
    requests nearer SUBAGENT_SHARE. `scale` sizes the preamble and the turns, `turn_scale` the turns alone.
    `max_context` (words; 0: none) ends each chain before the turn that would take the preamble and its turns
    past it (the replies come on top), so that no request passes the model's context. `resume_context`
    (tokens of the published shape, times `scale`; 0: none) puts an earlier transcript before each session's
    first turn (new to every cache: that turn computes it)."""
    rng = random.Random(seed)
    preamble = "You are a coding agent. Tools: read_file, edit_file, search, run_tests, bash. " + _words(
        rng, round(PREAMBLE_TOKENS * scale))
    turn_size = scale * turn_scale
    out = []
    for s in range(sessions):           # one rng in session order: session s never depends on `sessions`
        root = f"agentic-{seed}-{s}"
        own = random.Random(f"{seed}-{s}-resume")     # its own draws: the same transcript whatever `turns`
        resumed = _words(own, round(resume_context * scale * own.uniform(1 - RESUME_SPREAD, 1 + RESUME_SPREAD))
                         ) if resume_context else ""
        main = Chain(root, root, None, _turns(rng, turns, turn_size, time_scale, max_gap, "Task step"))
        if resumed:
            main.turns[0].text = f"Resumed session, earlier transcript: {resumed}\n{main.turns[0].text}"
        wanted = SUBAGENT_SHARE / (1 - SUBAGENT_SHARE) * turns
        forkable = list(range(turns - 1))
        rng.shuffle(forkable)
        sub = 0
        for k in forkable:
            size = group_size(rng, max_agents)
            if not agent_turns or abs(sub + agent_turns * size - wanted) >= abs(sub - wanted):
                break                   # one more group would take the share further from SUBAGENT_SHARE
            main.forks[k] = [Chain(f"{root}/g{k}a{i}", root, f"g{k}a{i}",
                                   _turns(rng, agent_turns, turn_size, time_scale, max_gap, f"Subagent {i} step"))
                             for i in range(size)]
            sub += agent_turns * size
        if max_context:                 # after every draw: the cap changes no other session's texts or gaps
            _cap(main, len(preamble.split()), max_context)
            if not main.turns:
                raise ValueError(f"max_context {max_context} leaves session {s} no turn (preamble: "
                                 f"{len(preamble.split())} words)")
        out.append(main)
    settings = {"sessions": sessions, "turns": turns, "scale": scale, "turn_scale": turn_scale,
                "time_scale": time_scale, "max_agents": max_agents, "agent_turns": agent_turns,
                "max_gap_s": max_gap, "max_context": max_context, "resume_context": resume_context, "seed": seed}
    return AgenticWorkload(preamble, out, settings)


def _cap(chain: Chain, context: int, limit: int) -> None:
    """Cut `chain` (and its forks) before the first turn that takes its words past `limit`; `context`: the
    words before its first turn. A fork keeps a parent turn after it; a sub-agent left with no turn goes."""
    kept = 0
    for k, turn in enumerate(chain.turns):
        context += len(turn.text.split())
        if context > limit:
            break
        kept = k + 1
        for agent in chain.forks.get(k, []):
            _cap(agent, context, limit)
    chain.turns = chain.turns[:kept]
    chain.forks = {k: live for k, group in chain.forks.items()
                   if k < kept - 1 and (live := [agent for agent in group if agent.turns])}


FILETYPE = "agentic"    # a --workload file {"filetype": "agentic", ...generate's settings}: results.json's own


def from_config(cfg: dict[str, Any], seed: int = 0) -> AgenticWorkload:
    """A workload file's settings (results.json's `agentic_workload`, with "filetype": "agentic"); those it
    leaves out take generate's defaults, `seed` the command's."""
    known = {"sessions", "turns", "scale", "turn_scale", "time_scale", "max_agents", "agent_turns", "max_gap_s",
             "max_context", "resume_context", "seed"}
    unknown = sorted(set(cfg) - known - {"filetype"})
    if unknown:
        raise ValueError(f"unknown agentic setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
    args = {k: v for k, v in cfg.items() if k in known}
    if "max_gap_s" in args:
        args["max_gap"] = args.pop("max_gap_s")
    return generate(**{"seed": seed, **args})


def preamble_tokens(ep: Endpoints, preamble: str) -> int:
    """The preamble's tokens as the chat template renders it alone (P's /tokenize); 0 if P cannot say."""
    body = {"model": ep.model, "messages": [{"role": "system", "content": preamble}], "add_generation_prompt": False}
    req = urllib.request.Request(ep.prefill[0] + "/tokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **auth_headers(ep.api_key)})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(json.loads(resp.read()).get("count") or 0)
    except (OSError, ValueError):
        return 0


def kv_source(result: dict[str, Any]) -> str:
    """Where the turn's reused KV came from, as the router reports it: P read D's (d_pull), D served the turn
    alone on what it held (d_alone), P loaded some from its CPU tier and read nothing from D (p_tier), or P
    prefilled it (p: computed, its GPU prefix cache included)."""
    if result.get("pulled"):
        return "d_pull"
    if result.get("plan") == "decode_only":
        return "d_alone"
    return "p_tier" if result.get("tier_tokens") else "p"


def run_arm(arm: str, ep: Endpoints, wl: AgenticWorkload, max_tokens: int, concurrency: int = 0,
            on_request: Callable[[dict[str, Any]], None] = lambda row: None, request_timeout: float = 60.0,
            sleep: Callable[[float], None] = time.sleep) -> tuple[list[dict], dict]:
    """Every session at once (at most `concurrency`; 0: all), each turn after its gap, a group's sub-agents
    together after the parent's turn they fork from (the parent waits for them, as for a tool's result).
    Returns the rows and P's counter deltas over the arm (prefill_deltas)."""
    lock = threading.Lock()
    rows: list[dict[str, Any]] = []
    system = {"role": "system", "content": wl.preamble}
    preamble = preamble_tokens(ep, wl.preamble)

    def run_chain(chain: Chain, history: list[dict[str, Any]], held: int) -> None:
        """`history`: what the chain starts from (a sub-agent: its parent's); `held`: tokens of it that an
        earlier request computed (what some cache could hold: the parent's sequence at the fork, then the
        chain's own previous one)."""
        for t, turn in enumerate(chain.turns):
            if turn.gap_s:
                sleep(turn.gap_s)
            messages = [*(history or [system]), {"role": "user", "content": turn.text}]
            sent = time.perf_counter()
            row: dict[str, Any] = {"arm": arm, "api": ep.api, "conversation": chain.id, "root": chain.root,
                                   "agent": chain.agent or "", "turn": t + 1, "gap_s": round(turn.gap_s, 3),
                                   "past_ttl": turn.past_ttl}
            try:
                result = chat(ep, messages, max_tokens, timeout=request_timeout, headers=chain.headers)
            except (OSError, http.client.HTTPException, ValueError) as exc:    # OSError: URLError, timeouts
                row.update(error=failure(exc), latency_s=time.perf_counter() - sent)
                history, held = [*messages, {"role": "assistant", "content": NO_REPLY}], 0   # nothing to continue
                with lock:
                    rows.append(row)
                    on_request(row)
                continue
            prompt = result["prompt_tokens"]
            last = max(0, prompt - 1)                 # vLLM computes a prompt's last token whatever it holds
            own = min(held if t else 0, last)         # D's sequence of this chain's previous turn
            row.update({k: v for k, v in result.items() if k not in ("reply", "items")},
                       reusable_tokens=own, theoretical_tokens=min(max(held, preamble), last),
                       new_tokens=prompt - own, kv_source=kv_source(result))
            history = [*messages, {"role": "assistant", "content": result["reply"]}]
            held = prompt + result["completion_tokens"] - 1       # D's sequence: all but the last sampled token
            with lock:
                rows.append(row)
                on_request(row)
            group = chain.forks.get(t) or []
            if group:
                with ThreadPoolExecutor(max_workers=len(group)) as pool:
                    for future in [pool.submit(run_chain, agent, history, held) for agent in group]:
                        future.result()

    before = summed_metrics(ep.prefill)
    with ThreadPoolExecutor(max_workers=concurrency or len(wl.sessions)) as pool:
        for future in [pool.submit(run_chain, s, [], 0) for s in wl.sessions]:
            future.result()
    totals = prefill_deltas(before, summed_metrics(ep.prefill))
    totals["preamble_tokens"] = preamble
    return sorted(rows, key=lambda r: (r["conversation"], r["turn"])), totals
