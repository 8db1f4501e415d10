"""`pdserve up` applying router changes to a running cluster (fake vLLM servers): the API key added, its value
changed, removed, and a plain router setting. Each must restart what it changes, never crash-loop the router,
and be in force afterwards (issue 42)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import yaml

from tests.kits.cli_runner import pdserve, status_json, write_config

BODY = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _ask(router: str, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(router + "/v1/chat/completions", data=BODY,
                                                           headers=headers), timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _apply(path, cfg: dict) -> str:
    path.write_text(yaml.safe_dump(cfg))
    up = pdserve("up", str(path))
    assert up.returncode == 0, up.stderr
    st = status_json(cfg["name"])
    assert st["phase"] == "running" and {p["state"] for p in st["processes"]} == {"ready"}, st
    return up.stderr


def _pids(name: str) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in status_json(name)["processes"]}


def test_up_adds_changes_and_removes_the_api_key_and_a_router_setting(tmp_path, home, monkeypatch):
    monkeypatch.delenv("PDS_CHANGE_KEY", raising=False)
    path, cfg = write_config(tmp_path, "rekey")
    router = f"http://127.0.0.1:{cfg['router']['port']}"
    assert pdserve("up", str(path)).returncode == 0
    try:
        assert _ask(router) == 200
        # The key added, exported only now: the supervisor started without it, yet the router must get it.
        monkeypatch.setenv("PDS_CHANGE_KEY", "k-first")
        cfg["router"]["api_key_env"] = "PDS_CHANGE_KEY"
        added = _apply(path, cfg)
        assert "config changed for" in added and "router" in added, added
        assert _ask(router) == 401 and _ask(router, "k-first") == 200
        assert _ask(f"http://127.0.0.1:{cfg['decode']['port']}") == 401        # the servers got it too
        # The same name, another value: the plan is the same, the key in force is not.
        monkeypatch.setenv("PDS_CHANGE_KEY", "k-second")
        before = _pids("rekey")
        changed = _apply(path, cfg)
        assert "config changed for" in changed, changed
        assert _pids("rekey")["router"] != before["router"]
        assert _ask(router, "k-first") == 401 and _ask(router, "k-second") == 200
        assert "k-second" not in "".join(p.read_text() for p in (home / "clusters" / "rekey").rglob("*.json"))
        # Nothing changed: nothing restarted.
        assert "nothing to do" in _apply(path, cfg)
        # The key removed.
        del cfg["router"]["api_key_env"]
        _apply(path, cfg)
        assert _ask(router) == 200
        # A router setting: only the router restarts, and the setting is in force.
        before = _pids("rekey")
        cfg["router"]["max_body_mb"] = 0.00005       # 52 bytes: BODY is larger
        assert "config changed for router" in _apply(path, cfg)
        after = _pids("rekey")
        assert after["router"] != before["router"] and after["decode-0"] == before["decode-0"]
        assert _ask(router) == 413
        assert all(p["state"] == "ready" for p in status_json("rekey")["processes"])
    finally:
        assert pdserve("down", "rekey").returncode == 0
