"""The real coding agents (Claude Code, Codex) as npm installs them (scripts/install-test-deps.sh, pinned here
and there), run in a loopback-only network namespace (tests/kits/loopback_bridge.py) against a router, one
command per turn, with what each turn sent, received and cost P (its own counters)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.kits.loopback_bridge import Bridge, Request, requests
from tests.kits.vllm_cluster import EXTERNAL, LOCAL, metric

ROOT = Path(__file__).resolve().parents[2]
AGENTS = Path(os.environ.get("PDSERVE_TEST_AGENTS", ROOT / ".test-agents"))
PINS = {"claude": ("@anthropic-ai/claude-code", "2.1.332"), "codex": ("@openai/codex", "0.171.0")}
API_PATHS = {"claude": "/v1/messages", "codex": "/v1/responses"}
SESSION_HEADERS = {"claude": "x-claude-code-session-id", "codex": "session-id"}
HANDLE_BYTES = ("kv_transfer_params", "remote_block_ids", "remote_engine_id", "pdserve_token_ids")
# Each agent kept off the internet: no telemetry, updates, error reports or other nonessential calls.
CLAUDE_OFFLINE = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
                  "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}


def missing_agents() -> str | None:
    """Why the pinned agents cannot run here, or None."""
    import json
    for agent, (package, version) in PINS.items():
        try:
            found = json.loads((AGENTS / "node_modules" / package / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            return f"{package} is not installed in {AGENTS} (scripts/install-test-deps.sh)"
        if found != version:
            return f"{package} {found} in {AGENTS}, the test pins {version} (scripts/install-test-deps.sh)"
    return None


def claude_env(home: Path, base_url: str, key: str = "unused") -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / "claude"),
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_AUTH_TOKEN": key, "ANTHROPIC_MODEL": "tiny",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny", "ANTHROPIC_SMALL_FAST_MODEL": "tiny", **CLAUDE_OFFLINE}


def codex_env(home: Path, base_url: str, key: str | None = None) -> dict[str, str]:
    """CODEX_HOME with a config.toml for the router (README "Coding agents"); `key`: sent as a Bearer token."""
    codex = home / "codex"
    codex.mkdir(parents=True, exist_ok=True)
    (codex / "config.toml").write_text(f"""model = "tiny"
model_provider = "pdserve"

[model_providers.pdserve]
name = "pdserve"
base_url = "{base_url}/v1"
wire_api = "responses"
{'env_key = "PDSERVE_API_KEY"' if key else ''}

[features]
plugins = false

[analytics]
enabled = false
""")
    return {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex),
            **({"PDSERVE_API_KEY": key} if key else {})}


@dataclass
class Turn:
    agent: str
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    sent: list[Request]                      # every request the agent made this turn
    received: bytes                          # every byte it got back
    p_prompt: float = 0                      # P's own counters over the turn
    p_requests: float = 0
    p_computed: float = 0
    p_pulled: float = 0
    cpu: dict[str, float] = field(default_factory=dict)   # CPU seconds: the agent, P's and D's process trees
    previous_prompt: float | None = None

    @property
    def main(self) -> list[Request]:
        """The agent's model calls with its tools: the turn itself. Anything else is a side request."""
        return [r for r in self.sent if r.method == "POST" and r.path.split("?")[0] == API_PATHS[self.agent]
                and r.json().get("tools")]

    @property
    def side(self) -> list[Request]:
        return [r for r in self.sent if r not in self.main]

    def session(self) -> str:
        return self.main[0].headers[SESSION_HEADERS[self.agent]]

    def line(self, n: int) -> str:
        beyond = "" if self.previous_prompt is None else f", beyond the previous prompt {self.p_prompt - self.previous_prompt:.0f}"
        side = ", ".join(f"{r.method} {r.path}" for r in self.side) or "none"
        return (f"{self.agent} turn {n} `{' '.join(self.argv[:-1])} PROMPT`: exit {self.rc} in {self.seconds:.1f} s, "
                f"output {len(self.stdout.strip())} chars; main requests {len(self.main)}, side requests: {side}; "
                f"P: {self.p_requests:.0f} request(s), prompt {self.p_prompt:.0f}{beyond}, computed "
                f"{self.p_computed:.0f}, pulled from D {self.p_pulled:.0f}; router's prefill {self.prefill_ms():.0f} ms; "
                f"CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in self.cpu.items()))

    def prefill_ms(self) -> float:
        """The prefill leg's time, from the router's Server-Timing header on the answers."""
        return sum(float(ms) for ms in re.findall(rb"prefill;dur=([0-9.]+)", self.received))


def p_counters(prefill: list[str]) -> tuple[float, float, float, float]:
    """P's prompt tokens, requests, tokens computed and tokens pulled from D (all prefill servers)."""
    rows = [(metric(p, "vllm:prompt_tokens_total"), metric(p, "vllm:request_prompt_tokens_count"),
             metric(p, "vllm:prompt_tokens_by_source_total", **LOCAL),
             metric(p, "vllm:prompt_tokens_by_source_total", **EXTERNAL)) for p in prefill]
    return tuple(sum(col) for col in zip(*rows))      # type: ignore[return-value]


def tree_cpu(pid: int) -> float:
    """CPU seconds used so far by a process and its descendants (Linux /proc)."""
    tick, children, total = os.sysconf("SC_CLK_TCK"), {}, 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append((int(entry.name), fields))
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, fields in children.get(parent, []):
            todo.append(child)
            total += (int(fields[11]) + int(fields[12])) / tick
    own = Path(f"/proc/{pid}/stat")
    if own.exists():
        fields = own.read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def run_turn(bridge: Bridge, agent: str, args: list[str], env: dict, cwd: Path, prefill: list[str],
             servers: dict[str, int] | None = None, timeout: float = 480) -> Turn:
    """One agent command (`claude ARGS` / `codex ARGS`) in the bridge's namespace; `servers`: name -> pid of
    processes whose CPU time the turn reports."""
    binary = str(AGENTS / "node_modules" / ".bin" / agent)
    servers = servers or {}
    cpu0 = {name: tree_cpu(pid) for name, pid in servers.items()}
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    mark, before, started = bridge.mark(), p_counters(prefill), time.monotonic()
    res = subprocess.run(bridge.argv(binary, *args), env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    seconds = time.monotonic() - started
    after = p_counters(prefill)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {agent: usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime,
           **{name: tree_cpu(pid) - cpu0[name] for name, pid in servers.items()}}
    conns = bridge.since(mark)
    prompt, reqs, computed, pulled = (a - b for a, b in zip(after, before))
    return Turn(agent, [agent, *args], res.returncode, res.stdout, res.stderr, seconds, requests(conns),
                b"".join(bytes(c.received) for c in conns), prompt, reqs, computed, pulled, cpu)
