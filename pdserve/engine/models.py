"""Built-in random-weight models, so pdserve runs with no model hub reachable.

`ensure_model("tiny", dir)` creates a small Qwen2 model with a byte-level BPE
tokenizer and a ChatML chat template, deterministically (same bytes every
time), and returns its path. The output is gibberish; the point is real shapes,
real KV caches and real chat/completions traffic through vLLM.

torch/transformers/tokenizers are imported lazily: config validation imports
BUILTIN_MODELS and must stay fast and work without the heavy stack installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

# Bump when the build recipe changes so existing dirs are rebuilt, not reused.
# 2: the model's vocabulary is the tokenizer's (mid had 1,591 ids no token decodes to)
# 3: positions for agent sessions (tiny 131,072, mid 65,536); the chat template renders tools as Qwen2.5's does
MODELGEN_VERSION = 3
MARKER = ".pdserve-model.json"

# Qwen2Config keyword arguments. Head dim is 64 in both; GQA (fewer KV heads)
# keeps KV-cache shapes realistic for transfer tests. vocab_size is the BPE's target: the model gets the
# tokenizer's actual size (the training text gives mid 2,505), so every id it generates decodes to text.
# max_position_embeddings bounds --max-model-len (past it vLLM's rotary kernel indexes out of bounds: D crashed at
# position 16,384 when tiny had 16,384). Coding agents need room: Claude Code's first turn is ~11k tokens of
# messages plus its tools (32 kB of JSON, ~20k tokens with tiny's 1,024-token vocabulary) and it asks 32,000
# output tokens. tiny gets 131,072 (Qwen2.5's long context) for the embedded default's --max-model-len; rotary
# positions are computed, not weights, so this costs only vLLM's cos/sin table. KV per token: layers x KV heads
# x head dim (64) x 2 (K, V) x 2 bytes (bf16): tiny 2 x 2 x 64 x 2 x 2 = 1 KiB (131,072 tokens: 128 MiB); mid
# 8 x 4 x 64 x 2 x 2 = 8 KiB, so 65,536 positions (512 MiB) still fit the 1 GiB KV cache the CPU configs give.
BUILTIN_MODELS: dict[str, dict] = {
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1024, max_position_embeddings=131072),
    "mid": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1536, vocab_size=4096, max_position_embeddings=65536),
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# ChatML with tools as Qwen2.5-Instruct's template writes them (its tokenizer_config.json, followed tag for tag),
# less Qwen's default system prompt (no system message: none, as before; with tools: the tools block alone):
# - `tools` (what vLLM passes from chat, /v1/messages and /v1/responses) go into the system turn: "# Tools",
#   each tool's JSON on its own line inside <tools></tools>, and how to call one;
# - an assistant turn's tool_calls are `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, what the
#   model is told to write and vLLM's `hermes` parser reads (plan/tools.py), so a call re-renders as generated;
# - consecutive role "tool" messages (tool results) make one user turn of <tool_response> blocks;
# - any other role passes through, a system message after the first included (Claude Code's reminders):
#   vLLM's /v1/messages merges inline system messages into the first only for templates that refuse them.
# content may be None (an assistant turn with only tool_calls).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' and messages[0].content %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' }}{%- if messages[0].content %}{{- messages[0].content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content %}{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _marker_data(kind: str) -> dict:
    return {"kind": kind, "version": MODELGEN_VERSION, "config": BUILTIN_MODELS[kind]}


def _is_complete(path: Path, kind: str) -> bool:
    try:
        return json.loads((path / MARKER).read_text()) == _marker_data(kind)
    except (OSError, ValueError):
        return False


def _training_text(n_lines: int = 6000) -> list[str]:
    """Deterministic text mixing prose, numbers, JSON tool output and code, so
    the BPE learns merges for the kinds of text a chat benchmark sends."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ra", "to", "su", "vi", "den", "the", "ing", "er", "an", "or",
                 "st", "qu", "ion", "al", "re", "co"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    words += ("the a of to and is in that it for you with on as are this be what how can please I we "
              "do not have will from by at or if then answer question help system user assistant "
              "tool call function result error value true false null name id data status").split() * 4
    punct = [".", ",", "?", "!", ":", ";", " -", "..."]

    def sentence() -> str:
        ws = [rng.choice(words) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
        return " ".join(ws).capitalize() + rng.choice(punct)

    def tool_json() -> str:
        obj = {rng.choice(words): rng.choice([rng.randint(-999, 99999), round(rng.uniform(-1e3, 1e3), 3),
                                              rng.choice(words), rng.random() < 0.5, None,
                                              [rng.randint(0, 99) for _ in range(rng.randint(0, 4))]])
               for _ in range(rng.randint(1, 6))}
        return json.dumps({"status": rng.choice(["ok", "error"]), "data": obj}, indent=rng.choice([None, 2]))

    def code() -> str:
        f, a, b = rng.choice(words), rng.choice(words), rng.choice(words)
        return rng.choice([
            f"def {f}({a}, {b}=None):\n    if {b} is None:\n        return {a}\n    return {a} + {b}\n",
            f"for {a} in range({rng.randint(1, 100)}):\n    {b}[{a}] = {f}({a}) * {rng.randint(2, 9)}\n",
            f"const {f} = ({a}) => {{ return {a}.{b}; }};\n",
            f"{a} = {{'{b}': {rng.randint(0, 999)}, \"{f}\": [{rng.random():.4f}]}}  # {sentence()}\n",
        ])

    gens = [sentence, sentence, sentence, tool_json, code]
    return [" ".join(rng.choice(gens)() for _ in range(rng.randint(1, 4))) for _ in range(n_lines)]


def _build_tokenizer(vocab_size: int, max_len: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Same normalizer/pre-tokenizer as Qwen2Tokenizer: transformers 5 loads any
    # model_type=qwen2 dir with that class, which rebuilds the pipeline from
    # vocab+merges. Training with it keeps the merges and vLLM's encoding consistent.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # initial_alphabet guarantees all 256 bytes are tokens: any input encodes, nothing is <unk>.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer=trainer)
    # eos = <|im_end|> (end of a chat turn), as in Qwen2 instruct models.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE,
                                   model_max_length=max_len)


def _build(kind: str, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep `pdserve up` output clean

    spec = BUILTIN_MODELS[kind]
    tokenizer = _build_tokenizer(spec["vocab_size"], spec["max_position_embeddings"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(**{**spec, "vocab_size": len(tokenizer)}, tie_word_embeddings=True, dtype="bfloat16",
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"], architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)  # same seed -> same init -> byte-identical safetensors
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                               pad_token_id=config.pad_token_id)
    model.save_pretrained(out)  # safetensors is the default format
    tokenizer.save_pretrained(out)
    for p in [out, *out.iterdir()]:  # mkdtemp/transformers create 0700/0600; let other users read
        p.chmod(0o755 if p.is_dir() else 0o644)


def ensure_model(kind: str, models_dir: Path) -> Path:
    """Return models_dir/<kind>, building it first if it is missing or stale."""
    if kind not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {kind!r} (known: {', '.join(BUILTIN_MODELS)})")
    models_dir = Path(models_dir).expanduser()
    target = models_dir / kind
    if _is_complete(target, kind):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target (same filesystem) and rename into place: a crash
    # leaves only a .tmp dir, never a half model at the real path.
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}.tmp-", dir=models_dir))
    try:
        _build(kind, tmp)
        (tmp / MARKER).write_text(json.dumps(_marker_data(kind), indent=1) + "\n")  # written last
        if target.exists() and not _is_complete(target, kind):
            # Stale (older recipe) or foreign dir: move it aside, then delete.
            stale = Path(tempfile.mkdtemp(prefix=f".{kind}.stale-", dir=models_dir))
            try:
                os.rename(target, stale / kind)
            except OSError:
                pass  # another process moved it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            # Lost a race: the winner's dir is in place (rename onto a non-empty dir fails).
            if not _is_complete(target, kind):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op when the rename succeeded
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in BUILTIN_MODELS:
        print(f"usage: python -m pdserve.engine.models {{{'|'.join(BUILTIN_MODELS)}}} DIR", file=sys.stderr)
        return 2
    print(ensure_model(args[0], Path(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
