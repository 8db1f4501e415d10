"""Which conversation a request names: every source the router understands, in its documented order."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from pdserve.router.identity import MAX_CONVERSATION_ID, SESSION_SOURCES, explicit_key, history, reply_key, session_id

# One request carrying every source, each with its own value.
ALL_HEADERS = {"X-Session-ID": "hdr", "x-session-affinity": "opencode", "X-Dynamo-Session-ID": "dyn",
               "X-Claude-Code-Session-Id": "claude", "thread-id": "codex-thread", "session-id": "codex-dash",
               "session_id": "codex-underscore"}
ALL_BODY = {"conversation_id": "conv", "session_id": "vllm", "vllm_xargs": {"session_id": "xargs"},
            "prompt_cache_key": "cache-key"}
EXPECTED_ORDER = ["conv", "vllm", "hdr", "xargs", "opencode", "dyn", "claude", "codex-thread", "codex-dash",
                  "codex-underscore", "cache-key"]


def req(headers: dict[str, str] | None = None):
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers or {})


def without(source: tuple[str, str], headers: dict, body: dict) -> tuple[dict, dict]:
    where, name = source
    headers, body = dict(headers), {**body, "vllm_xargs": dict(body.get("vllm_xargs", {}))}
    if where == "header":
        headers.pop(name, None)
    elif where == "xargs":
        body["vllm_xargs"].pop(name, None)
    else:
        body.pop(name, None)
    return headers, body


def test_sources_win_in_the_documented_order():
    headers, body, seen = ALL_HEADERS, ALL_BODY, []
    for source in SESSION_SOURCES:
        seen.append(session_id(req(headers), body))
        headers, body = without(source, headers, body)
    assert seen == EXPECTED_ORDER
    assert session_id(req(headers), body) is None


def test_each_source_alone_names_the_conversation():
    for (where, name), value in zip(SESSION_SOURCES, EXPECTED_ORDER):
        if where == "header":
            got = session_id(req({name: value}), {})
        elif where == "xargs":
            got = session_id(req(), {"vllm_xargs": {name: value}})
        else:
            got = session_id(req(), {name: value})
        assert got == value, (where, name)


def test_a_claude_code_subagent_is_its_own_conversation():
    parent = explicit_key(req({"X-Claude-Code-Session-Id": "s1"}), {})
    child = explicit_key(req({"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "a7"}), {})
    assert parent is not None and child is not None and parent != child


def test_a_codex_subagent_is_its_own_conversation():
    parent = explicit_key(req({"session-id": "s1"}), {})
    child = explicit_key(req({"session-id": "s1", "x-openai-subagent": "review"}), {})
    body_child = explicit_key(req({"x-openai-subagent": "compact"}), {"prompt_cache_key": "s1"})
    assert None not in (parent, child, body_child) and len({parent, child, body_child}) == 3


def test_side_requests_under_one_session_id_get_their_own_key():
    """Claude Code's small-model calls share the session id but not the model, system prompt or tools."""
    headers = {"X-Claude-Code-Session-Id": "s1"}
    main = explicit_key(req(headers), {}, "sonnet|You are Claude Code|Bash,Read")
    again = explicit_key(req(headers), {}, "sonnet|You are Claude Code|Bash,Read")
    side = explicit_key(req(headers), {}, "haiku|Write a title|")
    assert main == again and main != side


def test_an_x_api_key_is_the_same_tenant_as_its_bearer_token():
    bearer = explicit_key(req({"Authorization": "Bearer k1", "X-Session-ID": "c"}), {})
    x_key = explicit_key(req({"x-api-key": "k1", "X-Session-ID": "c"}), {})
    other = explicit_key(req({"x-api-key": "k2", "X-Session-ID": "c"}), {})
    assert bearer == x_key and bearer != other


def test_ids_stay_per_tenant_and_unusable_values_are_skipped():
    a = explicit_key(req({"Authorization": "Bearer a", "X-Session-ID": "same"}), {})
    b = explicit_key(req({"Authorization": "Bearer b", "X-Session-ID": "same"}), {})
    assert a is not None and b is not None and a[1] == b[1] and a[0] != b[0]
    assert session_id(req({"X-Session-ID": "h"}), {"session_id": 5, "vllm_xargs": "x"}) == "h"
    assert session_id(req(), {"conversation_id": "", "session_id": "v"}) == "v"
    assert explicit_key(req(), {"session_id": "x" * (MAX_CONVERSATION_ID + 1)}) is None


def test_a_subagents_root_session_is_its_parents():
    """Prefill affinity's key (identity.root_session): what a subagent and its parent share, per agent."""
    from pdserve.router.identity import root_session
    cases = [({"X-Claude-Code-Session-Id": "s1"}, "s1"),
             ({"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "a7"}, "s1"),
             ({"X-Dynamo-Session-ID": "s1:researcher", "X-Dynamo-Parent-Session-ID": "s1"}, "s1"),
             ({"X-Session-ID": "child", "x-parent-session-id": "s1"}, "s1"),          # OpenCode
             ({"thread-id": "t2", "x-codex-parent-thread-id": "s1"}, "s1"),          # Codex
             ({"session-id": "s1", "x-openai-subagent": "review"}, "s1"),
             ({"X-Dynamo-Session-ID": "s1"}, "s1"), ({}, None),
             ({"X-Claude-Code-Session-Id": "x" * (MAX_CONVERSATION_ID + 1)}, None)]
    for headers, root in cases:
        assert root_session(req(headers), {}) == root, headers
    assert root_session(req(), {"conversation_id": "c1"}) == "c1"
    # a parent header of another family does not apply to the chain that won
    assert root_session(req({"X-Claude-Code-Session-Id": "s1", "x-parent-session-id": "p"}), {}) == "s1"


# Messages of every shape the history hash reads: escapes and non-ASCII text, text parts, tool calls with
# arguments to canonicalise, a lone surrogate, no role, a non-text content, a non-object item.
KEYED_HISTORY = [
    {"role": "system", "content": "You are \"terse\".\n\ttabs\\ and é ünïcode ✓ 🚀"},
    {"role": "user", "content": [{"type": "text", "text": "part one "}, {"type": "text", "text": "part two"}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}}]},
    {"role": "tool", "content": "\ud800 lone surrogate \x00 nul", "tool_call_id": "c1"},
    {"role": "assistant", "content": "done", "tool_calls": []},
    {"role": None, "content": {"x": 1}},
    {"content": "no role"},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
    "not an object",
]


def test_history_keys_are_the_ones_earlier_routers_stored():
    """The automatic-detection keys are kept across restarts (the store file, Redis): the bytes hashed for a
    message must not change with how they are made (identity._canonical's fast path for plain messages gives
    json.dumps' text). The digests were computed by the router before that fast path (ace7ee2)."""
    assert history("t", KEYED_HISTORY)[1].hex() == "707640fbe5dc9a007db0cdeaf7a23c6ce5c0c2da32209acbf783720ed61cf9f8"
    assert reply_key("t", KEYED_HISTORY[:2], KEYED_HISTORY[2:5]) == (
        "t", "auto:6e9199a68cd9391e68bd59f96a4ee75c49dabd1e3073fb0d6ceb819544acdd0d")
