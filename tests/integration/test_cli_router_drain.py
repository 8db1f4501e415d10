"""`pdserve restart NAME router` while a turn is in flight (fake vLLM servers): the router drains it for
router.drain_timeout whatever supervisor.stop_timeout says, and past the limit cuts it with a log line and a
count, never a silent SIGKILL (issue 42)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import yaml

from tests.kits.cli_runner import pdserve, write_config


def _stream(port: int, max_tokens: int, got: list[bytes], first: threading.Event) -> threading.Thread:
    body = json.dumps({"model": "fake-model", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "a long agent turn"}]}).encode()

    def client():
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                for line in resp:
                    if line.strip():
                        got.append(line.strip())
                        first.set()
        except OSError as err:                  # a cut stream ends early: what came is in `got`
            got.append(f"error: {err}".encode())
        first.set()

    t = threading.Thread(target=client)
    t.start()
    return t


def test_restart_router_drains_a_turn_longer_than_stop_timeout(tmp_path, home):
    # 24 tokens at 0.25 s: a 6 s turn, three times the supervisor's stop_timeout
    path, cfg = write_config(tmp_path, "longturn", server_args=["--token-delay", "0.25"],
                             supervisor={"backoff_initial": 0.2, "stop_timeout": 2, "health_interval": 0.5})
    assert pdserve("up", str(path)).returncode == 0
    try:
        got: list[bytes] = []
        first = threading.Event()
        t = _stream(cfg["router"]["port"], 24, got, first)
        assert first.wait(20)
        started = time.monotonic()
        again = pdserve("restart", "longturn", "router")
        t.join(60)
        assert again.returncode == 0, again.stderr
        assert got[-1] == b"data: [DONE]" and len(got) == 25, got
        assert time.monotonic() - started > 3        # it waited for the turn, not for stop_timeout
        log = pdserve("logs", "longturn", "router", "-n", "400").stdout
        assert "draining: 1 turn(s) in flight" in log and "0 turn(s) cut" in log, log
    finally:
        assert pdserve("down", "longturn").returncode == 0


def test_restart_router_past_drain_timeout_cuts_the_turn_with_a_log_line(tmp_path, home):
    path, cfg = write_config(tmp_path, "cutturn", server_args=["--token-delay", "0.25"])
    cfg["router"]["drain_timeout"] = 1
    path.write_text(yaml.safe_dump(cfg))
    assert pdserve("up", str(path)).returncode == 0
    try:
        got: list[bytes] = []
        first = threading.Event()
        t = _stream(cfg["router"]["port"], 40, got, first)
        assert first.wait(20)
        again = pdserve("restart", "cutturn", "router")
        t.join(60)
        assert again.returncode == 0, again.stderr
        assert b"data: [DONE]" not in got and len(got) < 40, got
        log = pdserve("logs", "cutturn", "router", "-n", "400").stdout
        cut = [line for line in log.splitlines() if "drain: cut turn pdserve-" in line]
        assert len(cut) == 1 and "(api chat, conversation " in cut[0] and "router.drain_timeout 1s" in cut[0], log
        assert "1 turn(s) cut" in log, log
    finally:
        assert pdserve("down", "cutturn").returncode == 0
