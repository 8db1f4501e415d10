"""pdserve.engine.patches: streamed turns carry D's handles (chat, completions, Anthropic messages), P reports
pulled vs locally cached tokens, D returns its token ids when asked, P cuts an offer to the common token prefix
of D's sequence (EXPECT_KEY) and its own prompt."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

from pdserve.engine import patches
from pdserve.router.wire import (CHECKED_KEY, EXPECT_KEY, LOCAL_KEY, PULLED_KEY, TOKENS_KEY, WANT_TOKENS_KEY,
                                 pack_ids)

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


# -- the continuation check (EXPECT_KEY) -----------------------------------------------------------------
BS = 16
D_SEQ = list(range(100, 140))            # D's prompt + generated ids: 40 tokens; D offers 39 (the last is not computed)


class FakeNixl:
    """What vLLM's NIXL pull scheduler does with D's offer on P (0.26 and 0.32 alike): it loads
    min(remote_num_tokens, num_prompt_tokens) - computed tokens, or 0 below kv_recompute_threshold, and only
    when remote_block_ids is non-empty; it records the params it was handed."""

    def __init__(self, threshold: int = 0, block_size: int | None = BS):
        self.threshold = threshold
        self.seen: list[dict] = []
        if block_size is not None:
            self.connector_scheduler = SimpleNamespace(block_size=block_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        self.seen.append(copy.deepcopy(params))
        if params and params.get("do_remote_decode") and params.get("remote_block_ids"):
            count = min(params.get("remote_num_tokens") or 0, len(request.prompt_token_ids)) - num_computed_tokens
            if count > 0:
                return (0, False) if count < self.threshold else (count, True)
        return 0, False

    def request_finished(self, request, block_ids):
        return False, {"do_remote_prefill": True, "remote_block_ids": block_ids}


def offer(blocks=None, num_tokens: int = 39, expect=D_SEQ) -> dict:
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d", "remote_host": "h",
              "remote_port": 1, "remote_request_id": "d-1", "remote_num_tokens": num_tokens,
              "remote_block_ids": [[10, 11, 12]] if blocks is None else blocks}
    if expect is not None:
        params[EXPECT_KEY] = pack_ids(expect)          # as the router sends it (reuse.engine_checked)
    return params


def p_request(prompt: list[int], params: dict, rid: str = "p1") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=params, all_token_ids=prompt)


def pulled(conn, req, computed: int = 0) -> tuple[tuple, dict]:
    got = conn.get_num_new_matched_tokens(req, computed)
    return got, conn.request_finished(req, [7])[1]


def test_a_full_continuation_is_offered_whole():
    conn = patches.wrap_connector(FakeNixl())
    req = p_request(D_SEQ + [1, 2, 3, 4], offer())          # the next turn: D's sequence, then new tokens
    got, back = pulled(conn, req)
    assert got == (39, True)
    assert conn.seen[0]["remote_num_tokens"] == 39 and conn.seen[0]["remote_block_ids"] == [[10, 11, 12]]
    assert EXPECT_KEY not in conn.seen[0]                     # vLLM never sees D's sequence
    assert back[PULLED_KEY] == 39 and back[CHECKED_KEY] == 39


def test_a_cut_in_the_middle_of_a_block():
    conn = patches.wrap_connector(FakeNixl())
    prompt = D_SEQ[:21] + [7] * 30                           # the client rewrote D's reply from token 21 on
    got, back = pulled(conn, p_request(prompt, offer()))
    assert got == (21, True)
    assert conn.seen[0]["remote_num_tokens"] == 21
    assert conn.seen[0]["remote_block_ids"] == [[10, 11]]    # cdiv(21, 16): P pairs its blocks with D's tail
    assert back[PULLED_KEY] == 21 and back[CHECKED_KEY] == 21


def test_the_cut_comes_before_vllms_recompute_threshold():
    conn = patches.wrap_connector(FakeNixl(threshold=32))
    got, back = pulled(conn, p_request(D_SEQ[:21] + [7] * 30, offer()))
    assert got == (0, False)                                   # 21 < 32: vLLM recomputes
    assert back[PULLED_KEY] == 0 and back[CHECKED_KEY] == 21


def test_p_computes_the_last_prompt_token_itself():
    conn = patches.wrap_connector(FakeNixl())
    got, back = pulled(conn, p_request(D_SEQ[:30], offer()))   # the prompt is a prefix of D's sequence
    assert got == (29, True) and back[CHECKED_KEY] == 29
    assert conn.seen[0]["remote_block_ids"] == [[10, 11]]


def test_a_cut_of_zero_declines_and_keeps_ds_blocks_for_the_release_notice():
    conn = patches.wrap_connector(FakeNixl())
    got, back = pulled(conn, p_request([9] + D_SEQ, offer()))  # differs at the first token
    assert got == (0, False)
    assert conn.seen[0]["remote_num_tokens"] == 0
    # kept: vLLM's update_state_after_alloc queues the notify-only read that frees D's blocks only with them
    assert conn.seen[0]["remote_block_ids"] == [[10, 11, 12]]
    assert back[PULLED_KEY] == 0 and back[CHECKED_KEY] == 0


def test_the_cut_is_made_once_when_vllm_asks_again():
    calls = []

    class Async(FakeNixl):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            calls.append(1)
            if len(calls) == 1:
                self.seen.append(copy.deepcopy(request.kv_transfer_params))
                return None, False                           # the lookup is still running
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    conn = patches.wrap_connector(Async())
    req = p_request(D_SEQ[:21] + [7] * 30, offer())
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (21, True)
    assert conn.get_num_new_matched_tokens(req, 16) == (5, True)   # a preempted request, rescheduled
    assert conn.seen[0] == conn.seen[1] == conn.seen[2]
    assert conn.seen[0]["remote_num_tokens"] == 21 and conn.seen[0]["remote_block_ids"] == [[10, 11]]
    _, back = conn.request_finished(req, [7])
    assert back[CHECKED_KEY] == 21 and back[PULLED_KEY] == 5


def test_flat_and_per_group_block_lists():
    prompt = D_SEQ[:21] + [7] * 30
    for blocks, want in (([10, 11, 12], [10, 11]),                       # older vLLM: one flat list
                         ([[10, 11, 12], [20, 21, 22]], [[10, 11], [20, 21]])):   # one per KV-cache group
        conn = patches.wrap_connector(FakeNixl())
        assert pulled(conn, p_request(prompt, offer(blocks)))[0] == (21, True)
        assert conn.seen[0]["remote_block_ids"] == want and conn.seen[0]["remote_num_tokens"] == 21


def test_a_cut_that_cannot_be_made_safely_declines():
    prompt = D_SEQ[:21] + [7] * 30
    # a sliding-window group (D exports its in-window tail only), or no block size known: P reads nothing
    for conn, blocks in ((patches.wrap_connector(FakeNixl()), [[10, 11, 12], [22]]),
                         (patches.wrap_connector(FakeNixl(block_size=None)), [[10, 11, 12]])):
        got, back = pulled(conn, p_request(prompt, offer(blocks)))
        assert got == (0, False) and conn.seen[0]["remote_block_ids"] == blocks
        assert back[CHECKED_KEY] == 21
    # a whole continuation needs no cut: vLLM reads D's blocks as D sent them
    conn = patches.wrap_connector(FakeNixl())
    assert pulled(conn, p_request(D_SEQ + [1], offer([[10, 11, 12], [22]])))[0] == (39, True)
    # a sequence that is not a list of ids cannot be checked: nothing is read, nothing reported as checked
    conn = patches.wrap_connector(FakeNixl())
    got, back = pulled(conn, p_request(D_SEQ + [1], offer(expect=None) | {EXPECT_KEY: "x"}))
    assert got == (0, False) and CHECKED_KEY not in back


def test_the_packed_sequence_an_older_routers_list_and_what_is_neither():
    prompt = D_SEQ[:21] + [7] * 30
    # a list of ids (a router from before pack_ids) is checked the same way
    conn = patches.wrap_connector(FakeNixl())
    assert pulled(conn, p_request(prompt, offer(expect=None) | {EXPECT_KEY: list(D_SEQ)}))[0] == (21, True)
    assert conn.seen[0]["remote_num_tokens"] == 21 and EXPECT_KEY not in conn.seen[0]
    # not base64, not whole uint32s, not ids: nothing is read and nothing reported as checked
    for bad in ("AQID", pack_ids(D_SEQ)[:-4] + "!!!=", [1, "2"], [-1] + D_SEQ, 5, None):
        conn = patches.wrap_connector(FakeNixl())
        got, back = pulled(conn, p_request(prompt, offer(expect=None) | {EXPECT_KEY: bad}))
        assert got == (0, False) and conn.seen[0]["remote_num_tokens"] == 0 and CHECKED_KEY not in back, bad
    # a prompt that is not ids (never from vLLM) cannot be checked either
    conn = patches.wrap_connector(FakeNixl())
    got, back = pulled(conn, p_request([0.5] * 50, offer()))
    assert got == (0, False) and CHECKED_KEY not in back


def test_without_expect_key_vllm_sees_the_params_untouched():
    conn = patches.wrap_connector(FakeNixl())
    params = offer(expect=None)
    before = copy.deepcopy(params)
    req = p_request([9] * 50, params)                          # would be cut to 0 if checked
    got, back = pulled(conn, req)
    assert got == (39, True) and req.kv_transfer_params is params and params == before
    assert CHECKED_KEY not in back and back[PULLED_KEY] == 39
    # EXPECT_KEY without an offer of D's blocks (a turn-1 request): dropped, nothing else changes
    conn = patches.wrap_connector(FakeNixl())
    turn1 = {"do_remote_decode": True, "do_remote_prefill": False, EXPECT_KEY: D_SEQ}
    got, back = pulled(conn, p_request(D_SEQ, turn1))
    assert got == (0, False) and turn1 == {"do_remote_decode": True, "do_remote_prefill": False}
    assert CHECKED_KEY not in back


def test_installed_vllm_nixl_scheduler_reads_the_cut():
    # vLLM's own NIXL pull scheduler on P, fed the cut params: its count, its threshold, and for a cut of 0 the
    # notify-only read that frees D's blocks (update_state_after_alloc with no external tokens).
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    def scheduler(threshold: int):
        s = object.__new__(NixlPullConnectorScheduler)   # only the attributes these two methods read
        s.block_size, s.kv_recompute_threshold, s.is_bidirectional_kv_xfer_enabled = BS, threshold, True
        s.use_host_buffer, s._has_mamba, s._reqs_in_batch, s._reqs_need_recv = False, False, set(), {}
        return s

    def request(prompt, params):
        return SimpleNamespace(request_id="p1", prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
                               kv_transfer_params=params)

    sched = scheduler(threshold=0)
    conn = patches.wrap_connector(SimpleNamespace(connector_scheduler=sched,
                                                  get_num_new_matched_tokens=sched.get_num_new_matched_tokens))
    assert conn.get_num_new_matched_tokens(request(D_SEQ[:21] + [7] * 30, offer()), 0) == (21, True)
    assert conn.get_num_new_matched_tokens(request(D_SEQ + [1], offer()), 16) == (23, True)
    sched.kv_recompute_threshold = 64
    assert conn.get_num_new_matched_tokens(request(D_SEQ + [1], offer()), 0) == (0, False)

    sched = scheduler(threshold=0)
    conn = patches.wrap_connector(SimpleNamespace(connector_scheduler=sched,
                                                  get_num_new_matched_tokens=sched.get_num_new_matched_tokens))
    req = request([9] + D_SEQ, offer())
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, SimpleNamespace(blocks=((),)), 0)
    queued = sched._reqs_need_recv["p1"]
    assert queued[0] is req and not any(queued[1])            # no local blocks: notify D only, read nothing
    assert req.kv_transfer_params["_remote_blocks_processed"] is True


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


class FakeDecodeSide:
    """A decode server's NIXL connector as vLLM 0.32's pull scheduler marks requests for its workers' expiry
    (update_state_after_alloc): only those that pull (do_remote_prefill, bidirectional) or are pulled from."""

    def __init__(self, bidirectional: bool = True):
        self.connector_scheduler = SimpleNamespace(_reqs_in_batch=set(),
                                                   is_bidirectional_kv_xfer_enabled=bidirectional)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        part = self.connector_scheduler
        if params and (params.get("do_remote_decode") or (params.get("do_remote_prefill")
                                                           and part.is_bidirectional_kv_xfer_enabled)):
            part._reqs_in_batch.add(request.request_id)
        if params and params.get("do_remote_prefill"):
            params.update(do_remote_prefill=False, _remote_blocks_processed=True)

    def request_finished(self, request, block_ids):
        return True, {}


def test_a_turn_served_on_d_alone_is_marked_for_the_workers_expiry_like_a_pulled_one():
    """Issue 45: vLLM held a D-alone turn's blocks at its end (request_finished) but never handed it to its
    workers' expiry, so nothing listed, expired, released or renewed them: 43.8% of D's KV leaked."""
    conn = patches.wrap_connector(FakeDecodeSide())
    batch = conn.connector_scheduler._reqs_in_batch
    for rid, params in (("alone", {"do_remote_prefill": False}),
                        ("pulled", {"do_remote_prefill": True, "remote_block_ids": [[1]]}),
                        ("plain", None), ("p-side", {"do_remote_decode": True, "do_remote_prefill": False})):
        conn.update_state_after_alloc(SimpleNamespace(request_id=rid, kv_transfer_params=params), None, 0)
    assert batch == {"alone", "pulled", "p-side"}
    conn.update_state_after_alloc(SimpleNamespace(request_id="pulled", kv_transfer_params={
        "do_remote_prefill": False, "_remote_blocks_processed": True}), None, 0)   # rescheduled: vLLM's own
    one_way = patches.wrap_connector(FakeDecodeSide(bidirectional=False))
    one_way.update_state_after_alloc(SimpleNamespace(request_id="alone", kv_transfer_params={
        "do_remote_prefill": False}), None, 0)
    assert one_way.connector_scheduler._reqs_in_batch == set()     # without bidirectional D holds nothing
