"""Claude Code's and Codex's wire formats through the real router and the fake vLLM (issue 31): Anthropic
Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`), streamed and not.

Turn 2 of a conversation reuses D's blocks whether the client names it (its session header) or not (history
detection); no byte of D's handles or token ids reaches the client; a D that dies mid-stream ends the stream
with the format's error event; a client that leaves is counted; P failing before any byte is served on D;
errors come in the client's shape; Claude Code's extra calls (count_tokens, HEAD /) are answered; Responses get
the router's own request id on both legs; a side call under the same session id leaves the main chain's entry
alone."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from multidict import CIMultiDict

from pdserve.observe.promtext import parse, total
from pdserve.router.front.app import CONFIG
from pdserve.router.legs.turn import PLAN_HEADER, PULLED_HEADER
from pdserve.router.wire import WANT_TOKENS_KEY
from tests.kits.fake_vllm import FAKE
from tests.kits.router_rig import deployment

MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
API = {MESSAGES: "messages", RESPONSES: "responses"}
# What Claude Code and Codex send as their session id.
SESSION = {MESSAGES: "X-Claude-Code-Session-Id", RESPONSES: "session-id"}
HANDLE_BYTES = (b"kv_transfer_params", b"remote_block_ids", b"remote_engine_id", b"remote_request_id",
                b"pdserve_token_ids", b"pdserve_return_token_ids", b"fake_d_url")
SYSTEM = "You are a coding agent. " + "Keep every change small. " * 8
BOTH = pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


# -- bodies and answers as the agents send and read them -------------------------------------------
def first(path: str, text: str, **kw) -> dict:
    if path == MESSAGES:
        return {"model": "fake", "max_tokens": 6, "system": [{"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": text}], **kw}
    return {"model": "fake", "max_output_tokens": 6, "instructions": SYSTEM, "store": False,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}], **kw}


def follow_up(path: str, body: dict, reply: list, text: str) -> dict:
    """The next turn as the agent sends it: everything so far, its reply sent back, a new user message."""
    if path == MESSAGES:
        return {**body, "messages": [*body["messages"], {"role": "assistant", "content": reply},
                                     {"role": "user", "content": text}]}
    return {**body, "input": [*body["input"], *reply,
                              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]}


def events(raw: bytes) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE event."""
    out = []
    for block in raw.split(b"\n\n"):
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = json.loads(line[6:])
        if data is not None:
            out.append((name, data))
    return out


def reply_of(path: str, stream: bool, raw: bytes) -> list:
    """The reply as the agent keeps it: Anthropic content blocks, or Responses output items."""
    if not stream:
        data = json.loads(raw)
        return data["content"] if path == MESSAGES else data["output"]
    evs = events(raw)
    if path == MESSAGES:
        return [{"type": "text", "text": "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")}]
    return next(d["response"]["output"] for n, d in evs if n == "response.completed")


def input_tokens(path: str, stream: bool, raw: bytes) -> int:
    """The prompt's token count in the answer's usage."""
    if not stream:
        return json.loads(raw)["usage"]["input_tokens"]
    evs = events(raw)
    if path == MESSAGES:
        return next(d["message"]["usage"]["input_tokens"] for n, d in evs if n == "message_start")
    return next(d["response"]["usage"]["input_tokens"] for n, d in evs if n == "response.completed")


async def call(dep, path: str, body: dict, headers: dict | None = None, stream: bool = False
               ) -> tuple[int, CIMultiDict, bytes]:
    async with dep.session.post(dep.url + path, json={**body, "stream": stream}, headers=headers or {}) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.read()


async def outcomes(dep, expected: int) -> dict[tuple[str, str], float]:
    """{(outcome, api): count} once `expected` turns have ended (the router may finish after the client)."""
    got: dict[tuple[str, str], float] = {}
    for _ in range(100):
        got = {(dict(ls)["outcome"], dict(ls)["api"]): v for (n, ls), v in parse(await dep.metrics()).items()
               if n == "pdserve_router_turns_total"}
        if sum(got.values()) >= expected:
            break
        await asyncio.sleep(0.05)
    return got


