"""pdserve.engine.patches: streamed turns carry D's handles (chat, completions, Anthropic messages), P reports
pulled vs locally cached tokens, D returns its token ids when asked."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from pdserve.engine import patches
from pdserve.router.wire import LOCAL_KEY, PULLED_KEY, TOKENS_KEY, WANT_TOKENS_KEY

PARAMS = {"remote_block_ids": [[1, 2]], "remote_num_tokens": 40, "do_remote_decode": True}


def output(finished: bool, params=None):
    return SimpleNamespace(finished=finished, kv_transfer_params=params)


class FakeServing:
    """The shape of vLLM's stream generators: SSE strings made from a result generator."""

    async def chat_completion_stream_generator(self, request, result_generator, request_id, *rest):
        async for out in result_generator:
            item = out[1] if isinstance(out, tuple) else out
            yield "data: " + json.dumps({"choices": [{"finish_reason": "stop" if item.finished else None}]}) + "\n\n"
        yield "data: [DONE]\n\n"


async def collect(gen) -> list[str]:
    return [e async for e in gen]


def run_stream(outputs) -> list[dict]:
    class Serving(FakeServing):
        pass
    assert patches.patch_stream_generator(Serving, "chat_completion_stream_generator")

    async def results():
        for o in outputs:
            yield o
    events = asyncio.run(collect(Serving().chat_completion_stream_generator("req", results(), "id")))
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[6:]) for e in events[:-1]]


def test_the_final_chunk_carries_kv_transfer_params():
    chunks = run_stream([output(False), output(False), output(True, PARAMS)])
    assert [c.get("kv_transfer_params") for c in chunks] == [None, None, PARAMS]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_shape_and_nothing_without_params():
    assert run_stream([(0, output(False)), (0, output(True, PARAMS))])[-1]["kv_transfer_params"] == PARAMS
    assert all("kv_transfer_params" not in c for c in run_stream([output(False), output(True, None)]))


def test_installed_vllm_stream_generators_are_patched():
    # Fails when a vLLM layout change makes the patch miss its targets (then streamed turns lose reuse).
    done = patches.patch_streamed_kv_params()
    assert any("OpenAIServingChat" in d for d in done) and any("OpenAIServingCompletion" in d for d in done), done
    assert patches.patch_pulled_token_counts()


class FakeConnector:
    def __init__(self, pulled: int):
        self.pulled = pulled

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.pulled, self.pulled > 0

    def request_finished(self, request, block_ids):
        return False, {"do_remote_prefill": True, "remote_block_ids": block_ids}


def test_connector_reports_pulled_and_local_tokens_apart():
    conn = patches.wrap_connector(FakeConnector(pulled=256))
    req = SimpleNamespace(request_id="r1")
    assert conn.get_num_new_matched_tokens(req, 128) == (256, True)
    _, params = conn.request_finished(req, [3])
    assert params[PULLED_KEY] == 256 and params[LOCAL_KEY] == 128
    # single use: a later request with the same id that never asked the connector reports nothing
    assert PULLED_KEY not in conn.request_finished(req, [3])[1]


def test_connector_returns_the_requests_token_ids_when_its_params_ask():
    conn = patches.wrap_connector(FakeConnector(pulled=0))
    asking = SimpleNamespace(request_id="d1", all_token_ids=[5, 6, 7, 8],
                             kv_transfer_params={"do_remote_prefill": False, WANT_TOKENS_KEY: True})
    _, params = conn.request_finished(asking, [3])
    assert params[TOKENS_KEY] == [5, 6, 7, 8] and params["remote_block_ids"] == [3]
    for params_in in (None, {"do_remote_prefill": False}, {WANT_TOKENS_KEY: False}):
        quiet = SimpleNamespace(request_id="d2", all_token_ids=[5], kv_transfer_params=params_in)
        assert TOKENS_KEY not in conn.request_finished(quiet, [3])[1]


