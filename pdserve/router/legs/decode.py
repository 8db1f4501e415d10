"""The D leg: one request on a decode server (or, degraded, on whichever role is left), whole or streamed,
relayed to the client with D's router-only fields taken out. It returns the turn's outcomes (book.Finished when D
has finished, or how the turn ended) for the flow to record; it records nothing itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.router.api.base import Collector
from pdserve.router.errors import UpstreamError, backend_at_fault, error_body
from pdserve.router.legs.book import Finished
from pdserve.router.legs.context import ContextFit
from pdserve.router.legs.relay import StreamRelay
from pdserve.router.buffers import CHARGE
from pdserve.router.legs.turn import CLIENT_GONE, FAILED, ClientGone, Turn, headers, json_answer, write_within
from pdserve.router.legs.client import read_bounded
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend, Pool
from pdserve.router.route.cost import CostModel
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics
from pdserve.router.wire import PREFILL_THEN_DECODE

log = logging.getLogger("pdserve.router")


class BadAnswer(Exception):
    """D sent what the relay cannot take (its __cause__ says what): D's failure."""


class DecodeLeg:
    def __init__(self, upstream: Upstream, metrics: RouterMetrics, costs: CostModel, max_output_tokens: int = 0,
                 client_stall: float = 30.0):
        self.upstream = upstream
        self.client_stall = client_stall   # a client that reads none of its stream this long is dropped
        self.costs = costs
        self.metrics = metrics
        # output caps fitted to each server's context, and to router.max_output_tokens
        self.context = ContextFit(upstream, metrics, max_output_tokens=max_output_tokens)

    async def on_a_server(self, turn: Turn, pool: Pool, prefer: str | None,
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
            tracing.note(generated_on=backend.name, generate_tries=len(tried))
            try:
                return await attempt(backend)
            except UpstreamError as err:
                if not err.never_sent:
                    raise
                last = err

    async def whole(self, turn: Turn, pool: Pool, backend: Backend, body: dict[str, Any],
                    collector: Collector, track: bool) -> tuple[web.Response, Finished | None]:
        """D's whole answer for the client, and Finished when D answered it (the flow keeps the turn)."""
        body = await self.context.fit(turn, backend, body)
        d_started = time.perf_counter()
        turn.held_on = backend.name if "kv_transfer_params" in body else None
        status, data = await self.upstream.post_json(pool, backend, turn.route, body, turn.headers,
                                                     suspects=turn.suspects)
        collector.scrub(data)   # D's kv_transfer_params never reach the client
        if backend_at_fault(status, data):
            raise UpstreamError(status, data, backend.name)   # the caller may serve it on the other role
        if status != 200:
            return json_answer(turn, data, status, 1000 * (time.perf_counter() - d_started)), None
        ttft = time.perf_counter() - turn.started
        self.metrics.ttft.labels("false").observe(ttft)
        tracing.note(ttft_ms=round(1000 * ttft, 1))
        return json_answer(turn, data, status, 1000 * (time.perf_counter() - d_started)), \
            Finished(backend, collector, track)

    async def stream(self, request: web.Request, turn: Turn, pool: Pool, backend: Backend, body: dict[str, Any],
                     collector: Collector, track: bool) -> AsyncIterator[Finished | str | web.StreamResponse]:
        """Relay D's stream. Raises UpstreamError only before anything reached the client.

        Yields the turn's outcomes as they happen, for the flow to record before the stream goes on, then the
        response, last. Finished comes the moment D has finished its answer (its final handles, or the
        format's end marker), before the client gets the end of the stream: a client may hang up as soon as it
        has it (the openai client does), which cancels this handler while D's body is still ending.
        CLIENT_GONE or FAILED come when the client left or D broke the stream."""
        body = await self.context.fit(turn, backend, body)
        trial = pool.acquire(backend)
        ok: bool | None = None    # None: the client went away, which says nothing about D
        out: web.StreamResponse | None = None
        relay = StreamRelay(collector, keep_lines=track and turn.conversation.by_history,
                            max_bytes=self.upstream.max_answer_bytes, charge=request.get(CHARGE) if track else None)
        d_started = time.perf_counter()
        turn.held_on = backend.name if "kv_transfer_params" in body else None
        try:
            async with self.upstream.stream(backend, turn.route, body, turn.headers) as resp:
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    ok, status, data = await not_a_stream(backend, resp, self.upstream.max_answer_bytes)
                    self.upstream.count(backend, turn.route, False)
                    if not ok and status >= 500 and resp.status != 200:
                        ok = None                     # an answer: whose fault is for a second opinion
                        turn.suspects.hold(pool, backend)
                    if ok is not True:
                        raise UpstreamError(status, data, backend.name)   # nothing sent: may go elsewhere
                    yield json_answer(turn, data, status)
                    return
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  **headers(turn)})
                await _to_client(out.prepare(request))
                transport = request.transport
                # A write waits for the client only past the transport's high-water mark: below it, no timer.
                high = transport.get_write_buffer_limits()[1] if transport is not None else 0
                first = True
                async for data in resp.content.iter_any():
                    try:
                        chunk = relay.feed(data)
                    except Exception as err:   # noqa: BLE001 - the relay parses D's bytes only
                        raise BadAnswer() from err
                    if ok is None and (relay.done or collector.kv_params is not None):
                        yield self._finished(turn, backend, relay, track)
                        ok = True
                    if chunk:
                        if transport is None or transport.get_write_buffer_size() + len(chunk) > high:
                            await write_within(out.write(chunk), request, self.client_stall, self.metrics)
                        else:
                            try:              # _to_client inline: a coroutine less per chunk
                                await out.write(chunk)
                            except ConnectionError as err:
                                raise ClientGone() from err
                        if first:
                            first = False
                            ttft = time.perf_counter() - turn.started
                            self.metrics.ttft.labels("true").observe(ttft)
                            tracing.note(ttft_ms=round(1000 * ttft, 1))
                            d_first = time.perf_counter() - d_started
                            if turn.local_tokens:   # D alone: D's prefill rate
                                self.costs.observe_local(backend.name, d_first, turn.local_tokens)
                            elif turn.plan == PREFILL_THEN_DECODE and not turn.degraded:
                                self.costs.observe_first_token(backend.name, d_first)
                try:
                    tail = relay.close()
                except Exception as err:       # noqa: BLE001 - as feed
                    raise BadAnswer() from err
                if ok is None and relay.done:
                    yield self._finished(turn, backend, relay, track)
                    ok = True
                if tail:
                    await write_within(out.write(tail), request, self.client_stall, self.metrics)
                if not relay.done:
                    raise BadAnswer() from ValueError("the stream ended before the end of the answer")
            await write_within(out.write_eof(), request, self.client_stall, self.metrics)
            yield out
        except ClientGone:
            yield CLIENT_GONE                 # no-op when it had its whole answer
            yield out                         # type: ignore[misc] - only raised once out exists
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as err:
            if out is None:
                ok, error = self.upstream.failure(backend, turn.route, err)
                raise error from None
            if not ok:
                yield FAILED
            ok = await self._broken_stream(out, backend, turn, err, ok, relay.done)
            yield out
        except BadAnswer as bad:   # D sent what the relay cannot take: its fault, not a 500
            if out is None:
                raise
            if not ok:
                yield FAILED
            ok = await self._broken_stream(out, backend, turn, bad.__cause__ or bad, ok, relay.done)
            yield out
        except Exception as err:  # noqa: BLE001 - the router's own failure on D's good answer: never D's
            if out is None:
                raise
            log.exception("%s: the router failed relaying %s server %s's stream", turn.request_id, backend.role,
                          backend.name)
            if not ok:
                yield FAILED
            ok = await self._broken_stream(out, backend, turn, err, ok, relay.done, routers_own=True) or None
            yield out
        finally:
            pool.release(backend, ok, trial)

    def _finished(self, turn: Turn, backend: Backend, relay: StreamRelay, track: bool) -> Finished:
        """D has finished the answer: count D's success; the turn is to be kept."""
        try:
            relay.finish()      # the reply read from D's lines
        except Exception as err:   # noqa: BLE001 - as feed
            raise BadAnswer() from err
        self.upstream.count(backend, turn.route, True)
        turn.suspects.served()
        # A stream longer than the bound kept neither its lines nor its ids: served, not remembered.
        return Finished(backend, relay.collector, track and not relay.overflow)

    async def _broken_stream(self, out: web.StreamResponse, backend: Backend, turn: Turn, err: BaseException,
                             finished: bool | None, done_sent: bool, routers_own: bool = False) -> bool | None:
        """Bytes already reached the client: never retry or restart the stream. If D had finished its
        answer, only its last bytes were lost: end the stream as D would have. Otherwise end it with an
        error event in the client's format (and its end marker), and the turn failed. Returns the breaker
        verdict. The turn failed unless D had finished (the caller yields FAILED first). `routers_own`: the
        router failed, not D (the caller gives D no verdict then)."""
        failure = "the router failed relaying the answer" if routers_own else \
            f"{backend.role} server {backend.name} failed mid-stream"
        if not finished and not routers_own:
            self.upstream.count(backend, turn.route, False)
            log.warning("%s: %s server %s broke the stream: %s", turn.request_id, backend.role, backend.name,
                        type(err).__name__)
        # A client that stopped reading gets no more than it would for the stream itself.
        with contextlib.suppress(ConnectionError, RuntimeError, TimeoutError):
            async with asyncio.timeout(self.client_stall):
                if not finished:
                    await out.write(turn.fmt.stream_error(f"{failure}: {type(err).__name__}", turn.request_id,
                                                          turn.body.get("model")))
                elif not done_sent:
                    await out.write(turn.fmt.stream_end())
                await out.write_eof()
        return finished or False


async def not_a_stream(backend: Backend, resp: Any, limit: int) -> tuple[bool, int, dict[str, Any]]:
    """D answered a streamed request with an error or with something that is not SSE:
    (breaker verdict, status, body) for the client, before anything was sent."""
    try:
        data = json.loads(await read_bounded(resp, limit))   # AnswerTooLarge: a 502
    except ValueError:
        data = None
    if resp.status == 200:   # 200 but not an event stream: a broken server, never the client's success
        return False, 502, error_body(f"{backend.role} server {backend.name} answered a streamed request with "
                                      f"{resp.content_type or 'no content type'}", "server_error", 502)
    if not isinstance(data, dict):   # as post_json answers it: the router's 502, not the backend's status
        return False, 502, error_body(f"{backend.role} server {backend.name} sent a non-JSON body (HTTP "
                                      f"{resp.status})", "server_error", 502)
    return not backend_at_fault(resp.status, data), resp.status, data


async def _to_client(write: Awaitable[Any]) -> Any:
    """A write to the client; its failure means the client left (ClientGone), not that D failed."""
    try:
        return await write
    except ConnectionError as err:   # aiohttp's ClientConnectionResetError included
        raise ClientGone() from err