def no_handles(*raws: bytes) -> None:
    for raw in raws:
        leaked = [h for h in HANDLE_BYTES if h in raw]
        assert not leaked, (leaked, raw[-400:])


# -- reuse ------------------------------------------------------------------------------------------
@BOTH
@STREAMED
@pytest.mark.parametrize("named", [True, False], ids=["session-id", "history"])
async def test_turn_two_reads_ds_blocks_and_no_handle_reaches_the_client(path, stream, named):
    headers = {SESSION[path]: "agent-1"} if named else {}
    async with deployment() as dep:
        body = first(path, "alpha " * 40)
        status, _, raw1 = await call(dep, path, body, headers, stream)
        assert status == 200
        d_sent = dep.decode[0][FAKE].received[-1]["body"]["kv_transfer_params"]
        assert d_sent[WANT_TOKENS_KEY] is True         # D is asked for its token ids, which come back with its handles
        body = follow_up(path, body, reply_of(path, stream, raw1), "beta " * 5)
        status, got, raw2 = await call(dep, path, body, headers, stream)
        assert status == 200
        no_handles(raw1, raw2)
        assert reply_of(path, stream, raw2)             # a well-formed answer of the format
        m = parse(await dep.metrics())
        api = API[path]
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit", api=api) == 1
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit") == 1
        source = "explicit" if named else "history"
        assert total(m, "pdserve_router_conversation_identity_total", source=source) == (2 if named else 1)
        pulled = dep.prefill[0][FAKE].external_tokens
        assert int(got[PULLED_HEADER]) == pulled == input_tokens(path, stream, raw1)
        # P read D's blocks for exactly turn 1's prompt: the common token prefix of D's sequence (its generated
        # ids re-tokenize differently) and turn 2's prompt, found by P's engine (no short-turn rule here: the
        # router needs no token count, so it renders nothing)
        assert dep.prefill[0][FAKE].tokenized == 0
        assert await outcomes(dep, 2) == {("stored", api): 2.0}


# -- a stream that breaks ----------------------------------------------------------------------------
@BOTH
async def test_a_d_that_dies_mid_stream_ends_it_with_the_formats_error_event(path):
    async with deployment(decode_args=(["--die-mid-stream"],)) as dep:
        status, _, raw = await call(dep, path, first(path, "gamma " * 40), {SESSION[path]: "dies"}, True)
        assert status == 200
        evs = events(raw)
        names = [n for n, _ in evs]
        if path == MESSAGES:
            assert names[-1] == "error" and "message_stop" not in names
            assert evs[-1][1]["type"] == "error" and evs[-1][1]["error"]["type"] == "api_error"
            assert names.count("content_block_delta") == 2           # what D sent before it died
        else:
            assert names[-1] == "response.failed" and "response.completed" not in names
            assert evs[-1][1]["response"]["status"] == "failed" and evs[-1][1]["response"]["error"]["message"]
            assert names.count("response.output_text.delta") == 2
        assert b"[DONE]" not in raw                                # neither format has one
        no_handles(raw)
        assert await outcomes(dep, 1) == {("failed", API[path]): 1.0}


@BOTH
async def test_a_client_that_leaves_mid_stream_is_counted_client_gone(path):
    async with deployment(decode_args=(["--token-delay", "0.2"],)) as dep:
        resp = await dep.session.post(dep.url + path, json={**first(path, "eps " * 40), "stream": True})
        assert resp.status == 200
        deltas = 0
        async for line in resp.content:
            deltas += line.startswith(b"data: ") and json.loads(line[6:])["type"].endswith("delta")
            if deltas == 2:
                break
        resp.close()                          # drops the connection, as a client that hangs up does
        assert await outcomes(dep, 1) == {("client_gone", API[path]): 1.0}
        for _ in range(40):
            if dep.decode[0][FAKE].cancelled:
                break
            await asyncio.sleep(0.05)
        assert dep.decode[0][FAKE].cancelled == 1                   # D stopped generating for nobody
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_client_cancelled_total") == 1
        assert total(m, "pdserve_router_backend_requests_total", outcome="error") == 0   # not D's fault


