"""Prefill policy `affinity` through the router: every turn of a conversation on one prefill server, and
failover to another while that one is down."""

from __future__ import annotations

import asyncio

from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

CHAT = "/v1/chat/completions"


def _opening(app) -> set[str]:
    """The conversations (first user message) whose P legs this prefill server ran."""
    return {next(m["content"] for m in r["body"]["messages"] if m["role"] == "user")
            for r in app[FAKE].received if r["path"] == CHAT}


async def _converse(dep, c: int, turns: int) -> None:
    history = [{"role": "user", "content": f"task {c} " * 20}]
    for t in range(turns):
        status, data = await dep.post(CHAT, {"model": "fake", "messages": history, "max_tokens": 4})
        assert status == 200, data
        history += [data["choices"][0]["message"], {"role": "user", "content": f"next {t}"}]


async def test_affinity_keeps_each_conversation_on_one_prefill_server():
    async with deployment(prefill_args=([], [], []), prefill_policy="affinity", bidirectional_kv_xfer=False) as dep:
        # 10 conversations in lockstep over 3 servers: least-loaded's rotation would shift each one every turn
        await asyncio.gather(*(_converse(dep, c, 4) for c in range(10)))
        seen = [_opening(app) for app in dep.prefill]
        assert sum(len(s) for s in seen) == 10            # no conversation on two servers
        assert sum(1 for s in seen if s) >= 2             # and they spread


async def test_least_loaded_default_moves_conversations_between_servers():
    # the control: without affinity, sequential turns alternate (so the test above can fail)
    async with deployment(prefill_args=([], []), bidirectional_kv_xfer=False) as dep:
        await _converse(dep, 0, 4)
        assert all(_opening(app) for app in dep.prefill)


async def test_affinity_fails_over_while_its_server_fails_and_then_returns_home():
    async with deployment(prefill_args=([], []), prefill_policy="affinity", bidirectional_kv_xfer=False) as dep:
        await _converse(dep, 0, 1)
        home, other = sorted(dep.prefill, key=lambda app: -len(app[FAKE].received))
        home[FAKE].args.status = 500          # its answers fail: the other server takes the turn
        await _converse(dep, 0, 1)
        assert len(other[FAKE].received) == 1
        home[FAKE].args.status = 200
        await _converse(dep, 0, 3)
        assert len(other[FAKE].received) == 1 and len(home[FAKE].received) == 5