class FakeHMAConnector:
    """NIXL's shape: the scheduler calls request_finished_all_groups; no params for an unfinished transfer."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def request_finished_all_groups(self, request, block_ids):
        if not block_ids[0]:
            return False, None
        return True, {"do_remote_decode": True, "remote_block_ids": block_ids}


def test_token_ids_through_request_finished_all_groups_and_never_into_no_params():
    conn = patches.wrap_connector(FakeHMAConnector())
    req = SimpleNamespace(request_id="d1", all_token_ids=[1, 2, 3], kv_transfer_params={WANT_TOKENS_KEY: True})
    assert conn.request_finished_all_groups(req, ([4],))[1][TOKENS_KEY] == [1, 2, 3]
    assert conn.request_finished_all_groups(req, ([],)) == (False, None)


# -- streamed /v1/messages -------------------------------------------------------------------------------
D_PARAMS = {"do_remote_decode": True, "remote_block_ids": [[1]], TOKENS_KEY: [1, 2, 3]}


def chat_chunk(finish=None, content="x", params=None, choices=True) -> str:
    data = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}] if choices else []}
    if not choices:
        data["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if params is not None:
        data["kv_transfer_params"] = params
    return "data: " + json.dumps(data) + "\n\n"


CHAT_STREAM = [chat_chunk(content=""), chat_chunk(), chat_chunk(finish="stop", params=D_PARAMS),
               chat_chunk(choices=False), "data: [DONE]\n\n"]


class FakeMessages:
    """The shape of vLLM's message_stream_converter: Anthropic events made from the chat stream's strings."""

    async def message_stream_converter(self, generator):
        async for item in generator:
            if item.startswith("data: [DONE]"):
                yield 'event: message_stop\ndata: {"type":"message_stop"}\n\n'
            else:
                yield 'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'


def events_data(events: list[str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for e in events:
        name, data = e.split("\n")[0][len("event: "):], json.loads(e.split("\ndata: ", 1)[1])
        out.setdefault(name, []).append(data)
    return out


def convert(cls, chunks, serving=None) -> dict[str, list[dict]]:
    async def gen():
        for c in chunks:
            yield c
    return events_data(asyncio.run(collect(cls.message_stream_converter(serving or cls(), gen()))))


def test_message_stop_carries_the_chat_streams_kv_transfer_params():
    class Messages(FakeMessages):
        pass
    assert patches.patch_message_stream(Messages)
    assert not patches.patch_message_stream(type("NoConverter", (), {}))
    assert convert(Messages, CHAT_STREAM)["message_stop"] == [{"type": "message_stop", "kv_transfer_params": D_PARAMS}]
    # nothing to carry: message_stop as vLLM made it
    plain = [c for c in CHAT_STREAM if "kv_transfer_params" not in c] + [chat_chunk(params={})]
    assert convert(Messages, plain)["message_stop"] == [{"type": "message_stop"}]


def test_message_stop_that_already_has_params_is_left_alone():
    class Native(FakeMessages):
        async def message_stream_converter(self, generator):
            async for _ in generator:
                pass
            yield 'event: message_stop\ndata: {"type":"message_stop","kv_transfer_params":{"own":1}}\n\n'
    assert patches.patch_message_stream(Native)
    assert convert(Native, CHAT_STREAM)["message_stop"][0]["kv_transfer_params"] == {"own": 1}


def test_installed_vllm_message_stop_carries_kv_transfer_params():
    # vLLM's own converter, fed the chat stream as the patched chat generator makes it: fails when a vLLM
    # layout change makes the patch miss (then streamed /v1/messages turns lose reuse).
    done = patches.patch_message_stop_kv_params()
    assert done and "AnthropicServingMessages" in done[0], done
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages as Messages
    events = convert(Messages, CHAT_STREAM, serving=object.__new__(Messages))
    assert "error" not in events, events
    assert events["message_stop"] == [{"type": "message_stop", "kv_transfer_params": D_PARAMS}]
    assert all("kv_transfer_params" not in d for name, ds in events.items() if name != "message_stop" for d in ds)


def test_installed_vllm_responses_completed_event_carries_kv_transfer_params():
    # Streamed /v1/responses is left unpatched because response.completed is the full response, whose
    # kv_transfer_params come from the finished output; this fails when a vLLM version stops doing that.
    import inspect

    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses as Responses
    stream = inspect.getsource(Responses.responses_stream_generator)
    assert "response.completed" in stream and "self.responses_full_generator(" in stream
    assert "kv_transfer_params=context.kv_transfer_params" in inspect.getsource(Responses.responses_full_generator)
