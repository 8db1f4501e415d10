"""The fast fake vLLM backend of benchmarks/router/bench_router.py and the baseline proxy it is compared with.

The backend answers the P leg (output cap 1 with do_remote_decode) and the D leg at once, the D leg with the
handles of the blocks it keeps, as a bidirectional D does (so every turn is stored), in the shapes of each API
(--api): chat completions, Anthropic Messages, OpenAI Responses. The baseline is vLLM's reference proxy design
(FastAPI + httpx), the same two legs as the router. bench_router.py starts each in its own process
(`--serve-backend PORT`, `--serve-baseline PORT BACKEND`).
"""

import asyncio
import json

TOKENS = 128


def run(main):
    """The backend and the load generator share one core: on uvloop (as the router is) they need about a
    third less of it, so the proxy under test, not the load side, is what saturates first."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


# ---------------------------------------------------------------------------------------------------------
# The fast fake backend: answers the P leg (output cap 1 with do_remote_decode) and the D leg at once, the D
# leg with the handles of the blocks it keeps, as a bidirectional D does (so every turn is stored), in the shapes
# of each API (--api): chat completions, Anthropic Messages, OpenAI Responses.


CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
APIS = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}
CAP = {CHAT: "max_tokens", MESSAGES: "max_tokens", RESPONSES: "max_output_tokens"}   # set to 1 on the P leg
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


def request_body(api: str, stream: bool) -> dict:
    """One client request of the API: a one-message conversation, TOKENS tokens out (Codex's Responses
    shape: message items, store off)."""
    if api == "messages":
        return {"model": "m", "max_tokens": TOKENS, "messages": [{"role": "user", "content": "hello"}],
                "stream": stream}
    if api == "responses":
        return {"model": "m", "input": [{"type": "message", "role": "user", "content": "hello"}],
                "max_output_tokens": TOKENS, "store": False, "stream": stream}
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "stream": stream}


def _json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(name: str | None, obj: dict) -> bytes:
    return (f"event: {name}\n".encode() if name else b"") + b"data: " + _json(obj) + b"\n\n"


def chat_shapes(p_params: dict, d_params: dict, ids: bool = False) -> tuple[bytes, bytes, tuple[bytes, bytes, bytes]]:
    """P's answer, D's whole answer and D's stream (head, one token's event, tail) as vLLM sends them; `ids`:
    as vLLM answers `return_token_ids` (the router asks for them on every turn it will remember): the prompt's
    ids at the top, each choice's generated ids last in it (a stream: the role chunk, then one id a chunk)."""
    def answer(text: str, n: int, kv: dict) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length",
                  **({"token_ids": [7] * n} if ids else {})}
        return {"id": "d", "object": "chat.completion", "choices": [choice],
                "usage": {"prompt_tokens": 8, "completion_tokens": n}, "kv_transfer_params": kv,
                **({"prompt_token_ids": list(range(8))} if ids else {})}

    def chunk(delta: dict, token: bool = True, **top) -> bytes:
        return _sse(None, {"id": "d", "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
             **({"token_ids": [7]} if ids and token else {})}], **top})
    head = chunk({"role": "assistant", "content": ""}, False, prompt_token_ids=list(range(8))) if ids else b""
    tail = _sse(None, {"id": "d", "object": "chat.completion.chunk", "choices": [], "kv_transfer_params": d_params})
    return _json(answer("ok", 1, p_params)), _json(answer("tok " * TOKENS, TOKENS, d_params)), \
        (head, chunk({"content": "tok "}), tail + b"data: [DONE]\n\n")


