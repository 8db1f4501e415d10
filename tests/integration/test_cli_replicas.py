"""`pdserve up` with router.replicas and a managed Redis (Debian's redis-server), fake vLLM servers as
subprocesses: every replica and the Redis supervised and shown by status, one conversation across replicas
and across a SIGKILLed router, `down` stopping the Redis; more than one replica without a shared store is
refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import yaml

from pdserve.launchers.local import marked_processes
from pdserve.observe.routerstats import read_router
from tests.kits.cli_runner import pdserve, status_json, write_config
from tests.kits.ports import consecutive_free, port_free
from tests.kits.waits import wait_for

NAMES = ("prefill-0", "decode-0", "router-0", "router-1", "redis")


def turn(url: str, messages: list, conversation: str) -> tuple[dict, dict]:
    body = {"model": "fake-model", "messages": messages, "max_tokens": 4, "conversation_id": conversation}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def test_replicas_share_a_managed_redis_across_a_router_kill(tmp_path, home):
    port = consecutive_free(4)       # shared, router-0's, router-1's, the managed Redis
    # decode_only off: the fakes' follow-ups are short, and the test counts P's pulls of the shared entries
    path, cfg = write_config(tmp_path, "reps", router={"port": port, "replicas": 2, "store": "managed",
                                                       "decode_only": False})
    up = pdserve("up", str(path))
    assert up.returncode == 0, up.stderr
    try:
        assert up.stdout.strip() == f"http://127.0.0.1:{port}/v1"
        st = status_json("reps")
        assert {p["name"]: p["state"] for p in st["processes"]} == dict.fromkeys(NAMES, "ready")
        assert {p["name"]: p["port"] for p in st["processes"]}["redis"] == port + 3
        own = {f"router-{i}": f"http://127.0.0.1:{port + 1 + i}" for i in range(2)}
        messages = [{"role": "user", "content": "hello " * 200}]
        served = []
        for name in ("router-0", "router-1", "router-0"):
            data, headers = turn(own[name], messages, "c")
            served.append(headers["X-PDServe-Router"])
            messages = messages + [data["choices"][0]["message"], {"role": "user", "content": "more " * 50}]
        assert served == ["router-0", "router-1", "router-0"]
        _, headers = turn(f"http://127.0.0.1:{port}", [{"role": "user", "content": "x"}], "other")
        assert headers["X-PDServe-Router"] in own                 # the shared port reaches a replica
        router = status_json("reps")["router"]
        assert router["reuse_hits"] >= 2, json.dumps(router)
        assert set(router["replicas"]) == set(own)   # the canary may hit too
        assert router["store"] == {"kind": "redis", "up": True}
        text = pdserve("status", "reps").stdout
        assert "reuse store redis: up" in text and "router replicas: router-0" in text

        # SIGKILL router-1 between two turns: restarted by the supervisor (its counters start again at 0),
        # it finds the entry in Redis.
        pid = next(p["pid"] for p in st["processes"] if p["name"] == "router-1")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: next(p for p in status_json("reps")["processes"] if p["name"] == "router-1")
                 ["state"] == "ready" and next(p for p in status_json("reps")["processes"]
                                               if p["name"] == "router-1")["restarts"] == 1, what="router restart")
        _, headers = turn(own["router-1"], messages, "c")
        assert headers["X-PDServe-Router"] == "router-1"
        again = read_router(own["router-1"])
        assert again["turns"] == 1 and again["reuse_hits"] == 1, json.dumps(again)

        # The managed Redis paused (SIGSTOP): requests are still served, status and doctor say the store is
        # unavailable; once it resumes, both say it is back.
        redis = next(p for p in status_json("reps")["processes"] if p["name"] == "redis")
        doctor_ok = pdserve("doctor", str(path))
        assert doctor_ok.returncode == 0 and "ok   router-0 store: reuse store redis answers" in doctor_ok.stdout
        os.kill(redis["pid"], signal.SIGSTOP)
        try:
            started = time.monotonic()
            turn(own["router-0"], [{"role": "user", "content": "while paused"}], "paused")
            assert time.monotonic() - started < 5
            wait_for(lambda: "reuse store redis: UNAVAILABLE" in pdserve("status", "reps").stdout, timeout=10,
                     what="status to show the store down")
            doctor = pdserve("doctor", str(path))
            # router-0 served the paused turn, so its store calls failed; router-1 may not have made one yet
            assert doctor.returncode == 1 and "fail router-0 store: reuse store redis unavailable" in doctor.stdout, \
                doctor.stdout
        finally:
            os.kill(redis["pid"], signal.SIGCONT)
        wait_for(lambda: "reuse store redis: up" in pdserve("status", "reps").stdout, timeout=10, what="store back")
    except BaseException:
        pdserve("down", "reps")
        raise
    redis_pid = next(p["pid"] for p in status_json("reps")["processes"] if p["name"] == "redis")
    assert pdserve("down", "reps").returncode == 0
    root = home / "clusters" / "reps"
    assert [p for n in NAMES for p in marked_processes(f"{root}#{n}")] == []
    assert not os.path.exists(f"/proc/{redis_pid}") or "redis" not in open(f"/proc/{redis_pid}/cmdline").read()
    assert all(port_free(port + i) for i in range(4))


def test_replicas_without_a_shared_store_are_refused_before_anything_starts(tmp_path, home):
    path, cfg = write_config(tmp_path, "alone", router={"port": consecutive_free(3), "replicas": 2})
    res = pdserve("up", str(path))
    assert res.returncode == 2
    assert "router.replicas: 2 routers cannot share the memory store" in res.stderr
    assert not (home / "clusters" / "alone").exists()
    cfg["router"]["store"] = "nosuch://x"
    path.write_text(yaml.safe_dump(cfg))
    res = pdserve("up", str(path))
    assert res.returncode == 2 and "router.store: 'nosuch://x'" in res.stderr
