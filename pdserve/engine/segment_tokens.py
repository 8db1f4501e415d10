"""A server tokenizes only what is new in a prompt (issue 44; applied by pdserve.engine.entry).

Every turn of a chat resends the whole history, and P's front end rendered and tokenized all of it again: 40-60 ms
for a 37k-token chat on the H200's host, on the path of every reused turn. A Hugging Face fast tokenizer cuts the
text at its added tokens (`<|im_start|>`, `<|im_end|>`, ...) before anything else and encodes each piece between
them on its own, so a prompt's ids are its pieces' ids in order. `SegmentTokenizer` keeps the ids of the pieces
it has seen (by their text, least recently used first out, within a token budget) and encodes only the pieces it
has not: on a follow-up that is the last answer and the new message.

That holds when the tokenizer does what it documents; `patch_segment_tokens` does not take it on trust: the first
calls of a server, and one in CHECK_EVERY after them, are tokenized both ways and compared, and one difference
turns the cache off for the server's life (counted in `pdserve_engine_tokenize_mismatches_total`, logged once):
the whole prompt is then tokenized as before. Calls it cannot serve exactly (offsets asked for, special tokens
added around the text, a text past the truncation length, a tokenizer without a Rust backend, added tokens that
strip whitespace) take the tokenizer's own path. P's `/metrics` counts the prompt tokens each way
(`pdserve_engine_prompt_tokens_tokenized_total{source="cached"|"encoded"}`).
"""

from __future__ import annotations

import os
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from pdserve.engine.names import TOKENIZE_CACHE_ENV

PATCHED_ATTR = "pdserve_segment_tokens"
DEFAULT_CACHE_TOKENS = 4_000_000        # ~16 MB of ids (4 bytes each) plus their text: a few 128k-token sessions
CHECKED_FIRST = 3                       # a server's first calls are compared with the tokenizer's own answer
CHECK_EVERY = 128                       # and one in this many after them
# Encode kwargs the cache answers exactly; any other key (offsets, return types, ...) goes the tokenizer's way.
_SERVED_KWARGS = {"add_special_tokens", "truncation", "max_length"}


def _alternation(contents: list[str]) -> re.Pattern[str] | None:
    if not contents:
        return None
    # Longest first: at one position the regex takes the first alternative that matches, as the tokenizer's
    # leftmost-longest match does.
    return re.compile("(" + "|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True)) + ")")


class SegmentTokenizer:
    """A text's ids as the ids of its pieces between added tokens; each piece's ids kept by its text."""

    def __init__(self, backend: Any, max_tokens: int = DEFAULT_CACHE_TOKENS):
        self.backend = backend            # a `tokenizers.Tokenizer`
        self.max_tokens = max_tokens
        added = backend.get_added_tokens_decoder()
        self.added_ids = {tok.content: tid for tid, tok in added.items()}
        # The tokenizer matches added tokens in two passes: those not normalized on the raw text, then the
        # normalized ones inside what is left (tokenizers' AddedVocabulary); the same is done here.
        self.raw = _alternation([t.content for t in added.values() if not t.normalized])
        self.normalized = _alternation([t.content for t in added.values() if t.normalized])
        self.pieces: OrderedDict[str, array] = OrderedDict()
        self.held_tokens = 0
        self.lock = threading.Lock()

    @staticmethod
    def usable(backend: Any) -> bool:
        """Whether pieces are encoded alone by this tokenizer: no added token eats the whitespace around it or
        matches only whole words (then where a piece starts depends on its neighbours)."""
        try:
            added = backend.get_added_tokens_decoder()
        except AttributeError:
            return False
        return not any(t.lstrip or t.rstrip or t.single_word for t in added.values())

    def split(self, text: str) -> list[str | int]:
        """The text as pieces (str) and added tokens (their ids), in order."""
        out: list[str | int] = []
        for i, part in enumerate(self.raw.split(text) if self.raw else [text]):
            if i % 2:
                out.append(self.added_ids[part])
            elif part:
                if self.normalized is None:
                    out.append(part)
                    continue
                for j, sub in enumerate(self.normalized.split(part)):
                    if j % 2:
                        out.append(self.added_ids[sub])
                    elif sub:
                        out.append(sub)
        return out

    def encode(self, text: str) -> tuple[list[int], int]:
        """The text's ids without special tokens around it, and how many of them were encoded now."""
        parts = self.split(text)
        with self.lock:
            missing = list(dict.fromkeys(p for p in parts if type(p) is str and p not in self.pieces))
            if missing:
                for piece, enc in zip(missing, self.backend.encode_batch(missing, add_special_tokens=False)):
                    self._keep(piece, array("i", enc.ids))
            ids: list[int] = []
            encoded = 0
            fresh = set(missing)
            for part in parts:
                if type(part) is int:
                    ids.append(part)
                    continue
                piece_ids = self.pieces[part]      # nothing leaves before _evict below
                self.pieces.move_to_end(part)
                if part in fresh:                  # counted once: a repeat of it was not encoded again
                    fresh.discard(part)
                    encoded += len(piece_ids)
                ids.extend(piece_ids)
            self._evict()
        return ids, encoded

    def _keep(self, piece: str, ids: array) -> None:
        self.pieces[piece] = ids
        self.held_tokens += len(ids)

    def _evict(self) -> None:
        while self.held_tokens > self.max_tokens and self.pieces:
            _, ids = self.pieces.popitem(last=False)
            self.held_tokens -= len(ids)