@BOTH
@STREAMED
async def test_p_failing_before_any_byte_is_served_whole_on_d(path, stream):
    async with deployment(prefill_args=(["--status", "500"],)) as dep:
        body = first(path, "zeta " * 40, request_id="client-chosen") if path == RESPONSES else first(path, "zeta " * 40)
        status, headers, raw = await call(dep, path, body, {SESSION[path]: "p-down"}, stream)
        assert status == 200 and headers[PLAN_HEADER] == "degraded"
        reply = reply_of(path, stream, raw)
        text = reply[0]["text"] if path == MESSAGES else reply[0]["content"][0]["text"]
        assert text.split() == [f"w{i}" for i in range(6)]
        no_handles(raw)
        sent = dep.decode[0][FAKE].received[-1]["body"]
        assert "kv_transfer_params" not in sent                     # a plain request: no transfer
        if path == RESPONSES:
            assert sent["request_id"].startswith("resp_") and sent["store"] is False
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_degraded_requests_total", served_by="decode") == 1
        assert await outcomes(dep, 1) == {("degraded", API[path]): 1.0}


# -- Anthropic's shapes, auth, admission, Claude Code's extra calls ------------------------------------
def anthropic_error(data: dict, kind: str) -> None:
    assert data["type"] == "error" and data["error"]["type"] == kind and data["error"]["message"], data
    assert set(data) == {"type", "error"}