def messages_shapes(p_params: dict, d_params: dict) -> tuple[bytes, bytes, tuple[bytes, bytes, bytes]]:
    """Anthropic Messages as vLLM serves them; D's handles on message_stop (pdserve's entry puts them there)."""
    def answer(text: str, n: int, kv: dict) -> dict:
        return {"id": "msg_d", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens",
                "usage": {"input_tokens": 8, "output_tokens": n}, "kv_transfer_params": kv}
    head = (_sse("message_start", {"type": "message_start", "message": {
                "id": "msg_d", "type": "message", "role": "assistant", "content": [], "model": "m",
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 8, "output_tokens": 0}}})
            + _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "text", "text": ""}}))
    token = _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": "tok "}})
    tail = (_sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            + _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                                        "stop_sequence": None},
                                     "usage": {"input_tokens": 8, "output_tokens": TOKENS}})
            + _sse("message_stop", {"type": "message_stop", "kv_transfer_params": d_params}))
    return _json(answer("ok", 1, p_params)), _json(answer("tok " * TOKENS, TOKENS, d_params)), (head, token, tail)


def responses_shapes(p_params: dict, d_params: dict) -> tuple[bytes, bytes, tuple[bytes, bytes, bytes]]:
    """OpenAI Responses as vLLM serves them: the whole response in response.created / in_progress (with a
    null kv_transfer_params) and in response.completed (with D's handles)."""
    def usage(n: int) -> dict:
        return {"input_tokens": 8, "output_tokens": n, "total_tokens": 8 + n,
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}

    def message(text: str, status: str = "completed") -> dict:
        return {"id": "msg_d", "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}]}

    def response(status: str, output: list, used: dict | None, kv: dict | None) -> dict:
        return {"id": "resp_d", "object": "response", "created_at": 0, "model": "m", "status": status,
                "output": output, "usage": used, "instructions": None, "incomplete_details": None,
                "metadata": None, "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto",
                "tools": [], "top_p": 1.0, "background": False, "max_output_tokens": TOKENS,
                "previous_response_id": None, "service_tier": "auto", "truncation": "disabled",
                "kv_transfer_params": kv}

    def ev(name: str, seq: int, **data) -> bytes:
        return _sse(name, {"type": name, "sequence_number": seq, **data})
    text = "tok " * TOKENS
    where = {"item_id": "msg_d", "output_index": 0, "content_index": 0}
    part = message(text)["content"][0]
    started = response("in_progress", [], None, None)
    head = (ev("response.created", 0, response=started) + ev("response.in_progress", 1, response=started)
            + ev("response.output_item.added", 2, output_index=0, item={**message("", "in_progress"), "content": []})
            + ev("response.content_part.added", 3, **where, part={**part, "text": ""}))
    token = ev("response.output_text.delta", 4, **where, delta="tok ", logprobs=[])
    tail = (ev("response.output_text.done", 5, **where, text=text, logprobs=[])
            + ev("response.content_part.done", 6, **where, part=part)
            + ev("response.output_item.done", 7, output_index=0, item=message(text))
            + ev("response.completed", 8, response=response("completed", [message(text)], usage(TOKENS), d_params)))
    return (_json(response("completed", [message("ok")], usage(1), p_params)),
            _json(response("completed", [message(text)], usage(TOKENS), d_params)), (head, token, tail))


BACKEND_SHAPES = {CHAT: chat_shapes, MESSAGES: messages_shapes, RESPONSES: responses_shapes}


def run_backend(port: int, reuse_port: bool = False) -> None:
    from aiohttp import web

    from pdserve.router.wire import TOKENS_KEY, WANT_TOKENS_KEY

    p_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                "remote_request_id": "r", "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1",
                "remote_port": 1}
    # What a bidirectional D returns with every answer (the blocks it keeps for the next turn): the router
    # stores them (one put a turn, in memory or Redis) and scrubs them from the client's answer.
    d_params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "d",
                "remote_request_id": "r", "remote_block_ids": [[4, 5, 6]], "remote_host": "127.0.0.1",
                "remote_port": 2, "remote_num_tokens": 8 + TOKENS}
    # Every answer of every API, made once: (P's answer, D's whole answer, D's stream as (head, token, tail)).
    answers = {path: shapes(p_params, d_params) for path, shapes in BACKEND_SHAPES.items()}
    with_ids = chat_shapes(p_params, d_params, ids=True)     # chat's D leg with return_token_ids
    # ... and with D's sequence beside its handles, as pdserve's entry adds it when the router asks (wire.py)
    sequence = {**d_params, TOKENS_KEY: list(range(8 + TOKENS))}
    with_sequence = {path: shapes(p_params, sequence) for path, shapes in BACKEND_SHAPES.items()}

    def completions(path: str):
        async def answer(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            kv = body.get("kv_transfer_params") or {}
            p_answer, d_answer, (head, token, tail) = with_ids if body.get("return_token_ids") else \
                with_sequence[path] if kv.get(WANT_TOKENS_KEY) else answers[path]
            if kv.get("do_remote_decode"):
                return web.Response(body=p_answer, content_type="application/json")
            if not body.get("stream"):
                return web.Response(body=d_answer, content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(head)
            for _ in range(TOKENS):
                await out.write(token)
            await out.write(tail)
            await out.write_eof()
            return out
        return answer

    async def traces(request: web.Request) -> web.Response:    # an OTLP/HTTP sink for --tracing
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = fake_vllm_app(64 * 1024 * 1024)   # the huge-body case of --cpu reaches it
    for path in answers:
        app.router.add_post(path, completions(path))
    app.router.add_post("/v1/traces", traces)
    serve_on_two_ports(app, port, reuse_port)


def fake_vllm_app(max_body: int):
    """An app answering as vLLM does beside its completion routes (the caller adds those): /health, /metrics
    with its KV capacity, request ids echoed."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(request: web.Request) -> web.Response:
        # As vLLM's /metrics: its KV capacity, which the router's held-KV budget reads once per decode server.
        # With none there (an empty page, before) it asks again on every stored turn: a GET a request to this
        # backend and ~4% of the router's CPU (py-spy) that no vLLM causes.
        return web.Response(text='vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="65536"} 1.0\n')

    async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
        # As vLLM with --enable-request-id-headers, which pdserve's engine entry always passes: the router's
        # client keeps a connection only when its answer names the request (legs/http1.py), so a backend
        # without the echo would have it connect afresh for every leg, and the bench measure the connects.
        if "X-Request-Id" in request.headers:
            response.headers["X-Request-Id"] = request.headers["X-Request-Id"]

    app = web.Application(client_max_size=max_body)
    app.on_response_prepare.append(echo_request_id)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def serve_on_two_ports(app, port: int, reuse_port: bool = False) -> None:
    """Serve `app` on `port` and `port + 1`, one as P and one as D (vllm-router takes one URL as one worker of
    one role), until killed; with `reuse_port`, beside other processes serving the same ports."""
    from aiohttp import web

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for p in (port, port + 1):
            await web.TCPSite(runner, "127.0.0.1", p, reuse_port=reuse_port or None).start()
        await asyncio.Event().wait()
    run(serve())


# ---------------------------------------------------------------------------------------------------------
# The baseline: vLLM's reference proxy design (FastAPI + httpx), same two legs as the router.


def run_baseline(port: int, backend: str) -> None:
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    client = httpx.AsyncClient(timeout=None, base_url=backend, limits=httpx.Limits(max_connections=None))

    async def legs(request: Request):
        path = request.url.path
        body = await request.json()
        p_body = {**body, CAP[path]: 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        p = await client.post(path, json=p_body)
        d_body = {**body, "kv_transfer_params": p.json().get("kv_transfer_params")}
        if not body.get("stream"):
            d = await client.post(path, json=d_body)
            return JSONResponse(d.json())

        async def relay():
            async with client.stream("POST", path, json=d_body) as resp:
                async for chunk in resp.aiter_bytes():
                    yield chunk
        return StreamingResponse(relay(), media_type="text/event-stream")

    for route in CAP:
        app.post(route)(legs)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
