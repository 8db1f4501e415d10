"""The memory reuse store across `pdserve restart NAME router` (fake vLLM servers): the drained router writes
its entries to the cluster folder, the next one reads them back, and the conversation's next turn pulls from D
instead of recomputing; a corrupt file left there is ignored with a log line (issue 42)."""

from __future__ import annotations

import json
import re
import urllib.request

from tests.kits.cli_runner import pdserve, status_json, write_config

REUSE_FILE = "reuse-store.json"       # pdserve.plan.routers.REUSE_FILE


def _turn(port: int, history: list, text: str) -> int:
    """One chat turn of the conversation; the tokens P pulled from D for it."""
    history.append({"role": "user", "content": text})
    body = json.dumps({"model": "fake-model", "messages": history, "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        data = json.load(resp)
        pulled = int(resp.headers.get("X-PDServe-Pulled-Tokens") or 0)
    history.append(data["choices"][0]["message"])
    return pulled


def _words(tag: str, n: int = 150) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_restart_router_keeps_the_conversations_and_a_corrupt_file_is_ignored(tmp_path, home):
    path, cfg = write_config(tmp_path, "keep")
    port = cfg["router"]["port"]
    assert pdserve("up", str(path)).returncode == 0
    try:
        kept: list = []
        _turn(port, kept, _words("a"))
        again = pdserve("restart", "keep", "router")
        assert again.returncode == 0, again.stderr
        log = pdserve("logs", "keep", "router", "-n", "400").stdout
        # ours and the start-up canary's conversation: every one written comes back (D still holds them all)
        written = re.search(r"reuse store: (\d+) conversation\(s\) written to", log)
        restored = re.search(r"reuse store: restored (\d+) conversation\(s\)", log)
        assert written and restored and int(written[1]) >= 1 and restored[1] == written[1], log
        # long enough for P (a short follow-up is served on D alone): P pulls from D, the entry came back
        assert _turn(port, kept, _words("n", 300)) > 0
    finally:
        assert pdserve("down", "keep").returncode == 0
    # `down` drained the router: the file is there for the next `up`; a corrupt one must not stop that `up`.
    kept_file = home / "clusters" / "keep" / REUSE_FILE
    assert kept_file.exists()
    kept_file.write_bytes(b'{"format": "pdserve-reuse-store", "entries": [')
    try:
        up = pdserve("up", str(path))
        assert up.returncode == 0, up.stderr
        assert status_json("keep")["phase"] == "running"
        log = pdserve("logs", "keep", "router", "-n", "400").stdout
        assert f"reuse store file {kept_file} ignored (nothing restored)" in log, log
        assert not kept_file.exists()
        assert _turn(port, [], _words("c")) == 0      # served as a first turn
    finally:
        assert pdserve("down", "keep").returncode == 0