async def test_messages_errors_come_in_anthropics_shape():
    async with deployment() as dep:
        status, data = await dep.post(MESSAGES, {"model": "fake", "max_tokens": 4, "messages": "hi"})
        assert status == 400
        anthropic_error(data, "invalid_request_error")
        async with dep.session.post(dep.url + MESSAGES, data=b"{not json",
                                    headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            anthropic_error(await resp.json(), "invalid_request_error")
        status, data = await dep.post(MESSAGES + "/batches", first(MESSAGES, "hi"))
        assert status == 404
        anthropic_error(data, "not_found_error")
        # D refusing the request: its (vLLM's Anthropic-shaped) error reaches the client in that shape
        dep.decode[0][FAKE].args.status = 400
        status, data = await dep.post(MESSAGES, first(MESSAGES, "hi " * 20))
        assert status == 400
        anthropic_error(data, "BadRequestError")
        assert await outcomes(dep, 3) == {("failed", "messages"): 3.0}
        assert not dep.prefill[0][FAKE].received[:-1]            # the bad bodies never reached a server


async def test_an_api_key_in_x_api_key_is_accepted_and_is_the_same_tenant_as_bearer():
    async with deployment(api_key="sekrit") as dep:
        body = first(MESSAGES, "eta " * 40)
        status, data = await dep.post(MESSAGES, body)
        assert status == 401
        anthropic_error(data, "authentication_error")
        status, data = await dep.post(MESSAGES, body, {"x-api-key": "wrong"})
        assert status == 401
        anthropic_error(data, "authentication_error")
        status, data = await dep.post(RESPONSES, first(RESPONSES, "hi"))
        assert status == 401 and data["error"]["message"]                # OpenAI's shape on /v1/responses
        session = {SESSION[MESSAGES]: "keyed"}
        status, _, raw = await call(dep, MESSAGES + "?beta=true", body, {"x-api-key": "sekrit", **session})
        assert status == 200
        for app in (dep.prefill[0], dep.decode[0]):
            sent = app[FAKE].received[-1]["headers"]
            assert sent["authorization"] == "Bearer sekrit" and "x-api-key" not in sent   # the router's own key
        # The same key as a bearer token is the same tenant: the conversation's entry is its own.
        body = follow_up(MESSAGES, body, reply_of(MESSAGES, False, raw), "theta")
        status, _, _ = await call(dep, MESSAGES, body, {"Authorization": "Bearer sekrit", **session})
        assert status == 200
        m = parse(await dep.metrics_with({"x-api-key": "sekrit"}))
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit", api="messages") == 1


async def test_admission_refuses_in_anthropics_shape():
    async with deployment(tenant_rate=0.01, tenant_burst=1) as dep:
        assert (await dep.post(MESSAGES, first(MESSAGES, "iota " * 20)))[0] == 200
        async with dep.session.post(dep.url + MESSAGES, json=first(MESSAGES, "iota " * 20)) as resp:
            assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
            anthropic_error(await resp.json(), "rate_limit_error")
        assert (await outcomes(dep, 2))[("failed", "messages")] == 1


async def test_count_tokens_is_forwarded_and_the_root_answers():
    async with deployment() as dep:
        body = {**first(MESSAGES, "kappa " * 30), "kv_transfer_params": {"do_remote_decode": True},
                "conversation_id": "c"}
        del body["max_tokens"]
        status, data = await dep.post(MESSAGES + "/count_tokens", body)
        assert status == 200
        sent = dep.prefill[0][FAKE].received[-1]
        assert sent["path"] == MESSAGES + "/count_tokens"
        assert "kv_transfer_params" not in sent["body"] and "conversation_id" not in sent["body"]
        # the count is the server's: what P's render of the same prompt gives
        async with dep.session.post(dep.router[CONFIG].prefill[0].url + MESSAGES + "/render", json=body) as resp:
            assert data["input_tokens"] == len((await resp.json())["token_ids"]) > 30
        assert not dep.decode[0][FAKE].received                   # not a turn: D never saw it
        assert await outcomes(dep, 0) == {}
        for method in ("HEAD", "GET"):
            async with dep.session.request(method, dep.url + "/") as resp:
                assert resp.status == 200


# -- Responses: nothing stored, the router's own ids ------------------------------------------------------
async def test_previous_response_id_is_refused_before_any_server():
    async with deployment() as dep:
        status, data = await dep.post(RESPONSES, first(RESPONSES, "lambda", previous_response_id="resp_0"))
        assert status == 400 and data["error"]["param"] == "previous_response_id" and "input" in data["error"]["message"]
        assert not dep.prefill[0][FAKE].received and not dep.decode[0][FAKE].received
        assert await outcomes(dep, 1) == {("failed", "responses"): 1.0}


@STREAMED
async def test_responses_legs_carry_the_routers_request_id_not_the_clients(stream):
    async with deployment() as dep:
        body = first(RESPONSES, "mu " * 30, request_id="client-chosen", store=True)
        status, headers, raw = await call(dep, RESPONSES, body, {"X-Request-Id": "client-req-1"}, stream)
        assert status == 200 and headers["X-Request-Id"] == "client-req-1"     # echoed to the client only
        p = dep.prefill[0][FAKE].received[-1]
        d = dep.decode[0][FAKE].received[-1]
        rid = d["body"]["request_id"]
        assert rid.startswith("resp_") and "client" not in rid
        assert p["body"]["request_id"] == rid + "-p"                 # two engine requests, two ids, one turn
        assert p["headers"]["x-request-id"] == d["headers"]["x-request-id"] == "pdserve-" + rid.removeprefix("resp_")
        assert p["body"]["max_output_tokens"] == 1 and p["body"]["stream"] is False and "max_tokens" not in p["body"]
        assert d["body"]["max_output_tokens"] == 6 and d["body"]["stream"] is stream
        assert p["body"]["store"] is False and d["body"]["store"] is False
        answer = json.loads(raw) if not stream else next(e["response"] for n, e in events(raw)
                                                         if n == "response.completed")
        assert answer["id"] == rid                                    # the response id is the router's


# -- Claude Code's side calls ---------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["fake-haiku", "fake"], ids=["small-model", "same-model"])
async def test_a_side_call_under_the_same_session_leaves_the_main_chains_entry(model):
    """Claude Code titles and summarises (on a small model, or the main one with another system prompt) under
    the same X-Claude-Code-Session-Id: that call must not take (and so waste) the entry the main conversation's
    next turn reads."""
    session = {SESSION[MESSAGES]: "cc-main"}
    async with deployment() as dep:
        main = first(MESSAGES, "nu " * 40)
        status, _, raw = await call(dep, MESSAGES, main, session)
        assert status == 200
        side = {"model": model, "max_tokens": 6, "system": "Write a 5-word title for the conversation.",
                "messages": [{"role": "user", "content": "nu " * 40}]}
        for stream in (False, True):
            assert (await call(dep, MESSAGES, side, session, stream))[0] == 200
        main = follow_up(MESSAGES, main, reply_of(MESSAGES, False, raw), "xi " * 4)
        status, headers, _ = await call(dep, MESSAGES, main, session, True)
        assert status == 200 and int(headers[PULLED_HEADER]) > 0
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit", api="messages") == 2
        # the side chain's second call read the first one's blocks; the main chain's turn 2 its own
        # the main chain's turn 1 and the side chain's first call are first turns (no earlier model output),
        # not misses
        assert total(m, "pdserve_router_reuse_decisions_total", result="first", reason="no_entry") == 2
        assert total(m, "pdserve_router_reuse_decisions_total", result="miss") == 0


# -- the agents' own SDKs ---------------------------------------------------------------------------------
async def test_the_anthropic_sdk_reads_both_shapes_and_its_second_turn_reuses():
    async with deployment() as dep:
        client = anthropic.AsyncAnthropic(base_url=dep.url, api_key="k", max_retries=0,
                                          default_headers={SESSION[MESSAGES]: "sdk"})
        messages = [{"role": "user", "content": "omicron " * 40}]
        first_reply = await client.messages.create(model="fake", max_tokens=6, system=SYSTEM, messages=messages)
        assert first_reply.content[0].text.split()[0] == "w0" and first_reply.usage.input_tokens > 40
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first_reply.content]},
                     {"role": "user", "content": "pi"}]
        async with client.messages.stream(model="fake", max_tokens=6, system=SYSTEM, messages=messages) as stream:
            seen = "".join([event.model_dump_json() async for event in stream])
            final = await stream.get_final_message()
        assert final.content[0].text.split() == [f"w{i}" for i in range(6)] and final.stop_reason == "max_tokens"
        assert not any(h.decode() in seen for h in HANDLE_BYTES)
        count = await client.messages.count_tokens(model="fake", system=SYSTEM, messages=messages)
        assert count.input_tokens == final.usage.input_tokens
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit", api="messages") == 1


