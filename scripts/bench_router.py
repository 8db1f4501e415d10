#!/usr/bin/env python3
"""The router's own cost, measured against a fast fake vLLM backend on this machine.

Three ways to serve the same P -> D two-leg flow, each measured for non-streaming and streaming (128
tokens) requests at 1 and 64 concurrent clients:

- direct:   the load generator does both legs itself against the backend (no proxy at all);
- pdserve:  the real router process (`python -m pdserve.router`);
- baseline: vLLM's reference proxy design (FastAPI + httpx, as in vLLM's disaggregated-serving example
            proxies), written below with the same two legs;
- pdserve-admission: pdserve with every admission check on and none binding;
- pdserve-redis: pdserve with its reuse store in Redis (Debian's redis-server, on the load side's core);
- vllm-router: vLLM's Rust router (PyPI `vllm-router`, the bench extra) in its P-D mode, started with the
            same arguments as `pdserve bench`'s vllm-router arm (pdserve/bench/vrouter.py).

Added latency = proxy p50/p99 minus direct p50/p99 at 1 client. Throughput = requests per second at 64
clients. The proxy under test runs alone on core 0; the backend and the load generator share core 1, and
the proxy's CPU use is printed so a run where the proxy was not the bottleneck is visible.

Usage: .venv/bin/python scripts/bench_router.py [--duration 5] [--out bench-router.json]
       [--arms pdserve vllm-router] [--runs N] [--clients 1 64] [--no-stream] [--api chat messages responses]

`--runs N` repeats the measurement N times, the arms interleaved in each run (a noisy neighbour hits both
alike), and prints every run's figures, not only a mean.

`--api chat messages responses` sends the same two-leg turn as OpenAI chat completions, Anthropic Messages
(`/v1/messages`) or OpenAI Responses (`/v1/responses`, message items, store off), each API's cells interleaved
with the others'; the backend answers each in vLLM's shapes (Messages' handles on message_stop, Responses'
in response.completed after a response.created with a null kv_transfer_params), every arm sends the API's own
legs (P's output cap: `max_tokens`, or `max_output_tokens` for Responses). With `--cpu`, per API too, and
`--reps N` measures each API N times, alternated on one router process, and prints the medians.

`--cpu REV [REV ...]` compares router revisions instead (`.` is the working tree): each one's `pdserve`
package is exported to a temporary folder and run on core 0 against the same backend; printed side by side:
the router's CPU seconds (user + system) for N JSON requests and N streams (16 clients), and the longest
`/health` answer while one 13 MB body of 380k small messages is served (how long a huge body stalls the
event loop for every other client). With `--tracing`, each revision runs twice: tracing off, and on
(`otlp_endpoint` set, every request sampled, spans exported over OTLP/HTTP to a sink beside the backend):
the router's CPU then includes its exporter thread.
"""


import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

TOKENS = 128
PROXY_CORE, LOAD_CORE = {0}, {1}

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


def run_backend(port: int) -> None:
    from aiohttp import web

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

    def completions(path: str):
        async def answer(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            kv = body.get("kv_transfer_params") or {}
            p_answer, d_answer, (head, token, tail) = with_ids if body.get("return_token_ids") else answers[path]
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

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def traces(request: web.Request) -> web.Response:    # an OTLP/HTTP sink for --tracing
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)   # the huge-body case of --cpu reaches it
    for path in answers:
        app.router.add_post(path, completions(path))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", lambda r: health(r))
    app.router.add_post("/v1/traces", traces)

    async def serve() -> None:
        # Two ports, one as P and one as D: vllm-router takes one URL as one worker of one role.
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for p in (port, port + 1):
            await web.TCPSite(runner, "127.0.0.1", p).start()
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


# ---------------------------------------------------------------------------------------------------------
# Load generation


