"""Multi-turn agentic workloads whose context grows every turn, deterministic for a seed, and the input
formats of vLLM's benchmarks/multi_turn (a list of {id, messages}; a `generate_conversations` config).

Only the user side of a conversation is fixed: each turn's assistant message is the model's own reply,
sent back with the history, as a real client does (that is what makes D's KV reusable).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A small vocabulary of common words: random-weight models tokenize any text, and real models see
# text that looks like prose, tool output and logs.
WORDS = ("the of and to in is for that on with as was by at from this be are or an it which not have "
         "has but were can all their more one would there been if will so about than its other into time "
         "only new some could these two may first then do any like my now over such our man me even most "
         "made after also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see men work "
         "long get here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three").split()


@dataclass
class Conversation:
    id: str
    system: str | None
    user_turns: list[str]
    max_tokens: list[int] = field(default_factory=list)   # reply length per turn (empty: the bench default)

    def messages_for(self, history: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
        base = [{"role": "system", "content": self.system}] if self.system and not history else []
        return [*base, *history, {"role": "user", "content": self.user_turns[turn]}]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def generate(seed: int = 0, conversations: int = 4, turns: int = 8, system_words: int = 600,
             user_words: int = 60, tool_words: int = 450) -> list[Conversation]:
    """Agentic conversations: a long system prompt (tools, instructions), then turns that alternate a
    short user request with a large tool result (file contents, search hits, logs) that the agent must
    read, so the context grows by roughly `user_words` or `tool_words` per turn plus the reply."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        system = f"You are agent {c}. Tools: read_file, search, run. " + _text(rng, system_words)
        user_turns = []
        for t in range(turns):
            if t % 2 == 0:
                user_turns.append(f"Task step {t}: " + _text(rng, user_words))
            else:
                user_turns.append(f"Tool result for step {t - 1}:\n" + _text(rng, tool_words))
        out.append(Conversation(f"conv-{seed}-{c}", system, user_turns))
    return out


def from_messages(items: list[dict[str, Any]]) -> list[Conversation]:
    """vLLM's conversation list: [{"id": ..., "messages": [{"role", "content"}, ...]}]. User messages
    become turns; the file's assistant messages are dropped (the model answers for itself)."""
    out = []
    for i, item in enumerate(items):
        messages = item.get("messages") or []
        system = next((m.get("content") for m in messages if m.get("role") == "system"), None)
        users = [str(m.get("content") or "") for m in messages if m.get("role") == "user"]
        if users:
            out.append(Conversation(str(item.get("id", f"conv-{i}")), system, users))
    return out


def _draw(rng: random.Random, spec: Any, default: int) -> int:
    """One value from a vLLM bench_dataset distribution spec (constant, uniform; others by their mean)."""
    if spec is None:
        return default
    if isinstance(spec, (int, float)):
        return int(spec)
    kind = spec.get("distribution", "constant")
    if kind == "constant":
        return int(spec.get("value", default))
    if kind == "uniform":
        return rng.randint(int(spec.get("min", 1)), int(spec.get("max", spec.get("min", 1))))
    for key in ("mean", "average", "value", "max"):
        if key in spec:
            return max(1, int(spec[key]))
    return default


def from_generate_config(cfg: dict[str, Any], seed: int = 0) -> list[Conversation]:
    """vLLM's `generate_conversations` config. `num_turns` counts user and assistant messages, as there;
    `common_prefix_num_tokens` (shared by all) and `prefix_num_tokens` (per conversation) open the first
    turn; `num_tokens` sizes each user turn; `prompt_output.num_tokens` sizes the replies. Sizes are in
    words here (vLLM counts tokens with the model's tokenizer, which pdserve does not load)."""
    rng = random.Random(seed)
    prompt_in = cfg.get("prompt_input") or {}
    prompt_out = cfg.get("prompt_output") or {}
    common = _text(rng, _draw(rng, prompt_in.get("common_prefix_num_tokens"), 0))
    out = []
    for c in range(int(cfg.get("num_conversations", 1))):
        n_messages = max(2, _draw(rng, prompt_in.get("num_turns"), 2))
        prefix = _text(rng, _draw(rng, prompt_in.get("prefix_num_tokens"), 0))
        turns = [_text(rng, _draw(rng, prompt_in.get("num_tokens"), 50)) for _ in range((n_messages + 1) // 2)]
        turns[0] = " ".join(x for x in (common, prefix, turns[0]) if x)
        replies = [_draw(rng, prompt_out.get("num_tokens"), 32) for _ in turns]
        out.append(Conversation(f"gen-{c}", None, turns, replies))
    return out


def load(path: str | Path, seed: int = 0) -> list[Conversation]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and data.get("filetype") == "generate_conversations":
        return from_generate_config(data, seed)
    if isinstance(data, list):
        return from_messages(data)
    raise ValueError(f"{path}: expected a list of {{id, messages}} or a generate_conversations config")