async def test_the_openai_sdks_responses_read_both_shapes_and_reuse_without_an_id():
    async with deployment() as dep:
        client = openai.AsyncOpenAI(base_url=dep.url + "/v1", api_key="k", max_retries=0)
        items: list = [{"role": "user", "content": "rho " * 40}]
        resp = await client.responses.create(model="fake", instructions=SYSTEM, input=items, store=False,
                                             max_output_tokens=6)
        assert resp.output_text.split()[0] == "w0"
        items += [item.model_dump(exclude_none=True) for item in resp.output] + [{"role": "user", "content": "sigma"}]
        stream = await client.responses.create(model="fake", instructions=SYSTEM, input=items, store=False,
                                               max_output_tokens=6, stream=True)
        kinds, done = [], None
        async for event in stream:
            kinds.append(event.type)
            assert not any(h.decode() in event.model_dump_json() for h in HANDLE_BYTES)
            if event.type == "response.completed":
                done = event.response
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert done is not None and done.output_text.split() == [f"w{i}" for i in range(6)]
        m = parse(await dep.metrics())
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit", api="responses") == 1



async def test_d_dying_mid_stream_on_responses_is_a_response_failed_the_openai_sdk_reads():
    """Issue 45: the router ended a Responses stream D broke with a response.failed event without the
    response's id, so the openai SDK's stream helper raised "Lifecycle response identity changed" instead of
    handing the client the failure. It now carries the id of the response the stream began."""
    async with deployment(decode_args=(["--die-mid-stream"],)) as dep:
        client = openai.AsyncOpenAI(base_url=dep.url + "/v1", api_key="k", max_retries=0)
        items = [{"role": "user", "content": "tau " * 40}]
        async with client.responses.stream(model="fake", input=items, store=False, max_output_tokens=6) as stream:
            events = [event async for event in stream]
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.failed", kinds
        failed = events[-1].response
        assert failed.id == events[0].response.id and failed.status == "failed"
        assert "failed mid-stream" in failed.error.message and failed.model == "fake"