def run(main):
    """The backend and the load generator share one core: on uvloop (as the router is) they need about a
    third less of it, so the proxy under test, not the load side, is what saturates first."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A free port whose next port is free too (the backend's P and D ports)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def spawn(argv: list[str], cores: set[int], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, cores))


async def wait_up(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status < 500:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def one_request(session: aiohttp.ClientSession, target: str, stream: bool, direct: bool,
                      api: str = "chat") -> None:
    body = request_body(api, stream)
    url = target + APIS[api]
    if direct:   # the client does the two legs itself
        p_body = {**body, CAP[APIS[api]]: 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        async with session.post(url, json=p_body) as r:
            body["kv_transfer_params"] = (await r.json())["kv_transfer_params"]
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        if stream:
            # Read as it arrives, not line by line: Messages and Responses events are three lines each (chat's
            # two), and parsing lines here made the load generator, not the proxy, the limit of streamed cells.
            async for _ in r.content.iter_any():
                pass
        else:
            await r.read()


def snapshot(proc: psutil.Process | None) -> dict[str, float]:
    """CPU seconds and involuntary context switches (another process took the core) of the proxy and of
    this load generator (the backend shares its core)."""
    out = {}
    for core, t in enumerate(psutil.cpu_times(percpu=True)):     # the whole machine, neighbours included
        out[f"core{core}_busy_s"] = sum(t) - t.idle - getattr(t, "iowait", 0.0)
    for who, p in (("proxy", proc), ("load", psutil.Process())):
        if p is not None:
            t = p.cpu_times()
            out[who + "_cpu_s"] = t.user + t.system
            out[who + "_preempted"] = preemptions(p.pid)
    return out


def preemptions(pid: int) -> int:
    """Involuntary context switches of all the process's threads (psutil counts the main thread only)."""
    n = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            n += int(next(line for line in (task / "status").read_text().splitlines()
                          if line.startswith("nonvoluntary_ctxt_switches")).split()[1])
        except (OSError, StopIteration):
            pass
    return n


async def load(target: str, clients: int, stream: bool, direct: bool, duration: float,
               proc: psutil.Process | None = None, api: str = "chat") -> tuple[list[float], dict[str, float]]:
    """Latencies of the measured phase, and what the proxy and the load generator used during it."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker(deadline: float, record: bool) -> None:
            while time.monotonic() < deadline:
                t = time.perf_counter()
                await one_request(session, target, stream, direct, api)
                if record:
                    latencies.append(time.perf_counter() - t)
        await asyncio.gather(*(worker(time.monotonic() + 0.5, False) for _ in range(clients)))   # warm up
        before = snapshot(proc)
        await asyncio.gather(*(worker(time.monotonic() + duration, True) for _ in range(clients)))
        after = snapshot(proc)
    return latencies, {k: after[k] - before[k] for k in before}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def measure(name: str, target: str, proc: psutil.Process | None, stream: bool, clients: int, args,
                  api: str = "chat") -> dict:
    lat, used = await load(target, clients, stream, name == "direct", args.duration, proc, api)
    n = len(lat)
    r = {"proxy": name, "api": api, "stream": stream, "clients": clients, "requests": n,
         "rps": n / args.duration, "p50_ms": 1000 * pct(lat, 50), "p99_ms": 1000 * pct(lat, 99),
         "proxy_cpu_percent": 100 * used["proxy_cpu_s"] / args.duration if proc else None,
         "proxy_cpu_us_per_request": 1e6 * used["proxy_cpu_s"] / n if proc else None,
         "proxy_preempted_per_s": used["proxy_preempted"] / args.duration if proc else None,
         "load_cpu_percent": 100 * used["load_cpu_s"] / args.duration,
         "cores_busy_percent": [round(100 * v / args.duration) for k, v in sorted(used.items()) if k.startswith("core")]}
    print(f"  {name:11s} {api:9s} stream={str(stream):5s} clients={clients:2d}: {r['rps']:7.0f} req/s  "
          f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  load cpu {r['load_cpu_percent']:.0f}%"
          + (f"  proxy cpu {r['proxy_cpu_percent']:.0f}%, {r['proxy_cpu_us_per_request']:.0f} us/req, "
             f"preempted {r['proxy_preempted_per_s']:.0f}/s" if proc else ""), file=sys.stderr)
    return r


ARMS = ("direct", "pdserve", "pdserve-admission", "pdserve-redis", "baseline", "vllm-router")
# Every admission check on (per-tenant rate and in-flight cap, global cap with a queue), none binding:
# what admission costs a request that it lets through.
ADMISSION_ON = {"tenant_rate": 1e9, "tenant_max_in_flight": 100_000, "max_in_flight": 100_000, "queue_size": 100}


def start_arm(name: str, backend_url: str, decode_url: str, router_cfg: dict, helpers: list[subprocess.Popen]
              ) -> tuple[str, subprocess.Popen | None, str | None]:
    """(url, process, its config file) of one arm, started on the proxy core; what the arm needs beside it
    (the pdserve-redis arm's redis-server) is appended to `helpers`, stopped with the arms."""
    if name == "direct":
        return backend_url, None, None
    port = free_port()
    if name.startswith("pdserve"):
        extra = ADMISSION_ON if name == "pdserve-admission" else {}
        if name == "pdserve-redis":
            redis_port = free_port()
            # Debian's redis-server, no persistence, on the load side's core (the router keeps core 0 alone)
            helpers.append(spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"], LOAD_CORE))
            extra = {"store": f"redis://127.0.0.1:{redis_port}/0"}
        cfg_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"prefill": [{"name": "prefill-0", "url": backend_url}],
                   "decode": [{"name": "decode-0", "url": decode_url}], "model": "m", "port": port,
                   **router_cfg, **extra}, cfg_file)
        cfg_file.close()
        return (f"http://127.0.0.1:{port}",
                spawn([sys.executable, "-m", "pdserve.router", "--config", cfg_file.name], PROXY_CORE), cfg_file.name)
    if name == "baseline":
        me = [sys.executable, str(Path(__file__).resolve())]
        return f"http://127.0.0.1:{port}", spawn([*me, "--serve-baseline", str(port), backend_url], PROXY_CORE), None
    from pdserve.bench import vrouter
    exe = vrouter.executable()
    if exe is None:
        raise SystemExit("error: arm vllm-router: the vllm-router package is not installed (pip install vllm-router)")
    return (f"http://127.0.0.1:{port}", spawn(vrouter.argv(exe, port, [backend_url], [decode_url], free_port()), PROXY_CORE,
                                               {"NO_COLOR": "1"}), None)


