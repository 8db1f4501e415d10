"""Subagents through the router (issue 43, item 4), with the header sequences the agents send: Claude Code's
parent turn, then a group of subagents under the parent's X-Claude-Code-Session-Id, each with its own
X-Claude-Code-Agent-Id, then the parent again; Dynamo's canonical pair (X-Dynamo-Session-ID per chain,
X-Dynamo-Parent-Session-ID naming the parent). Each chain keeps its own entry (its follow-up reads its own
previous turn from D, never a sibling's), and every turn of the root session goes to one P of two (its prefix
cache holds what the siblings share)."""

from __future__ import annotations

import pytest

from pdserve.observe.promtext import parse, total
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

MESSAGES = "/v1/messages"
SYSTEM = "You are a coding agent. Tools: read_file, search, run. " + "Keep every change small. " * 12


def claude_code(agent: str | None) -> dict[str, str]:
    """Claude Code's headers: the session id on every request, the agent id on a subagent's."""
    return {"X-Claude-Code-Session-Id": "cc-root", **({"X-Claude-Code-Agent-Id": agent} if agent else {})}


def dynamo(agent: str | None) -> dict[str, str]:
    """Dynamo's canonical pair: a session id per chain, a subagent's naming its parent."""
    if agent is None:
        return {"X-Dynamo-Session-ID": "run-1"}
    return {"X-Dynamo-Session-ID": f"run-1:{agent}", "X-Dynamo-Parent-Session-ID": "run-1"}


async def turn(dep, headers: dict, messages: list[dict]) -> tuple[list[dict], int]:
    """One turn; the history with the reply, and its prompt's tokens: what the next turn of the chain may read
    from D (the common token prefix of D's sequence and the next prompt: the fake's reply ids re-tokenize
    differently, so the prompt)."""
    body = {"model": "fake", "max_tokens": 6, "system": SYSTEM, "messages": messages}
    async with dep.session.post(dep.url + MESSAGES, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    return [*messages, {"role": "assistant", "content": data["content"]}], data["usage"]["input_tokens"]


def p_legs(dep) -> list[tuple[int, dict]]:
    """(prefill server, the P leg's body) of every P leg, per server in arrival order."""
    return [(i, r["body"]) for i, app in enumerate(dep.prefill) for r in app[FAKE].received if r["path"] == MESSAGES]


@pytest.mark.parametrize("headers", [claude_code, dynamo], ids=["claude-code", "dynamo"])
async def test_each_subagent_continues_its_own_chain_and_the_root_session_stays_on_one_p(headers):
    async with deployment(prefill_args=([], [])) as dep:
        parent, parent_held = await turn(dep, headers(None), [{"role": "user", "content": "plan the work " * 30}])
        agents = {}
        for i in range(3):
            # each forks the parent's prefix with a task of its own length, so D's sequences differ
            task = [*parent, {"role": "user", "content": f"subtask {i} " * (8 + 6 * i)}]
            agents[f"agent-{i}"] = await turn(dep, headers(f"agent-{i}"), task)
        for agent, (history, _) in list(agents.items()):
            await turn(dep, headers(agent), [*history, {"role": "user", "content": "tool result " * 5}])
        await turn(dep, headers(None), [*parent, {"role": "user", "content": "the agents are done " * 4}])

        legs = p_legs(dep)
        assert len(legs) == 8 and len({server for server, _ in legs}) == 1, [s for s, _ in legs]
        offered = [(body.get("kv_transfer_params") or {}).get("remote_num_tokens") for _, body in legs]
        held = [held for _, held in agents.values()]
        assert len(set(held)) == 3
        # parent turn 1 and the subagents' first turns read nothing; each follow-up its own previous turn
        assert offered == [None, None, None, None, *held, parent_held]
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit") == 4
        # the subagents' first turns carry the parent's reply but no entry of their own: they never take the
        # parent's (single-use: the parent's next turn would lose it)
        assert total(m, "pdserve_router_reuse_decisions_total", result="miss") == 3
        assert total(m, "pdserve_router_reuse_decisions_total", result="miss", reason="no_entry") == 3


async def test_separate_root_sessions_still_spread_over_the_prefill_servers():
    """The preference is per root session: other sessions go where load sends them."""
    async with deployment(prefill_args=([], [])) as dep:
        for s in range(8):
            await turn(dep, {"X-Claude-Code-Session-Id": f"cc-{s}"}, [{"role": "user", "content": f"task {s} " * 20}])
        assert len({server for server, _ in p_legs(dep)}) == 2
