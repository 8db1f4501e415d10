"""Output tokens beyond the context (issue 42): nothing is computed for a request D must refuse.

The fake vLLM checks prompt and output cap against --max-model-len as vLLM 0.32 does (tests/kits/fake_context.py).
Claude Code asks max_tokens 32,000 on every turn; before, the router sent it to D unchanged after P had computed
the prompt, and D refused ("max_completion_tokens=32000 cannot be greater than max_model_len=..."). Now D's cap
is fitted to what the prompt leaves of D's context (read from D's /v1/models) and the turn is served; a prompt
that alone fills the context is refused by P's own validation before P computes anything, passed to the client
in its API's shape, not retried elsewhere nor served degraded on D."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.observe.promtext import parse, total
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

MESSAGES, CHAT, COMPLETIONS, RESPONSES = "/v1/messages", "/v1/chat/completions", "/v1/completions", "/v1/responses"
API = {MESSAGES: "messages", CHAT: "chat", COMPLETIONS: "completions", RESPONSES: "responses"}
CLAUDE_CODE_MAX_TOKENS = 32_000
# The fake's template adds 3 tokens to one user message: "<user> ... </s> <assistant>" (fake_vllm.chat_text).
TEMPLATE = 3


def limits(n: int) -> dict:
    return {"prefill_args": (["--max-model-len", str(n)],), "decode_args": (["--max-model-len", str(n)],)}


def body(path: str, words: int, cap: int = CLAUDE_CODE_MAX_TOKENS, **kw) -> dict:
    """A request of `words` words of text (one fake token each) whose API's output caps all ask `cap`."""
    text = " ".join(f"w{i}" for i in range(words))
    if path == MESSAGES:
        return {"model": "fake", "max_tokens": cap, "messages": [{"role": "user", "content": text}], **kw}
    if path == CHAT:
        return {"model": "fake", "max_tokens": cap, "max_completion_tokens": cap,
                "messages": [{"role": "user", "content": text}], **kw}
    if path == RESPONSES:
        return {"model": "fake", "max_output_tokens": cap, "store": False, "input": text, **kw}
    return {"model": "fake", "max_tokens": cap, "prompt": text, **kw}


async def call(dep, path: str, req: dict) -> tuple[int, dict | bytes, float]:
    started = time.perf_counter()
    async with dep.session.post(dep.url + path, json=req) as resp:
        raw = await resp.read()
        elapsed = time.perf_counter() - started
        if resp.content_type == "application/json":
            return resp.status, json.loads(raw), elapsed
        return resp.status, raw, elapsed


def completions_of(fake) -> list[dict]:
    return [r["body"] for r in fake.received if r["path"] in API]


async def metric(dep, name: str, **labels) -> float:
    return total(parse(await dep.metrics()), name, **labels)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("context", [512, 4096])
async def test_claude_codes_32000_output_tokens_are_fitted_to_what_the_prompt_leaves(context, stream):
    """Claude Code's turn (max_tokens 32000, extended thinking with a budget just below it) on a context of
    512 or 4,096 tokens: served, P computed the prompt once, D got max_tokens = context - prompt and a thinking
    budget below it (dropped where that leaves less than vLLM's least, 1,024), and the fit is counted."""
    async with deployment(**limits(context)) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        words = 100
        req = body(MESSAGES, words, thinking={"type": "enabled", "budget_tokens": CLAUDE_CODE_MAX_TOKENS - 1},
                   stream=stream)
        status, answer, _ = await call(dep, MESSAGES, req)
        assert status == 200, answer
        prompt = words + TEMPLATE
        assert p.computed_tokens == prompt and len(completions_of(p)) == 1
        (d_body,) = completions_of(d)
        assert d_body["max_tokens"] == context - prompt
        if context - prompt - 1 >= 1024:
            assert d_body["thinking"] == {"type": "enabled", "budget_tokens": context - prompt - 1}
        else:
            assert "thinking" not in d_body
        if not stream:
            assert answer["usage"] == {"input_tokens": prompt, "output_tokens": context - prompt}
        else:
            assert b"event: message_stop" in answer
        assert await metric(dep, "pdserve_router_output_tokens_fitted_total", api="messages") == 1
        assert await metric(dep, "pdserve_router_turns_total", outcome="failed") == 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES])
