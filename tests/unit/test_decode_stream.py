"""A request's DecodeStream primed with a short prompt suffix (pdserve/engine/decode_stream.py) gives every
generated token the same text as vLLM's whole-prompt priming, and vLLM's detokenizer gets the suffix."""

from __future__ import annotations

import random
import types

import pytest
from tokenizers.decoders import DecodeStream

from pdserve.engine import decode_stream
from pdserve.engine.decode_stream import SUFFIX_MAX, safe_suffix
from pdserve.engine.models import _build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _build_tokenizer(1024, 131_072)    # the embedded default's: byte-level BPE, 256 byte tokens


def steps(backend, prime: list[int], generated: list[int], skip: bool) -> list[str | None]:
    stream = DecodeStream(ids=prime, skip_special_tokens=skip)
    return [stream.step(backend, t) for t in generated]


def prompts(tokenizer, rng: random.Random):
    """Real text (multi-byte characters cut anywhere by the model's next tokens) and random ids (byte tokens that
    are halves of characters, special tokens)."""
    text = " ".join(rng.choice(["über", "😀 ok", "def f():", "\n\n", "e\u0301", "東京", "x=1", "<|im_end|>"])
                    for _ in range(rng.randrange(10, 200)))
    yield tokenizer(text, add_special_tokens=False)["input_ids"]
    yield [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(30, 400))]


@pytest.mark.parametrize("skip", [True, False])
def test_every_generated_tokens_text_is_the_same_as_with_the_whole_prompt(tokenizer, skip):
    backend, rng, primed_short = tokenizer._tokenizer, random.Random(11), 0
    for _ in range(150):
        for ids in prompts(tokenizer, rng):
            generated = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
            suffix = safe_suffix(backend, ids, skip)
            if suffix is None:
                continue
            primed_short += 1
            assert len(suffix) < SUFFIX_MAX and ids[-len(suffix):] == suffix
            assert steps(backend, suffix, generated, skip) == steps(backend, ids, generated, skip)
    assert primed_short > 200     # most of the 300 prompts have such a suffix: the check above ran


def test_short_prompts_and_prompts_without_a_clean_suffix_keep_the_whole_prompt(tokenizer):
    backend = tokenizer._tokenizer
    assert safe_suffix(backend, [5, 6, 7], True) is None
    halves = tokenizer("😀" * 40, add_special_tokens=False)["input_ids"]
    cut = [t for t in halves if "\ufffd" in tokenizer.decode([t])]         # byte tokens of the emoji
    assert cut and safe_suffix(backend, cut[:1] * 30, True) is None         # every suffix decodes to a half


def test_vllms_detokenizer_is_built_from_the_suffix_and_says_the_same(tokenizer, monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.engine import detokenizer
    monkeypatch.setattr(detokenizer.FastIncrementalDetokenizer, "__init__",
                        detokenizer.FastIncrementalDetokenizer.__init__)     # undone after the test
    rng = random.Random(4)
    ids = tokenizer(" ".join(["über 😀 東京 row"] * 300), add_special_tokens=False)["input_ids"]
    generated = [rng.randrange(len(tokenizer)) for _ in range(30)]

    def request():
        return types.SimpleNamespace(request_id="r", prompt_token_ids=list(ids),
                                     sampling_params=SamplingParams(max_tokens=30))

    def text_of(req) -> tuple[str, list[int]]:
        detok = detokenizer.FastIncrementalDetokenizer(tokenizer, req)
        for t in generated:
            detok.update([t], False)
        return detok.output_text, req.prompt_token_ids

    whole = text_of(request())
    primed: list[int] = []
    real_stream = detokenizer.tokenizers.decoders.DecodeStream
    monkeypatch.setattr(detokenizer.tokenizers.decoders, "DecodeStream",
                        lambda ids=None, **kw: primed.append(len(ids or [])) or real_stream(ids=ids, **kw))
    assert decode_stream.patch_decode_stream_prefill() == "yes"
    suffixed = text_of(request())
    assert suffixed == whole and suffixed[1] == ids        # the same text; the request's ids given back whole
    assert primed and primed[-1] < SUFFIX_MAX, primed
