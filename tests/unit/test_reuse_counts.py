"""Counts a user can trust (issue 42): which request is a conversation's first turn on each wire format, what
`status` prints of first turns and turns on D alone, and what it says when the router's key is not exported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.console import Console

from pdserve.cli.status import _view
from pdserve.observe.routerstats import parse_metrics
from pdserve.orchestrate.view import ClusterView, key_missing
from pdserve.router.api import BY_ROUTE
from pdserve.state.records import Phase

CHAT, COMPLETIONS, MESSAGES, RESPONSES = (BY_ROUTE[r] for r in ("/v1/chat/completions", "/v1/completions",
                                                                 "/v1/messages", "/v1/responses"))
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("fmt, body, first", [
    (CHAT, {"messages": [{"role": "system", "content": "s"}, USER]}, True),
    (CHAT, {"messages": [USER, {"role": "assistant", "content": "a"}, USER]}, False),
    (CHAT, {"messages": [USER, {"role": "assistant", "tool_calls": []}, {"role": "tool", "content": "x"}]}, False),
    (MESSAGES, {"system": "s", "messages": [USER, USER]}, True),
    (MESSAGES, {"messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}, USER]}, False),
    (RESPONSES, {"input": "hi"}, True),
    (RESPONSES, {"instructions": "s", "input": [{"type": "message", "role": "developer", "content": "d"},
                                                {"type": "message", "role": "user", "content": "u"}]}, True),
    (RESPONSES, {"input": [{"role": "user", "content": "u"}]}, True),          # type defaults to message
    (RESPONSES, {"input": [{"type": "message", "role": "assistant", "content": "a"}]}, False),
    (RESPONSES, {"input": [{"type": "function_call", "name": "f", "arguments": "{}"},
                           {"type": "function_call_output", "output": "x"}]}, False),
    (RESPONSES, {"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "u"}]}, False),
    (RESPONSES, {"input": "hi", "previous_response_id": "resp_1"}, False),
    # completions: one prompt text, no roles: never told a first turn (a session's first request is no_entry)
    (COMPLETIONS, {"prompt": "hi"}, False),
])
def test_a_first_turn_is_a_history_without_earlier_model_output(fmt, body, first):
    assert fmt.first_turn(body) is first


def shown(**view) -> str:
    console = Console(width=250, record=True)
    console.print(_view(ClusterView(**{"name": "c", "phase": Phase.RUNNING, "running": True,
                                       "supervisor_alive": True, "error": None, "router_url": "http://r",
                                       "processes": [], "router": None, "transfers": None, "state_dir": "",
                                       "scrape_targets": "", **view})))
    return console.export_text()


def test_status_leaves_first_turns_out_of_the_hit_rate_and_counts_turns_on_d_alone_as_reused():
    router = parse_metrics("""
pdserve_router_turns_total{api="messages",outcome="stored"} 3.0
pdserve_router_reuse_decisions_total{api="messages",reason="no_entry",result="first"} 1.0
pdserve_router_reuse_decisions_total{api="messages",reason="continuation",result="hit"} 1.0
pdserve_router_reuse_decisions_total{api="messages",reason="decode_only",result="hit"} 1.0
pdserve_router_reuse_decisions_total{api="messages",reason="no_entry",result="miss"} 0.0
""")
    text = shown(router=router)
    assert "reuse hit rate 100% (2/2 follow-ups, 1 of them on D alone; first turns 1)" in text
    assert "misses: none" in text
    assert "by API: messages 3 turns, 2/2 reused (1 on D alone), 1 first" in text


def test_status_says_the_reuse_section_needs_the_routers_key_when_it_is_not_exported(monkeypatch):
    monkeypatch.delenv("PDSERVE_TEST_ROUTER_KEY", raising=False)
    plan = SimpleNamespace(router_config={"api_key_env": "PDSERVE_TEST_ROUTER_KEY"})
    assert key_missing(plan) == "PDSERVE_TEST_ROUTER_KEY"
    text = shown(router=None, router_key_missing=key_missing(plan))
    assert "export PDSERVE_TEST_ROUTER_KEY (router.api_key_env)" in text
    view = ClusterView(name="c", phase=Phase.RUNNING, running=True, supervisor_alive=True, error=None,
                       router_url="http://r", processes=[], router=None, transfers=None, state_dir="",
                       scrape_targets="", router_key_missing=key_missing(plan))
    assert view.to_json()["router_key_missing"] == "PDSERVE_TEST_ROUTER_KEY"
    monkeypatch.setenv("PDSERVE_TEST_ROUTER_KEY", "k")
    assert key_missing(plan) is None
    assert key_missing(SimpleNamespace(router_config={"api_key_env": None})) is None and key_missing(None) is None
