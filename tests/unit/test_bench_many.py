"""`pdserve bench` on many conversations (issue 32): arm `timer` (D's fixed timer) against `on` (the router's
held-KV budget), the shipped config whose D holds less than the conversations, requests that stall or fail
counted instead of hanging the bench, and the per-arm figures (TTFT p50/p99, failed or over 10 s, reuse rate)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pdserve.bench.arms import arm_config
from pdserve.bench.report import per_arm, percentile, pulled_from_d
from pdserve.bench.run import NO_REPLY, Endpoints, run_arm
from pdserve.bench.workload import Conversation
from pdserve.plan.build import CPU_KV_ENV, build_plan
from pdserve.router.legs.turn import PULLED_HEADER
from pdserve.spec.load import SHIPPED_CONFIGS, load_spec

MANY = SHIPPED_CONFIGS / "bench-cpu-many.yaml"


def test_timer_arm_is_on_with_held_kv_off():
    data = {"name": "c", "prefill": {"vllm_args": ["--enable-prefix-caching"]}, "router": {"held_kv_share": 0.4}}
    on, timer = arm_config(data, "on"), arm_config(data, "timer")
    assert timer["router"]["held_kv"] is False and "held_kv" not in on["router"]     # on keeps the file's value
    assert timer["kv_transfer"] == on["kv_transfer"] == {"bidirectional_kv_xfer": True}
    assert timer["prefill"] == on["prefill"] and "--no-enable-prefix-caching" in timer["prefill"]["vllm_args"]
    assert {k: v for k, v in timer["router"].items() if k != "held_kv"} == on["router"]
    assert timer["name"] == "c-timer" and data["router"] == {"held_kv_share": 0.4}   # the file is not changed


def test_many_config_gives_d_less_kv_than_the_conversations_hold():
    spec = load_spec(MANY)
    plan = build_plan(spec, python="/py", cluster_dir=Path("/h/clusters/t"), models_dir=Path("/h/models"))
    decode = next(p for p in plan.processes if p.role == "decode")
    prefill = next(p for p in plan.processes if p.role == "prefill")
    at = decode.argv.index("--kv-cache-memory-bytes")
    assert int(decode.argv[at + 1]) == 24_000_000
    assert CPU_KV_ENV not in decode.env          # it would override the flag
    assert CPU_KV_ENV in prefill.env and spec.model == "pdserve:tiny"
    for arm in ("timer", "on"):
        cfg = arm_config(yaml.safe_load(MANY.read_text()), arm)
        assert cfg["kv_transfer"]["bidirectional_kv_xfer"] is True
        assert cfg["router"].get("held_kv", True) is (arm == "on")


class FakeRouter(BaseHTTPRequestHandler):
    """Answers chat turns at once, except a prompt whose last message says `stall` (sleeps past the client's
    timeout), `fail` (HTTP 500), or asks for a stream (it trickles). A turn that continues a real reply says it pulled 100 tokens."""
    seen: list[list[dict]] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:        # /metrics: no counters
        self._send(200, b"", {})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeRouter.seen.append(body["messages"])
        last = body["messages"][-1]["content"]
        if body.get("stream"):
            return self._trickle()
        if "stall" in last:
            time.sleep(1.5)
        if "fail" in last:
            return self._send(500, b'{"error": "boom"}', {})
        replies = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        pulled = "100" if replies and replies[-1] != NO_REPLY else "0"
        answer = {"choices": [{"message": {"content": " the of"}}], "usage": {"prompt_tokens": 300,
                                                                              "completion_tokens": 2}}
        self._send(200, json.dumps(answer).encode(), {PULLED_HEADER: pulled, "Server-Timing": "prefill;dur=5.0"})

    def _trickle(self) -> None:
        """A stream that never stops for long: one chunk every 0.2 s for 3 s."""
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(15):
                self.wfile.write(b'data: {"choices": [{"delta": {"content": " the"}}]}\n\n')
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

    def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass                      # the client gave up on a stalled turn


@pytest.fixture
def router_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeRouter.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_stalled_or_failed_turn_is_counted_and_the_bench_goes_on(router_url):
    convs = [Conversation("a", "sys", ["hello", "stall here", "and then"]),
             Conversation("b", None, ["fail now", "again"]),
             Conversation("c", None, ["one", "two"])]
    ep = Endpoints(router_url, [router_url], "m")
    started = time.monotonic()
    rows, _ = run_arm("timer", ep, convs, 4, request_timeout=0.5)
    assert time.monotonic() - started < 5              # the stall cost the timeout, not the server's sleep
    by = {(r["conversation"], r["turn"]): r for r in rows}
    assert len(rows) == 7
    assert by[("a", 2)]["error"] == "timeout" and 0.4 < by[("a", 2)]["latency_s"] < 1.4
    assert by[("b", 1)]["error"] == "http 500" and "ttft_s" not in by[("b", 1)]
    assert not any(r.get("error") for k, r in by.items() if k not in (("a", 2), ("b", 1)))
    # the conversation went on without the reply: no reply in its history, nothing D holds for it
    third = next(m for m in FakeRouter.seen if m[-1]["content"] == "and then")
    assert third[-2] == {"role": "assistant", "content": NO_REPLY} and by[("a", 3)]["reusable_tokens"] == 0
    assert by[("a", 3)]["pulled"] == 0 and by[("c", 2)]["pulled"] == 100
    figures = per_arm(rows)["timer"]
    assert (figures["requests"], figures["answered"], figures["failed"]) == (7, 5, 2)
    assert figures["failed_by_error"] == {"timeout": 1, "http 500": 1} and figures["failed_or_over_10s"] == 2
    # follow-ups: a2 (failed), a3 (after a failure: nothing to pull), b2 (after a failure), c2 (pulled)
    assert (figures["follow_ups"], figures["follow_ups_pulled"], figures["reuse_rate"]) == (4, 1, 0.25)


def test_a_conversation_ends_after_give_up_after_failed_turns(router_url):
    convs = [Conversation("a", None, ["hello", "stall here", "never sent", "nor this"]),
             Conversation("b", None, ["fail now", "fail again", "then fine"])]
    ep = Endpoints(router_url, [router_url], "m")
    rows, _ = run_arm("timer", ep, convs, 4, request_timeout=0.5, give_up_after=1)
    assert [(r["conversation"], r["turn"], r.get("error")) for r in sorted(rows, key=lambda r: (r["conversation"],
                                                                                               r["turn"]))] == [
        ("a", 1, None), ("a", 2, "timeout"), ("b", 1, "http 500")]
    assert not any(m[-1]["content"] in ("never sent", "nor this", "fail again") for m in FakeRouter.seen)
    rows, _ = run_arm("timer", ep, convs[1:], 4, request_timeout=0.5, give_up_after=2)
    assert [r.get("error") for r in rows] == ["http 500", "http 500"]


def test_a_stream_that_trickles_past_the_timeout_fails(router_url):
    ep = Endpoints(router_url, [router_url], "m", stream=True)
    started = time.monotonic()
    rows, _ = run_arm("timer", ep, [Conversation("a", None, ["slow"])], 4, request_timeout=0.5)
    assert rows[0]["error"] == "timeout" and time.monotonic() - started < 2     # no read waited 0.5 s


def row(arm: str, turn: int, ttft: float, latency: float | None = None, pulled: int | None = None,
        **more) -> dict:
    return {"arm": arm, "conversation": "c", "turn": turn, "ttft_s": ttft, "latency_s": latency or ttft,
            "pulled": pulled, **more}


def test_per_arm_p99_slow_requests_and_reuse_rate():
    on = [row("on", 1 + i % 2, (i + 1) / 1000, pulled=100 if i % 2 else None, tokens_pulled=0) for i in range(100)]
    on.append(row("on", 2, 12.0, pulled=0))              # a follow-up over 10 s that recomputed
    timer = [row("timer", 1, 0.2), row("timer", 2, 0.3, pulled=50),
             {"arm": "timer", "conversation": "d", "turn": 2, "error": "timeout", "latency_s": 60.0}]
    figures = per_arm(on + timer)
    assert list(figures) == ["on", "timer"]              # in the order they ran
    f = figures["on"]
    ttft = [float(i + 1) for i in range(100)] + [12000.0]
    assert f["ttft_p50_ms"] == pytest.approx(51.0) and f["ttft_p99_ms"] == pytest.approx(percentile(ttft, 99))
    assert f["ttft_p99_ms"] == pytest.approx(100.0) and f["over_10s"] == 1 and f["failed"] == 0
    assert (f["follow_ups"], f["follow_ups_pulled"], f["reuse_rate"]) == (51, 50, pytest.approx(50 / 51))
    t = figures["timer"]
    assert (t["requests"], t["answered"], t["failed"], t["failed_or_over_10s"]) == (3, 2, 1, 1)
    assert (t["follow_ups"], t["follow_ups_pulled"], t["reuse_rate"]) == (2, 1, 0.5)
    assert t["ttft_p50_ms"] == pytest.approx(250.0) and t["ttft_p99_ms"] == pytest.approx(299.0)


def test_reuse_rate_falls_back_to_p_counters_and_is_unknown_without_either():
    assert pulled_from_d(row("on", 2, 1.0, tokens_pulled=64)) == 64      # no router header (vllm-router)
    assert pulled_from_d(row("on", 2, 1.0, pulled=0, tokens_pulled=64)) == 0      # the router's count wins
    assert pulled_from_d({"arm": "on", "turn": 2, "error": "timeout"}) == 0
    unknown = per_arm([row("vllm-router", 1, 1.0), row("vllm-router", 2, 1.0)])["vllm-router"]
    assert unknown["reuse_rate"] is None and unknown["follow_ups_pulled"] is None and unknown["follow_ups"] == 1
    failed_only = per_arm([{"arm": "x", "turn": 1, "error": "connection", "latency_s": 0.1}])["x"]
    assert failed_only["ttft_p50_ms"] is None and failed_only["ttft_p99_ms"] is None
    assert failed_only["reuse_rate"] is None and failed_only["follow_ups"] == 0


def test_request_timeout_reaches_the_results(tmp_path):
    from pdserve.bench.session import Settings, prepare
    s = prepare(Settings(config=MANY, arms="timer,on", conversations=12, turns=2, out=tmp_path, request_timeout=7))
    assert s.workload.info["request_timeout_s"] == 7 and [a.name for a in s.arms] == ["timer", "on"]
    assert s.arms[0].config["router"]["held_kv"] is False and len(s.workload.convs) == 12