class _State:
    """One server's cache and its checks."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.by_tokenizer: dict[int, SegmentTokenizer | None] = {}
        self.calls = 0
        self.off = False
        self.lock = threading.Lock()

    def segmenter(self, tokenizer: Any) -> SegmentTokenizer | None:
        key = id(tokenizer)
        if key not in self.by_tokenizer:
            backend = getattr(tokenizer, "_tokenizer", None)
            usable = (backend is not None and hasattr(backend, "encode_batch")
                      and not getattr(tokenizer, "split_special_tokens", False) and SegmentTokenizer.usable(backend))
            self.by_tokenizer[key] = SegmentTokenizer(backend, self.max_tokens) if usable else None
        return self.by_tokenizer[key]

    def check_due(self) -> bool:
        with self.lock:
            self.calls += 1
            return self.calls <= CHECKED_FIRST or self.calls % CHECK_EVERY == 0


def cached_ids(segmenter: SegmentTokenizer, text: str, kwargs: dict) -> tuple[list[int], int] | None:
    """The ids the tokenizer would give for `text` with these encode kwargs, or None where only it can say."""
    if set(kwargs) - _SERVED_KWARGS or kwargs.get("add_special_tokens", True):
        return None
    ids, encoded = segmenter.encode(text)
    limit = kwargs.get("max_length")
    if kwargs.get("truncation") and limit is not None and len(ids) > limit:
        return None         # the tokenizer truncates (and vLLM then refuses the prompt as too long)
    return ids, encoded


_metrics: dict[str, Any] = {}


def _ensure_metrics() -> None:
    if not _metrics:
        from prometheus_client import Counter
        _metrics["tokens"] = Counter(
            "pdserve_engine_prompt_tokens_tokenized", "Prompt tokens this server's front end took from its "
            "tokenized-piece cache (cached) or encoded (encoded) (pdserve/engine/segment_tokens.py).", ["source"])
        _metrics["mismatches"] = Counter(
            "pdserve_engine_tokenize_mismatches", "Checks where the piece cache's ids differed from the "
            "tokenizer's own; the first one turns the cache off (pdserve/engine/segment_tokens.py).")


def _count(cached: int, encoded: int) -> None:
    _ensure_metrics()
    _metrics["tokens"].labels("cached").inc(cached)
    _metrics["tokens"].labels("encoded").inc(encoded)


def _mismatch() -> None:
    _ensure_metrics()
    _metrics["mismatches"].inc()


def cache_tokens_setting() -> int:
    raw = os.environ.get(TOKENIZE_CACHE_ENV, "").strip()
    return int(raw) if raw.isdigit() else DEFAULT_CACHE_TOKENS


def patch_segment_tokens(max_tokens: int | None = None) -> str:
    """Route vLLM's renderer's prompt tokenization through the cache: 'yes', 'off' (budget 0), or 'none' (this
    vLLM has no BaseRenderer._tokenize_prompt to route)."""
    max_tokens = cache_tokens_setting() if max_tokens is None else max_tokens
    if max_tokens <= 0:
        return "off"
    try:
        from vllm.renderers.base import BaseRenderer
    except ImportError:
        return "none"
    needed = ("_tokenize_prompt", "_wants_offsets", "_build_tokens_prompt", "get_tokenizer")
    if not all(hasattr(BaseRenderer, name) for name in needed):
        return "none"
    if getattr(BaseRenderer._tokenize_prompt, PATCHED_ATTR, False):
        return "yes"
    BaseRenderer._tokenize_prompt = routed_tokenize_prompt(BaseRenderer._tokenize_prompt, _State(max_tokens))
    return "yes"


def routed_tokenize_prompt(original, state: _State):
    """vLLM's BaseRenderer._tokenize_prompt(self, prompt, params), served from the cache where it can be."""
    def _tokenize_prompt(self, prompt, params):
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if state.off or not isinstance(text, str) or self._wants_offsets(prompt, params):
            return original(self, prompt, params)
        segmenter = state.segmenter(self.get_tokenizer())
        served = cached_ids(segmenter, text, params.get_encode_kwargs()) if segmenter else None
        if served is None:
            return original(self, prompt, params)
        ids, encoded = served
        if state.check_due():
            own = original(self, prompt, params)
            if list(own["prompt_token_ids"]) != ids:
                state.off = True
                _mismatch()
                print("pdserve-entry: the tokenized-piece cache gave other ids than the tokenizer for a prompt of "
                      f"{len(own['prompt_token_ids'])} tokens: off for this server's life", flush=True)
                return own
        _count(len(ids) - encoded, encoded)
        return self._build_tokens_prompt(ids, prompt)

    setattr(_tokenize_prompt, PATCHED_ATTR, True)
    return _tokenize_prompt
