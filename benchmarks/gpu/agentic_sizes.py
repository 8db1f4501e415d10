"""Prompt sizes of an agentic workload file with a given tokenizer, before spending GPU time on it: each main
session's last prompt and the longest prompt of every chain (sub-agents included), with replies of --reply
tokens. A prompt over the servers' --max-model-len would fail its request.
  python3 agentic_sizes.py WORKLOAD.json TOKENIZER_DIR [--reply 32] [--limit 131072]"""
import argparse
import json

from transformers import AutoTokenizer

from pdserve.bench.agentic import from_config

a = argparse.ArgumentParser()
a.add_argument("workload")
a.add_argument("tokenizer")
a.add_argument("--reply", type=int, default=32)
a.add_argument("--limit", type=int, default=131072)
args = a.parse_args()
wl = from_config(json.load(open(args.workload)))
tok = AutoTokenizer.from_pretrained(args.tokenizer)
count = {}


def tokens(text: str) -> int:
    if text not in count:
        count[text] = len(tok(text)["input_ids"])
    return count[text]


OVERHEAD = 5         # ChatML's role markers per message
reply = args.reply + OVERHEAD
rows = []


def walk(chain, start: int, root: str) -> None:
    size = start
    for t, turn in enumerate(chain.turns):
        size += tokens(turn.text) + OVERHEAD
        rows.append((root, chain.agent or "main", t + 1, size))
        size += reply
        for agent in chain.forks.get(t) or []:
            walk(agent, size, root)


preamble = tokens(wl.preamble) + OVERHEAD
for s in wl.sessions:
    walk(s, preamble, s.id)
mains = [max(r[3] for r in rows if r[0] == s.id and r[1] == "main") for s in wl.sessions]
print(f"preamble {preamble} tokens; requests {len(rows)} ({sum(r[1] != 'main' for r in rows)} sub-agent)")
print("main sessions' last prompt:", mains)
print("longest prompt of any chain:", max(r[3] for r in rows), "limit", args.limit)
print("prompts >= 64k:", sum(r[3] >= 65536 for r in rows), "over the limit:", sum(r[3] > args.limit for r in rows))