async def test_every_apis_output_caps_are_fitted(path):
    """chat's max_tokens and max_completion_tokens, completions' max_tokens, responses' max_output_tokens."""
    async with deployment(**limits(256)) as dep:
        d = dep.decode[0][FAKE]
        status, answer, _ = await call(dep, path, body(path, 50))
        assert status == 200, answer
        (d_body,) = completions_of(d)
        room = 256 - dep.prefill[0][FAKE].computed_tokens
        fields = {CHAT: ("max_tokens", "max_completion_tokens"), COMPLETIONS: ("max_tokens",),
                  RESPONSES: ("max_output_tokens",)}[path]
        assert {f: d_body[f] for f in fields} == {f: room for f in fields}
        assert await metric(dep, "pdserve_router_output_tokens_fitted_total", api=API[path]) == 1


async def test_a_cap_that_fits_goes_unchanged_and_one_token_of_room_is_served():
    async with deployment(**limits(256)) as dep:
        d = dep.decode[0][FAKE]
        status, _, _ = await call(dep, MESSAGES, body(MESSAGES, 50, cap=16))
        assert status == 200 and completions_of(d)[-1]["max_tokens"] == 16
        # The prompt leaves exactly one token: P (max_tokens 1) and D (fitted to 1) both serve it.
        status, answer, _ = await call(dep, MESSAGES, body(MESSAGES, 256 - TEMPLATE - 1))
        assert status == 200, answer
        assert completions_of(d)[-1]["max_tokens"] == 1 and answer["usage"]["output_tokens"] == 1
        assert await metric(dep, "pdserve_router_output_tokens_fitted_total", api="messages") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", [MESSAGES, CHAT, RESPONSES])
async def test_a_prompt_that_fills_the_context_is_refused_by_p_before_anything_is_computed(path, stream):
    """Longer than the context, or exactly as long (no room for one output token): P's validation answers a
    400 in milliseconds, before computing; the client gets it in its API's shape; D is never called, nothing
    is retried elsewhere or served degraded, and the turn counts as failed."""
    async with deployment(**limits(256)) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        for words in (400, 256 - TEMPLATE):
            status, answer, elapsed = await call(dep, path, body(path, words, stream=stream))
            assert status == 400, answer
            print(f"{API[path]} {words} words: refused in {1000 * elapsed:.1f} ms")
            assert elapsed < 0.5
            if path == MESSAGES:
                assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
                message = answer["error"]["message"]
            else:
                assert set(answer["error"]) >= {"message", "type", "param", "code"}
                message = answer["error"]["message"]
            assert "maximum context length" in message or "max_model_len" in message \
                or "maximum model length" in message, message
        assert len(completions_of(p)) == 2 and p.computed_tokens == 0
        assert completions_of(d) == [] and d.computed_tokens == 0
        assert await metric(dep, "pdserve_router_turns_total", outcome="failed", api=API[path]) == 2
        assert await metric(dep, "pdserve_router_degraded_requests_total") == 0
        assert await metric(dep, "pdserve_router_prefill_retries_total") == 0
        assert await metric(dep, "pdserve_router_output_tokens_fitted_total") == 0


async def test_served_degraded_on_d_a_cap_the_context_cannot_hold_is_fitted_without_a_prompt_count():
    """P gone (no answer: the turn is served whole on D) leaves no count of the prompt: a cap of max_model_len
    or more cannot fit whatever the prompt is (it has a token at least), so it goes as max_model_len - 1, which
    vLLM 0.32 caps at what the prompt leaves; a cap that may fit goes unchanged."""
    async with deployment(prefill_args=(["--drop-connection", "--max-model-len", "256"],),
                          decode_args=(["--max-model-len", "256"],)) as dep:
        d = dep.decode[0][FAKE]
        status, answer, _ = await call(dep, MESSAGES, body(MESSAGES, 50))
        assert status == 200, answer
        assert completions_of(d)[-1]["max_tokens"] == 255 and answer["usage"]["output_tokens"] == 256 - 53
        status, _, _ = await call(dep, MESSAGES, body(MESSAGES, 50, cap=250))
        assert status == 200 and completions_of(d)[-1]["max_tokens"] == 250
        assert await metric(dep, "pdserve_router_degraded_requests_total", served_by="decode") == 2