async def main_async(args) -> dict:
    os.sched_setaffinity(0, LOAD_CORE)
    me = [sys.executable, str(Path(__file__).resolve())]
    backend_port = free_port_pair()
    backend_url, decode_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{backend_port + 1}"
    procs = [spawn([*me, "--serve-backend", str(backend_port)], LOAD_CORE)]
    arms: list[tuple[str, str, subprocess.Popen | None]] = []
    files: list[str] = []
    try:
        for name in args.arms:
            url, proc, cfg = start_arm(name, backend_url, decode_url, json.loads(args.router_config), procs)
            arms.append((name, url, proc))
            procs += [proc] if proc else []
            files += [cfg] if cfg else []
        for url in (backend_url, *(url for _, url, _ in arms)):
            await wait_up(url)
        await asyncio.sleep(2.5)   # the router's first health probe marks the backend healthy
        rows = []
        # Arms interleaved cell by cell: a neighbour's load on this shared box hits them alike.
        for run in range(args.runs):
            for stream in (False, True) if args.stream else (False,):
                for clients in args.clients:
                    for api in args.api:
                        for name, url, proc in arms:
                            row = await measure(name, url, psutil.Process(proc.pid) if proc else None, stream,
                                                clients, args, api)
                            rows.append({**row, "run": run})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        for f in files:
            os.unlink(f)
    return summarize(rows) if {"direct", "pdserve", "baseline"} <= set(args.arms) and args.runs == 1 \
        and args.clients == [1, 64] and args.stream and args.api == ["chat"] else {"rows": rows}


def summarize(rows: list[dict]) -> dict:
    def get(proxy, stream, clients):
        return next(r for r in rows if r["proxy"] == proxy and r["stream"] == stream and r["clients"] == clients)
    summary = []
    for stream in (False, True):
        direct, ours, base = (get(p, stream, 1) for p in ("direct", "pdserve", "baseline"))
        ours64, base64 = get("pdserve", stream, 64), get("baseline", stream, 64)
        summary.append({"stream": stream,
                        "pdserve_added_p50_ms": ours["p50_ms"] - direct["p50_ms"],
                        "pdserve_added_p99_ms": ours["p99_ms"] - direct["p99_ms"],
                        "baseline_added_p50_ms": base["p50_ms"] - direct["p50_ms"],
                        "baseline_added_p99_ms": base["p99_ms"] - direct["p99_ms"],
                        "pdserve_rps_64": ours64["rps"], "baseline_rps_64": base64["rps"],
                        "rps_ratio_64": ours64["rps"] / base64["rps"]})
    return {"rows": rows, "summary": summary}


