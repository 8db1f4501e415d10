"""ContextFit (router/legs/context.py): each server's max_model_len from its /v1/models, asked once per server
process, again after a restart, a server that gives none asked again later; and the caps each API fits."""

from __future__ import annotations

import asyncio
import json

from pdserve.router.api import FORMATS
from pdserve.router.legs.context import RETRY_UNKNOWN_S, ContextFit, max_model_len
from pdserve.router.route.backends import Backend
from pdserve.router.telemetry.metrics import RouterMetrics

API = {fmt.api: fmt for fmt in FORMATS}


class Upstream:
    def __init__(self, answer: str | None):
        self.answer, self.asked = answer, 0

    async def get_text(self, backend, path):
        assert path == "/v1/models"
        self.asked += 1
        await asyncio.sleep(0.01)
        return self.answer


def models(*lengths) -> str:
    return json.dumps({"object": "list", "data": [{"id": f"m{i}", "max_model_len": n} for i, n in enumerate(lengths)]})


def test_max_model_len_is_the_least_a_models_answer_gives():
    assert max_model_len(models(8192, 4096)) == 4096
    assert max_model_len(models(8192)) == 8192
    for bad in (None, "", "not json", "[]", '{"data": 5}', '{"data": [{"max_model_len": "8192"}]}',
                '{"data": [{"max_model_len": true}]}', '{"data": [{"max_model_len": 0}]}'):
        assert max_model_len(bad) is None, bad


async def test_asked_once_per_server_process_and_again_after_a_restart():
    up, now = Upstream(models(8192)), [0.0]
    fit = ContextFit(up, RouterMetrics(), clock=lambda: now[0])
    d = Backend("decode-0", "http://d", "decode")
    assert await asyncio.gather(*(fit.max_model_len(d) for _ in range(5))) == [8192] * 5
    assert up.asked == 1                        # concurrent first turns share one call
    now[0] += 10 * RETRY_UNKNOWN_S
    assert await fit.max_model_len(d) == 8192 and up.asked == 1
    up.answer, d.generation = models(4096), d.generation + 1     # restarted with another --max-model-len
    assert await fit.max_model_len(d) == 4096 and up.asked == 2


async def test_a_server_that_gives_none_is_asked_again_later():
    up, now = Upstream(None), [0.0]
    fit = ContextFit(up, RouterMetrics(), clock=lambda: now[0])
    d = Backend("decode-0", "http://d", "decode")
    assert await fit.max_model_len(d) is None and await fit.max_model_len(d) is None and up.asked == 1
    up.answer = models(2048)
    now[0] += RETRY_UNKNOWN_S
    assert await fit.max_model_len(d) == 2048 and up.asked == 2


def test_each_api_fits_its_own_caps_and_nothing_else():
    room = 100
    chat = API["chat"].fit_output({"max_tokens": 32000, "max_completion_tokens": 50, "messages": []}, room)
    assert chat == {"max_tokens": 100, "max_completion_tokens": 50, "messages": []}
    assert API["completions"].fit_output({"max_tokens": 101, "prompt": "x"}, room) == {"max_tokens": 100,
                                                                                              "prompt": "x"}
    assert API["responses"].fit_output({"max_output_tokens": 32000, "max_tokens": 7}, room) == {
        "max_output_tokens": 100, "max_tokens": 7}
    assert API["messages"].fit_output({"max_tokens": 100}, room) is None          # fits: unchanged
    assert API["chat"].fit_output({"max_tokens": True}, room) is None
    thinking = {"type": "enabled", "budget_tokens": 31999}
    assert API["messages"].fit_output({"max_tokens": 32000, "thinking": thinking}, 5000) == {
        "max_tokens": 5000, "thinking": {"type": "enabled", "budget_tokens": 4999}}
    assert API["messages"].fit_output({"max_tokens": 32000, "thinking": thinking}, 1024) == {"max_tokens": 1024}
    adaptive = {"type": "adaptive"}
    assert API["messages"].fit_output({"max_tokens": 32000, "thinking": adaptive}, 1024) == {
        "max_tokens": 1024, "thinking": adaptive}