async def test_a_turn_served_on_d_alone_is_fitted_to_the_routers_bound_of_its_prompt():
    """A short follow-up served on D alone (no P leg, so no usage): the cap is fitted to the short-turn rule's
    prompt count (here P's /tokenize of it), and the turn is served."""
    async with deployment(decode_only=True, **limits(1024)) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        first = {"model": "fake", "max_tokens": 8, "conversation_id": "c1",
                 "messages": [{"role": "user", "content": "alpha " * 400}]}
        async with dep.session.post(dep.url + CHAT, json=first) as resp:
            assert resp.status == 200
            reply = (await resp.json())["choices"][0]["message"]
        follow = {**first, "max_tokens": CLAUDE_CODE_MAX_TOKENS,
                  "messages": [*first["messages"], reply, {"role": "user", "content": "yes go on"}]}
        async with dep.session.post(dep.url + CHAT, json=follow) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-PDServe-Plan"] == "decode_only"
            usage = (await resp.json())["usage"]
        assert len(completions_of(p)) == 1
        fitted = completions_of(d)[-1]["max_tokens"]
        assert fitted == 1024 - usage["prompt_tokens"] and usage["completion_tokens"] == fitted
        assert await metric(dep, "pdserve_router_output_tokens_fitted_total", api="chat") == 1


async def test_a_turn_on_d_alone_unverified_is_fitted_to_the_bound_of_its_new_messages():
    """Matched by its history, a short follow-up goes to D alone without P's /tokenize: the prompt's count is
    the short-turn bound (what D holds, plus a byte a token and the template's per message), from above, so
    the cap leaves room whatever the new messages take; the turn is served."""
    async with deployment(decode_only=True, **limits(1024)) as dep:
        p, d = dep.prefill[0][FAKE], dep.decode[0][FAKE]
        history: list = []
        for content, cap in (("alpha " * 400, 8), ("yes go on", CLAUDE_CODE_MAX_TOKENS)):
            req = {"model": "fake", "messages": [*history, {"role": "user", "content": content}], "max_tokens": cap}
            async with dep.session.post(dep.url + CHAT, json=req) as resp:   # no conversation id: by history
                assert resp.status == 200, await resp.text()
                plan, answer = resp.headers["X-PDServe-Plan"], await resp.json()
            history = [*req["messages"], answer["choices"][0]["message"]]
        assert plan == "decode_only" and p.tokenized == 0 and len(completions_of(p)) == 1
        fitted, prompt = completions_of(d)[-1]["max_tokens"], answer["usage"]["prompt_tokens"]
        assert 1 <= fitted < 1024 - prompt and answer["usage"]["completion_tokens"] == fitted
        assert await metric(dep, "pdserve_router_output_tokens_fitted_total", api="chat") == 1


@pytest.mark.parametrize("path", [MESSAGES, CHAT, COMPLETIONS, RESPONSES])
async def test_router_max_output_tokens_bounds_every_reply_asked_or_not(path):
    """router.max_output_tokens: an operator's bound on every reply, whatever the client asks; set where it
    asks none (Codex sends no max_output_tokens: a random model then decodes until its context is full)."""
    async with deployment(max_output_tokens=24, **limits(4096)) as dep:
        d = dep.decode[0][FAKE]
        first = {CHAT: "max_tokens", COMPLETIONS: "max_tokens", MESSAGES: "max_tokens",
                 RESPONSES: "max_output_tokens"}[path]
        assert (await call(dep, path, body(path, 50)))[0] == 200              # asks 32,000
        asked_none = {k: v for k, v in body(path, 50).items() if k not in ("max_tokens", "max_completion_tokens",
                                                                           "max_output_tokens")}
        if path != MESSAGES:                                                     # Anthropic requires one
            assert (await call(dep, path, asked_none))[0] == 200
        assert (await call(dep, path, body(path, 50, cap=8)))[0] == 200        # a smaller ask is kept
        got = [b[first] for b in completions_of(d)]
        assert got == ([24, 8] if path == MESSAGES else [24, 24, 8]), got
    async with deployment(**limits(4096)) as dep:                              # 0, the default: no bound
        assert (await call(dep, RESPONSES, {"model": "fake", "store": False, "input": "w1 w2"}))[0] == 200
        assert "max_output_tokens" not in completions_of(dep.decode[0][FAKE])[0]