# -- a client that rewrites the reply -------------------------------------------------------------------
CHAT = "/v1/chat/completions"


def rewritten_follow_up(path: str, body: dict, reply_text: str | None, text: str) -> dict:
    """The next turn with the reply replaced by `reply_text` (None: left out, as a Responses client appends
    nothing for an answer without output items)."""
    if path == CHAT:
        reply = [] if reply_text is None else [{"role": "assistant", "content": reply_text}]
        return {**body, "messages": [*body["messages"], *reply, {"role": "user", "content": text}]}
    if reply_text is None:
        return follow_up(path, body, [], text) if path == RESPONSES else None
    blocks = ([{"type": "text", "text": reply_text}] if path == MESSAGES else
              [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": reply_text}]}])
    return follow_up(path, body, blocks, text)


@pytest.mark.parametrize("path, reply_text", [(CHAT, "w0  w1 w2 (edited)"), (MESSAGES, "w0 w1, edited"),
                                              (RESPONSES, "edited"), (CHAT, None), (RESPONSES, None)],
                         ids=["chat", "messages", "responses", "chat-dropped", "responses-no-output"])
async def test_a_rewritten_or_missing_reply_still_reuses_the_previous_prompt(path, reply_text):
    """No session id, and the client does not send the router's reply back byte for byte (agents reformat it,
    drop a part, or have none to send): the turn is still found, by its prompt, and P reads exactly the previous
    prompt's tokens (the token check cuts the offer where the rewritten reply begins)."""
    async with deployment() as dep:
        body = ({"model": "fake", "max_tokens": 6, "messages": [{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": "alpha " * 40}]}
                if path == CHAT else first(path, "alpha " * 40))
        status, _, raw1 = await call(dep, path, body)
        assert status == 200
        prompt1 = json.loads(raw1)["usage"]["prompt_tokens"] if path == CHAT else input_tokens(path, False, raw1)
        status, got, raw2 = await call(dep, path, rewritten_follow_up(path, body, reply_text, "beta " * 5))
        assert status == 200
        no_handles(raw1, raw2)
        m = parse(await dep.metrics())
        api = API.get(path, "chat")
        assert total(m, "pdserve_router_reuse_decisions_total", result="hit", reason="trimmed", api=api) == 1
        pulled = int(got[PULLED_HEADER])
        assert pulled == dep.prefill[0][FAKE].external_tokens
        if reply_text is None:   # no reply: the previous prompt but its closing generation prompt
            assert 0 < prompt1 - pulled <= 4, (prompt1, pulled)
        else:
            assert pulled == prompt1
        assert await outcomes(dep, 2) == {("stored", api): 2.0}


async def test_a_wrong_key_says_do_not_retry_so_agents_stop_at_once():
    """Claude Code retried the router's 401 for ~187 s (11 requests) before saying "Not logged in"; with
    `x-should-retry: false`, which the Anthropic and OpenAI SDKs honour, it stops after one request."""
    async with deployment(api_key="sekrit") as dep:
        for path, headers in ((MESSAGES, {"x-api-key": "wrong"}), (RESPONSES, {}),
                              ("/v1/chat/completions", {"Authorization": "Bearer wrong"})):
            async with dep.session.post(dep.url + path, json=first(MESSAGES, "hi"), headers=headers) as resp:
                assert resp.status == 401 and resp.headers.get("x-should-retry") == "false", path
        async with dep.session.post(dep.url + MESSAGES, json=first(MESSAGES, "hi"),
                                    headers={"x-api-key": "sekrit"}) as resp:
            assert resp.status == 200 and "x-should-retry" not in resp.headers
