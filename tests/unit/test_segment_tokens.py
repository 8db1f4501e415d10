"""The tokenized-piece cache (pdserve/engine/segment_tokens.py): a prompt's ids from its pieces between added
tokens are the tokenizer's own ids, only new pieces are encoded, the budget holds, and a tokenizer whose pieces do
not add up is caught by the check and left to itself."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import segment_tokens
from pdserve.engine.models import _build_tokenizer
from pdserve.engine.segment_tokens import (
    CHECK_EVERY,
    CHECKED_FIRST,
    SegmentTokenizer,
    _State,
    cached_ids,
    routed_tokenize_prompt,
)

CHAT_KWARGS = {"truncation": True, "max_length": 131_073, "add_special_tokens": False}   # vLLM's for a chat prompt
# Content that stresses the cut: NFC pairs (the tiny tokenizer normalizes like Qwen2's), emoji, whitespace runs,
# digits, halves and wholes of the added tokens inside a message.
WORDS = ["alpha", "def f(x):", "    return x", "\n\n", "  ", "e\u0301", "\u00e9", "😀", "12345678", "<|im",
         "_end|>", "<|im_end|>", "<|im_start|>user", "über", "\t", "{\"a\": [1, 2]}", "<|endoftext|>x"]


@pytest.fixture(scope="module")
def tokenizer():
    return _build_tokenizer(1024, 131_072)    # the embedded default's: byte-level BPE, ChatML template


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def own_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, **CHAT_KWARGS)["input_ids"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_growing_chat_gets_the_tokenizers_own_ids_and_encodes_only_its_new_messages(tokenizer, seed):
    rng = random.Random(seed)
    segmenter = SegmentTokenizer(tokenizer._tokenizer)
    messages = [{"role": "system", "content": words(rng, 300)}]
    for turn in range(5):
        messages.append({"role": "user", "content": words(rng, rng.randrange(1, 400))})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids, encoded = segmenter.encode(text)
        assert ids == own_ids(tokenizer, text)
        if turn:
            # the answer and the new message, each a piece of its own ("assistant\n...", "user\n..."), and the
            # "\n" between messages
            new = own_ids(tokenizer, "assistant\n" + messages[-2]["content"]) + \
                own_ids(tokenizer, "user\n" + messages[-1]["content"])
            assert encoded <= len(new) + 2, (encoded, len(new))
            assert len(ids) - encoded > 300        # the system prompt and older turns came from the cache
        messages.append({"role": "assistant", "content": words(rng, rng.randrange(1, 100))})


def test_a_short_follow_up_on_a_long_history_encodes_a_few_tokens(tokenizer):
    rng = random.Random(5)
    segmenter = SegmentTokenizer(tokenizer._tokenizer)
    messages = [{"role": "user", "content": words(rng, 4000)}, {"role": "assistant", "content": "ok"}]
    segmenter.encode(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True))
    messages.append({"role": "user", "content": "and now?"})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids, encoded = segmenter.encode(text)
    assert ids == own_ids(tokenizer, text) and len(ids) > 4000
    assert encoded < 20, encoded


def test_the_budget_keeps_the_most_recent_pieces_and_answers_stay_exact(tokenizer):
    rng = random.Random(9)
    segmenter = SegmentTokenizer(tokenizer._tokenizer, max_tokens=600)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": words(rng, 120)}], tokenize=False)
             for _ in range(12)]
    for text in texts + texts[::-1]:
        ids, _ = segmenter.encode(text)
        assert ids == own_ids(tokenizer, text)
        assert segmenter.held_tokens <= 600
        assert segmenter.held_tokens == sum(len(v) for v in segmenter.pieces.values())
    # the last text's pieces are the most recent: encoding it again encodes nothing
    assert segmenter.encode(texts[0])[1] == 0


def test_calls_the_cache_cannot_answer_exactly_go_to_the_tokenizer(tokenizer):
    segmenter = SegmentTokenizer(tokenizer._tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello there " * 50}], tokenize=False)
    n = len(own_ids(tokenizer, text))
    assert cached_ids(segmenter, text, CHAT_KWARGS)[0] == own_ids(tokenizer, text)
    assert cached_ids(segmenter, text, {"add_special_tokens": False})[0] == own_ids(tokenizer, text)
    assert cached_ids(segmenter, text, {**CHAT_KWARGS, "add_special_tokens": True}) is None
    assert cached_ids(segmenter, text, {**CHAT_KWARGS, "return_offsets_mapping": True}) is None
    assert cached_ids(segmenter, text, {**CHAT_KWARGS, "max_length": n - 1}) is None    # it would truncate
    assert cached_ids(segmenter, text, {**CHAT_KWARGS, "max_length": n})[0] == own_ids(tokenizer, text)


def test_added_tokens_that_strip_whitespace_leave_the_tokenizer_alone():
    from tokenizers import AddedToken, Tokenizer, models
    plain = Tokenizer(models.BPE())
    plain.add_special_tokens([AddedToken("<a>", special=True)])
    assert SegmentTokenizer.usable(plain)
    stripping = Tokenizer(models.BPE())
    stripping.add_special_tokens([AddedToken("<m>", lstrip=True, special=True)])
    assert not SegmentTokenizer.usable(stripping)


class FakeParams:
    def get_encode_kwargs(self):
        return dict(CHAT_KWARGS)


class RendererOf:
    """What routed_tokenize_prompt uses of vLLM's BaseRenderer, over a real Hugging Face tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.own_calls = 0

    def get_tokenizer(self):
        return self.tokenizer

    def _wants_offsets(self, prompt, params):
        return False

    @staticmethod
    def _build_tokens_prompt(ids, prompt):
        return {"prompt_token_ids": list(ids), **prompt}