# ---------------------------------------------------------------------------------------------------------
# CPU per request, revision against revision


def export_revision(rev: str, into: Path) -> Path:
    """The pdserve package of `rev` (`.`: the working tree) under `into`, for PYTHONPATH."""
    repo = Path(__file__).resolve().parents[1]
    if rev == ".":
        subprocess.run(["cp", "-r", str(repo / "pdserve"), str(into)], check=True)
    else:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "pdserve"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def requests_cpu(proc: psutil.Process, url: str, n: int, stream: bool, api: str = "chat") -> float:
    """Router CPU seconds for n requests from 16 clients."""
    left = n
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(50):
            await one_request(session, url, stream, False, api)      # warm up
        before = cpu_seconds(proc)

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one_request(session, url, stream, False, api)
        await asyncio.gather(*(worker() for _ in range(16)))
        return cpu_seconds(proc) - before


async def huge_body_stall(url: str) -> tuple[float, float, int]:
    """(longest /health answer in s while a 13 MB body of 380k messages is served, its own seconds, status)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 380_000,
                       "max_tokens": 4}).encode()
    worst, done = 0.0, False
    async with aiohttp.ClientSession() as session:
        async def probe() -> None:
            nonlocal worst
            while not done:
                t = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                worst = max(worst, time.perf_counter() - t)
                await asyncio.sleep(0.01)
        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.2)
        t = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            await r.read()
            status = r.status
        took = time.perf_counter() - t
        await asyncio.sleep(0.2)
        done = True
        await prober
    return worst, took, status


async def compare_cpu(revs: list[str], n: int, tracing: bool = False, apis: tuple[str, ...] = ("chat",),
                      reps: int = 1) -> list[dict]:
    os.sched_setaffinity(0, LOAD_CORE)
    backend_port = free_port_pair()     # the backend listens on this port and the next
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = spawn([sys.executable, str(Path(__file__).resolve()), "--serve-backend", str(backend_port)], LOAD_CORE)
    rows = []
    try:
        await wait_up(backend_url)
        for rev, traced in [(r, t) for r in revs for t in ((False, True) if tracing else (False,))]:
            with tempfile.TemporaryDirectory() as tmp:
                export_revision(rev, Path(tmp))
                port = free_port()
                cfg = Path(tmp) / "router.json"
                cfg.write_text(json.dumps({"prefill": [{"name": "prefill-0", "url": backend_url}],
                                           "decode": [{"name": "decode-0", "url": backend_url}],
                                           "model": "m", "port": port,
                                           **({"otlp_endpoint": backend_url + "/v1/traces"} if traced else {})}))
                router = subprocess.Popen([sys.executable, "-m", "pdserve.router", "--config", str(cfg)], cwd=tmp,
                                          env={**os.environ, "PYTHONPATH": tmp}, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL,
                                          preexec_fn=lambda: os.sched_setaffinity(0, PROXY_CORE))
                try:
                    url = f"http://127.0.0.1:{port}"
                    await wait_up(url)
                    await asyncio.sleep(2.5)   # the first health probe marks the backend healthy
                    proc = psutil.Process(router.pid)
                    # the APIs alternated, `reps` times, on one router process: a neighbour's load hits them alike
                    runs: dict[str, list[tuple[float, float]]] = {api: [] for api in apis}
                    for _ in range(reps):
                        for api in apis:
                            runs[api].append((await requests_cpu(proc, url, n, False, api),
                                              await requests_cpu(proc, url, n, True, api)))
                    stall, took, status = await huge_body_stall(url)
                finally:
                    router.terminate()
                    router.wait(10)
            rev_label = f"{rev}+trace" if traced else rev
            for api, got in runs.items():
                json_cpu, stream_cpu = (statistics.median(kind) for kind in zip(*got))
                rows.append({"rev": rev_label, "api": api, "json_cpu_s": json_cpu, "stream_cpu_s": stream_cpu,
                             "json_runs_s": [j for j, _ in got], "stream_runs_s": [t for _, t in got],
                             "health_stall_s": stall, "huge_body_s": took, "huge_body_status": status})
                print(f"  {rev_label} {api}: {n} json {json_cpu:.2f} CPU-s, {n} streams {stream_cpu:.2f} CPU-s "
                      f"(median of {reps}: {' '.join(f'{j:.2f}/{t:.2f}' for j, t in got)}), "
                      f"/health stalled up to {stall:.2f} s by a 13 MB body (HTTP {status}, {took:.2f} s)",
                      file=sys.stderr)
    finally:
        backend.terminate()
        backend.wait(10)
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-backend":
        return run_backend(int(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[1] == "--serve-baseline":
        return run_baseline(int(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=5.0, help="seconds measured per scenario")
    ap.add_argument("--out", default="bench-router.json", help="where to write the full results")
    ap.add_argument("--cpu", nargs="+", metavar="REV", help="compare the router's CPU per request of revisions")
    ap.add_argument("-n", type=int, default=1000, help="requests per kind with --cpu")
    ap.add_argument("--reps", type=int, default=1, help="with --cpu: measure each API this many times, alternated "
                    "(medians printed)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=["direct", "pdserve", "baseline"],
                    help="what to measure (vllm-router needs the vllm-router package)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the measurement, arms interleaved")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 64], help="concurrent clients per cell")
    ap.add_argument("--no-stream", dest="stream", action="store_false", help="non-streamed requests only")
    ap.add_argument("--router-config", default="{}", help="extra pdserve router settings, as JSON")
    ap.add_argument("--tracing", action="store_true", help="with --cpu: each revision with tracing off and on")
    ap.add_argument("--api", nargs="+", choices=tuple(APIS), default=["chat"],
                    help="wire formats to send (chat completions, Anthropic Messages, OpenAI Responses), interleaved")
    args = ap.parse_args()
    if args.cpu:
        rows = run(compare_cpu(args.cpu, args.n, args.tracing, tuple(args.api), args.reps))
        print(f"{'revision':12s} {'api':9s} {f'{args.n} json CPU-s':>16s} {f'{args.n} streams CPU-s':>19s} "
              f"{'/health stall s':>16s} {'13 MB body s':>13s}")
        for r in rows:
            print(f"{r['rev']:12s} {r['api']:9s} {r['json_cpu_s']:16.2f} {r['stream_cpu_s']:19.2f} "
                  f"{r['health_stall_s']:16.2f} {r['huge_body_s']:13.2f}")
        return
    result = run(main_async(args))
    Path(args.out).write_text(json.dumps(result, indent=1))
    if "summary" not in result:
        print(f"{'run':>3s} {'arm':12s} {'api':9s} {'stream':6s} {'clients':>7s} {'req/s':>7s} {'p50 ms':>7s} {'p99 ms':>7s} "
              f"{'cpu %':>6s} {'us/req':>7s} {'preempt/s':>9s} {'load cpu %':>10s}  cores busy %")
        for r in result["rows"]:
            print(f"{r['run']:3d} {r['proxy']:12s} {r['api']:9s} {str(r['stream']):6s} {r['clients']:7d} {r['rps']:7.0f} "
                  f"{r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {r['proxy_cpu_percent'] or 0:6.0f} "
                  f"{r['proxy_cpu_us_per_request'] or 0:7.0f} {r['proxy_preempted_per_s'] or 0:9.0f} "
                  f"{r['load_cpu_percent']:10.0f}  {'/'.join(map(str, r['cores_busy_percent']))}")
        return
    print(f"{'stream':7s} {'added p50 ms':>13s} {'added p99 ms':>13s} {'rps@64':>8s} "
          f"{'baseline added p50':>19s} {'baseline rps@64':>16s} {'ratio':>6s}")
    for s in result["summary"]:
        print(f"{str(s['stream']):7s} {s['pdserve_added_p50_ms']:13.2f} {s['pdserve_added_p99_ms']:13.2f} "
              f"{s['pdserve_rps_64']:8.0f} {s['baseline_added_p50_ms']:19.2f} {s['baseline_rps_64']:16.0f} "
              f"{s['rps_ratio_64']:6.1f}x")


if __name__ == "__main__":
    main()
