"""What a server's context leaves for the output: each server's max_model_len, and the request it gets with its
output-token caps fitted to it (docs/router.md "Output tokens beyond the context").

vLLM refuses a request whose output cap cannot fit (0.32: a cap over max_model_len, "max_tokens=32000 cannot be
greater than max_model_len=16384"; other releases: prompt + cap over it). In P then D the refusal came from D,
after P had computed the whole prompt: Claude Code asks 32,000 output tokens on every turn and retries a 400
six times. The router fits instead, as vLLM itself does when no cap is given: the cap D gets is at most
max_model_len less the prompt's tokens (P's usage on a P-then-D turn, the short-turn bound on a turn served on D
alone). A prompt that alone fills the context is refused by P's own validation, in milliseconds, before P
computes anything; that 400 passes to the client unchanged in its API's shape (prefill.py, flow.py).

max_model_len comes from the server itself (`GET /v1/models`, vLLM's `max_model_len` per model), read once
per server process (its generation) and cached: it is what the engine enforces whether `--max-model-len` was
given, left to the model's default, set on a server `--attach`ed or run by hand, or changed with a restart. The
planner's vllm_args know only the first case, and a second copy in router.json could disagree with the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from pdserve.router.legs.turn import Turn
from pdserve.router.legs.upstream import Upstream
from pdserve.router.route.backends import Backend
from pdserve.router.telemetry import tracing
from pdserve.router.telemetry.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
RETRY_UNKNOWN_S = 30.0      # a server that did not say its max_model_len is asked again after this long
ASK_TIMEOUT_S = 5.0         # ... or did not answer /v1/models within this


def max_model_len(text: str | None) -> int | None:
    """The smallest max_model_len in a /v1/models answer (the served model and its adapters share it)."""
    try:
        data = json.loads(text) if text else None
    except ValueError:
        return None
    models = data.get("data") if isinstance(data, dict) else None
    lengths = [m["max_model_len"] for m in models if isinstance(m, dict) and type(m.get("max_model_len")) is int
               and m["max_model_len"] > 0] if isinstance(models, list) else []
    return min(lengths) if lengths else None


class ContextFit:
    def __init__(self, upstream: Upstream, metrics: RouterMetrics, clock: Any = time.monotonic,
                 max_output_tokens: int = 0):
        self.upstream = upstream
        self.metrics = metrics
        self.cap = max_output_tokens     # router.max_output_tokens: the operator's bound (0: none)
        self.clock = clock
        # server name -> (its generation, max_model_len or None, when asked)
        self.known: dict[str, tuple[int, int | None, float]] = {}
        self.asking: dict[str, asyncio.Task[int | None]] = {}   # one /v1/models call per server at a time
        self.unsaid: set[str] = set()        # servers said (once) to give no max_model_len

    async def max_model_len(self, backend: Backend) -> int | None:
        known = self.known.get(backend.name)
        if known is not None and known[0] == backend.generation and (
                known[1] is not None or self.clock() - known[2] < RETRY_UNKNOWN_S):
            return known[1]
        task = self.asking.get(backend.name)
        if task is None:
            task = asyncio.ensure_future(self._ask(backend))
            self.asking[backend.name] = task
            task.add_done_callback(lambda _: self.asking.pop(backend.name, None))
        return await asyncio.shield(task)

    async def _ask(self, backend: Backend) -> int | None:
        generation = backend.generation
        try:
            text = await asyncio.wait_for(self.upstream.get_text(backend, "/v1/models"), ASK_TIMEOUT_S)
        except asyncio.TimeoutError:
            text = None
        value = max_model_len(text)
        self.known[backend.name] = (generation, value, self.clock())
        if value is None and backend.name not in self.unsaid:
            self.unsaid.add(backend.name)
            log.info("%s %s did not say its max_model_len (/v1/models): output caps go to it unfitted until it "
                     "does", backend.role, backend.name)
        return value

    async def fit(self, turn: Turn, backend: Backend, body: dict[str, Any]) -> dict[str, Any]:
        """`body` for `backend` with its output caps fitted to what the context leaves after the prompt
        (turn.prompt_tokens: exact, or a bound from above). With no count of the prompt, a cap that could fit
        goes unchanged and one that cannot (max_model_len or more: the prompt has a token at least) is
        fitted to max_model_len - 1. router.max_output_tokens bounds it too, set where the body sends no cap.
        Counted per API and noted on the request's trace and log line."""
        if not self.cap and not any(f in body for f in turn.fmt.output_fields):
            return body
        limit = await self.max_model_len(backend)
        prompt = turn.prompt_tokens
        room = None if limit is None else limit - prompt if prompt is not None and prompt < limit else limit - 1
        if self.cap:
            room = self.cap if room is None else min(room, self.cap)
        if room is None or room < 1:
            return body
        fitted = turn.fmt.fit_output(body, room, fill=bool(self.cap))
        if fitted is None:
            return body
        asked = max((body[f] for f in turn.fmt.output_fields if isinstance(body.get(f), int)), default=0)
        self.metrics.output_fitted.labels(turn.fmt.api).inc()
        tracing.note(output_tokens_asked=asked, output_tokens_fitted=room)
        log.debug("%s: output cap %d fitted to %d (max_model_len %s of %s, prompt %s tokens)", turn.request_id,
                  asked, room, limit, backend.name, prompt)
        return fitted