def own_tokenize_prompt(self, prompt, params):        # vLLM's: the tokenizer on the whole text
    self.own_calls += 1
    return self._build_tokens_prompt(self.tokenizer(prompt["prompt"], **params.get_encode_kwargs())["input_ids"],
                                     prompt)


def test_the_first_calls_and_one_in_check_every_are_tokenized_both_ways(tokenizer):
    renderer = RendererOf(tokenizer)
    routed = routed_tokenize_prompt(own_tokenize_prompt, _State(1_000_000))
    rng = random.Random(3)
    for call in range(1, CHECK_EVERY + 1):
        text = tokenizer.apply_chat_template([{"role": "user", "content": words(rng, 5)}], tokenize=False)
        assert routed(renderer, {"prompt": text}, FakeParams())["prompt_token_ids"] == own_ids(tokenizer, text)
        if call in (CHECKED_FIRST, CHECKED_FIRST + 1):
            assert renderer.own_calls == CHECKED_FIRST
    assert renderer.own_calls == CHECKED_FIRST + 1


def metaspace_first_tokenizer():
    """A SentencePiece-style tokenizer that marks only the text's first word: its pieces between added tokens do
    not add up (a piece after `<s>` gets no mark in the whole text, one on its own does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(["hello world this is a test " * 20, "another line of text here"] * 50,
                            trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_whose_pieces_do_not_add_up_is_caught_and_left_to_itself(capsys):
    tokenizer = metaspace_first_tokenizer()
    renderer = RendererOf(tokenizer)
    state = _State(1_000_000)
    routed = routed_tokenize_prompt(own_tokenize_prompt, state)
    before = segment_tokens._metrics["mismatches"]._value.get() if segment_tokens._metrics else 0
    text = "<s>hello world</s>this is a test<s>another"
    assert routed(renderer, {"prompt": text}, FakeParams())["prompt_token_ids"] == own_ids(tokenizer, text)
    assert state.off and "off for this server's life" in capsys.readouterr().out
    assert segment_tokens._metrics["mismatches"]._value.get() == before + 1
    for _ in range(2 * CHECK_EVERY):     # from now on the tokenizer's own path, every call
        assert routed(renderer, {"prompt": text}, FakeParams())["prompt_token_ids"] == own_ids(tokenizer, text)
    assert renderer.own_calls == 1 + 2 * CHECK_EVERY


def test_the_patch_routes_vllms_renderer(monkeypatch):
    from vllm.renderers.base import BaseRenderer
    monkeypatch.setattr(BaseRenderer, "_tokenize_prompt", BaseRenderer._tokenize_prompt)   # undone after
    assert segment_tokens.patch_segment_tokens(0) == "off"
    assert not getattr(BaseRenderer._tokenize_prompt, segment_tokens.PATCHED_ATTR, False)
    assert segment_tokens.patch_segment_tokens() == "yes"
    assert getattr(BaseRenderer._tokenize_prompt, segment_tokens.PATCHED_ATTR, False)
