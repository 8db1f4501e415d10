"""`pdserve up / status / down` with real processes (fake vLLM servers as subprocesses): supervision,
restarts, failed starts, orphan-free shutdown, exit codes."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.kits.cli_runner import all_markers, pdserve, status_json, write_config
from tests.kits.ports import free_ports, port_free
from tests.kits.waits import wait_for


def test_up_restart_down_leaves_nothing(tmp_path, home):
    path, cfg = write_config(tmp_path, "life", server_args=["--spawn-child"])
    up = pdserve("up", str(path))
    assert up.returncode == 0, up.stderr
    try:
        assert up.stdout.strip() == f"http://127.0.0.1:{cfg['router']['port']}/v1"
        st = status_json("life")
        assert st["phase"] == "running" and {p["state"] for p in st["processes"]} == {"ready"}
        again = pdserve("up", str(path))
        assert again.returncode == 0 and "config is unchanged: nothing to do" in again.stderr, again.stderr

        # SIGKILL the decode API server: the supervisor kills its orphaned child and restarts it.
        decode = next(p for p in st["processes"] if p["name"] == "decode-0")
        children = psutil.Process(decode["pid"]).children(recursive=True)
        assert children, "the fake server should have a child like vLLM's EngineCore"
        os.kill(decode["pid"], signal.SIGKILL)
        wait_for(lambda: next(p for p in status_json("life")["processes"] if p["name"] == "decode-0")
                 ["restarts"] == 1, what="decode restart")
        wait_for(lambda: all(p["state"] == "ready" for p in status_json("life")["processes"]), what="ready again")
        # A zombie is dead (it holds no memory, port or GPU); reaping it is its new parent's business, and where
        # PID 1 does not reap orphans (some containers) it stays a zombie.
        alive = [(c.pid, c.status()) for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"the killed server's child outlived it: {alive}"
    except BaseException:
        pdserve("down", "life")       # a failed check must not leave the cluster running
        raise

    down = pdserve("down", "life")
    assert down.returncode == 0, down.stderr
    assert all_markers(home, "life") == []
    for port in (cfg["prefill"]["port"], cfg["decode"]["port"], cfg["router"]["port"]):
        assert port_free(port)
    assert pdserve("status", "life").returncode == 3


def test_supervisor_killed_then_up_adopts_and_down_cleans(tmp_path, home):
    path, cfg = write_config(tmp_path, "orphan", server_args=["--spawn-child"])
    assert pdserve("up", str(path)).returncode == 0
    before = {p["name"]: p["pid"] for p in status_json("orphan")["processes"]}
    state = json.loads((home / "clusters" / "orphan" / "state.json").read_text())
    os.kill(state["supervisor"]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    st = status_json("orphan")
    assert st["running"] and not st["supervisor_alive"]
    assert "supervisor is gone" in pdserve("status", "orphan").stderr

    # A changed config is not adopted: that would run processes that do not match the file.
    changed = dict(cfg, supervisor={**cfg["supervisor"], "stop_timeout": 6})
    changed["prefill"] = {**cfg["prefill"], "env": {"X": "1"}}
    other = tmp_path / "changed.yaml"
    other.write_text(yaml.safe_dump(changed))
    refused = pdserve("up", str(other))
    assert refused.returncode == 1 and "config changed for prefill-0" in refused.stderr

    again = pdserve("up", str(path))                   # same config: re-attach, no duplicates
    assert again.returncode == 0, again.stderr
    assert "re-attaching to live prefill-0, decode-0, router" in again.stderr
    st = status_json("orphan")
    assert st["supervisor_alive"] and {p["name"]: p["pid"] for p in st["processes"]} == before
    assert {p["state"] for p in st["processes"]} == {"ready"}
    os.kill(before["decode-0"], signal.SIGKILL)         # the new supervisor really supervises
    wait_for(lambda: next(p for p in status_json("orphan")["processes"] if p["name"] == "decode-0")
             ["restarts"] == 1, what="decode restart by the adopting supervisor")
    assert pdserve("down", "orphan").returncode == 0
    assert all_markers(home, "orphan") == []


def test_failed_start_reports_log_and_stops_the_rest(tmp_path, home):
    boom = [sys.executable, "-c", "import sys; print('boom: no such model'); sys.exit(7)"]
    path, _ = write_config(tmp_path, "broken", server_command=boom)
    up = pdserve("up", str(path))
    assert up.returncode == 1
    assert "failed to start" in up.stderr and "exited with code 7" in up.stderr
    assert "boom: no such model" in up.stderr           # the last lines of the failing server's log
    assert all_markers(home, "broken") == []


def test_bad_config_exits_2_and_starts_nothing(tmp_path, home):
    path, cfg = write_config(tmp_path, "bad")
    cfg["decode"]["port"] = cfg["prefill"]["port"]
    path.write_text(yaml.safe_dump(cfg))
    res = pdserve("up", str(path))
    assert res.returncode == 2
    assert f"decode.port: {cfg['prefill']['port']} is already used by prefill[0]" in res.stderr
    assert not (home / "clusters" / "bad").exists()


def test_status_and_down_of_unknown_cluster(home):
    assert pdserve("status", "nope").returncode == 3
    assert pdserve("down", "nope").returncode == 3
    listing = pdserve("status", "--json")
    assert listing.returncode == 0 and json.loads(listing.stdout) == []


def test_plan_json_starts_nothing(tmp_path, home):
    path, cfg = write_config(tmp_path, "planned")
    res = pdserve("plan", str(path), "--json")
    assert res.returncode == 0
    plan = json.loads(res.stdout)
    assert [p["name"] for p in plan["processes"]] == ["prefill-0", "decode-0", "router"]
    assert not (home / "clusters" / "planned").exists()


def test_crash_loop_ends_fatal_with_reason(tmp_path, home):
    # Each server answers /health, then exits 3 s after every start: a crash loop after `up` succeeded.
    path, _ = write_config(tmp_path, "loop", server_args=["--exit-after", "3"],
                           supervisor={"backoff_initial": 0.2, "stop_timeout": 5, "health_interval": 0.5,
                                       "max_restarts": 2, "restart_window": 60})
    assert pdserve("up", str(path)).returncode == 0
    try:
        wait_for(lambda: {p["name"]: p["state"] for p in status_json("loop")["processes"]}["decode-0"] == "fatal",
                 timeout=40, what="decode fatal")
        st = status_json("loop")
        decode = next(p for p in st["processes"] if p["name"] == "decode-0")
        assert decode["restarts"] == 2 and "crash loop" in decode["message"]
        assert st["phase"] == "degraded"
    finally:
        assert pdserve("down", "loop").returncode == 0
    assert all_markers(home, "loop") == []


def test_api_key_from_the_environment_guards_router_and_servers(tmp_path, home, monkeypatch):
    path, cfg = write_config(tmp_path, "keyed", router={"port": free_ports(1)[0], "api_key_env": "PDS_TEST_KEY"})
    monkeypatch.delenv("PDS_TEST_KEY", raising=False)
    missing = pdserve("up", str(path))
    assert missing.returncode == 2 and "router.api_key_env: environment variable PDS_TEST_KEY" in missing.stderr
    assert all_markers(home, "keyed") == []
    monkeypatch.setenv("PDS_TEST_KEY", "k-123")
    try:
        assert pdserve("up", str(path)).returncode == 0
        import urllib.error
        import urllib.request
        router = f"http://127.0.0.1:{cfg['router']['port']}"
        body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(urllib.request.Request(router + "/v1/chat/completions", data=body))
        assert denied.value.code == 401
        # The servers got the key too (VLLM_API_KEY): a client bypassing the router is refused.
        with pytest.raises(urllib.error.HTTPError) as bypass:
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{cfg['decode']['port']}/v1/chat/completions", data=body))
        assert bypass.value.code == 401
        ok = urllib.request.urlopen(urllib.request.Request(
            router + "/v1/chat/completions", data=body,
            headers={"Authorization": "Bearer k-123", "Content-Type": "application/json"}))
        assert ok.status == 200
        st = status_json("keyed")                 # status reads the router's metrics with the key
        assert st["router"]["turns"] == 3          # the start-up canary's two (P->D, then D->P) and ours
        assert st["router"]["backends"]["decode-0"]["healthy"] == 1
        assert "k-123" not in "".join(p.read_text() for p in (home / "clusters" / "keyed").glob("*.json"))
        # D's held-KV routes take the cluster's control token (made by the supervisor, private), not the key
        from pdserve.state.secret import CONTROL_FILE, control_token
        secret = home / "clusters" / "keyed" / CONTROL_FILE
        assert secret.stat().st_mode & 0o777 == 0o600
        held = f"http://127.0.0.1:{cfg['decode']['port']}/pdserve/held"
        with pytest.raises(urllib.error.HTTPError) as not_the_key:
            urllib.request.urlopen(urllib.request.Request(held, headers={"Authorization": "Bearer k-123"}))
        assert not_the_key.value.code == 401
        token = control_token(secret.parent)
        assert urllib.request.urlopen(urllib.request.Request(
            held, headers={"Authorization": f"Bearer {token}"})).status == 200
    finally:
        assert pdserve("down", "keyed").returncode == 0


def test_logs_rotation_and_status_watch(tmp_path, home, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")                        # wide enough for every column
    path, _ = write_config(tmp_path, "logged")
    cfg = yaml.safe_load(path.read_text())
    cfg["supervisor"].update(log_max_mb=0.002, log_keep=1)     # ~2 KB: rotate soon
    path.write_text(yaml.safe_dump(cfg))
    assert pdserve("up", str(path)).returncode == 0
    try:
        log = home / "clusters" / "logged" / "logs" / "decode-0.log"
        with open(log, "a") as f:                               # as if the server had printed them
            f.write("first marker\nsecond marker\nthird marker\n")
        res = pdserve("logs", "logged", "decode-0", "-n", "2")
        assert res.returncode == 0 and res.stdout.splitlines() == ["second marker", "third marker"]
        every = pdserve("logs", "logged", "-n", "1").stdout.splitlines()
        assert "decode-0| third marker" in every and any(line.startswith("router| ") for line in every)
        watch = pdserve("status", "logged", "--watch", "--count", "2")
        assert watch.returncode == 0
        header = next(line for line in watch.stdout.splitlines() if "process" in line)
        assert "cpu" in header and "memory" in header, watch.stdout
        assert "gpu memory" not in header, "no nvidia-smi here: no GPU column"
        assert "MiB" in watch.stdout and "decode-0" in watch.stdout, watch.stdout
        # An nvidia-smi that reports 1500 MiB for decode's pid and some for a stranger's: the GPU column
        # appears and only decode's tree is charged.
        decode_pid = next(p["pid"] for p in status_json("logged")["processes"] if p["name"] == "decode-0")
        fake_bin = tmp_path / "bin"
        fake_bin.mkdir()
        smi = fake_bin / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{decode_pid}, 1500'\necho '999999999, 700'\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
        watch = pdserve("status", "logged", "--watch", "--count", "1")
        lines = watch.stdout.splitlines()
        assert "gpu memory" in next(line for line in lines if "process" in line), watch.stdout
        assert "1.5 GiB" in next(line for line in lines if line.lstrip("│ ").startswith("decode-0")), watch.stdout
        assert "GiB" not in next(line for line in lines if line.lstrip("│ ").startswith("prefill-0")), watch.stdout
        bad = pdserve("logs", "logged", "nope")
        assert bad.returncode == 2 and "processes with logs:" in bad.stderr
        assert pdserve("logs", "ghost").returncode == 3
        with open(log, "a") as f:
            f.write("filler\n" * 400)                           # ~2.8 KB: over the limit
        wait_for(lambda: (log.parent / "decode-0.log.1").exists(), timeout=15, what="rotation")
        assert "third marker" in (log.parent / "decode-0.log.1").read_text()
        assert log.stat().st_size < 2048
    finally:
        assert pdserve("down", "logged").returncode == 0


def test_restart_one_process_or_all_in_order(tmp_path, home):
    path, _ = write_config(tmp_path, "again", server_args=["--spawn-child"])
    assert pdserve("up", str(path)).returncode == 0
    try:
        first = {p["name"]: p["pid"] for p in status_json("again")["processes"]}
        one = pdserve("restart", "again", "decode-0")
        assert one.returncode == 0 and "decode-0 ready again" in one.stderr, one.stderr
        second = {p["name"]: p for p in status_json("again")["processes"]}
        assert second["decode-0"]["pid"] != first["decode-0"] and second["decode-0"]["restarts"] == 1
        assert second["prefill-0"]["pid"] == first["prefill-0"] and second["router"]["pid"] == first["router"]
        assert not psutil.pid_exists(first["decode-0"]) or psutil.Process(first["decode-0"]).status() == "zombie"
        every = pdserve("restart", "again")
        assert every.returncode == 0
        order = [line.split()[1] for line in every.stderr.splitlines() if "ready again" in line]
        assert order == ["prefill-0", "decode-0", "router"]
        third = {p["name"]: p for p in status_json("again")["processes"]}
        assert all(third[n]["pid"] != second[n]["pid"] for n in third) and {p["state"] for p in third.values()} == {"ready"}
        bad = pdserve("restart", "again", "nope")
        assert bad.returncode == 2 and "no process 'nope'" in bad.stderr
        # `up` with a changed config restarts only what changed.
        cfg = yaml.safe_load(path.read_text())
        cfg["decode"]["env"] = {"NEW_SETTING": "1"}
        path.write_text(yaml.safe_dump(cfg))
        update = pdserve("up", str(path))
        assert update.returncode == 0 and "config changed for decode-0" in update.stderr, update.stderr
        fourth = {p["name"]: p for p in status_json("again")["processes"]}
        assert fourth["decode-0"]["pid"] != third["decode-0"]["pid"]
        assert fourth["prefill-0"]["pid"] == third["prefill-0"]["pid"] and fourth["router"]["pid"] == third["router"]["pid"]
        environ = open(f"/proc/{fourth['decode-0']['pid']}/environ", "rb").read()
        assert b"NEW_SETTING=1" in environ
    finally:
        assert pdserve("down", "again").returncode == 0
    assert pdserve("restart", "again").returncode == 3


def test_down_drains_a_stream_in_flight(tmp_path, home):
    path, cfg = write_config(tmp_path, "drain", server_args=["--token-delay", "0.25"])
    assert pdserve("up", str(path)).returncode == 0
    import threading
    import urllib.request
    body = json.dumps({"model": "fake-model", "stream": True, "max_tokens": 10,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    got: list[bytes] = []
    first = threading.Event()

    def client():
        req = urllib.request.Request(f"http://127.0.0.1:{cfg['router']['port']}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            for line in resp:
                if line.strip():
                    got.append(line.strip())
                    first.set()

    t = threading.Thread(target=client)
    t.start()
    assert first.wait(20)
    down = pdserve("down", "drain")                     # while the answer is still streaming (~2.5 s)
    t.join(30)
    assert down.returncode == 0
    assert got[-1] == b"data: [DONE]" and len(got) == 11 and not any(b'"error"' in g for g in got), got
    assert all_markers(home, "drain") == []


def test_up_fails_when_the_canary_moves_no_kv(tmp_path, home):
    path, _ = write_config(tmp_path, "nokv", server_args=["--no-kv-in"])   # D never reads P's blocks
    up = pdserve("up", str(path))
    assert up.returncode == 1
    assert "no KV reached a decode server" in up.stderr, up.stderr
    assert all_markers(home, "nokv") == []


def test_up_fails_when_the_canary_pulls_nothing_back_from_decode(tmp_path, home):
    # D answers without block handles (no bidirectional transfer): P->D works, D->P is never proven
    path, _ = write_config(tmp_path, "nopull", server_args=["--no-bidirectional"])
    up = pdserve("up", str(path))
    assert up.returncode == 1
    assert "no KV came back D->P" in up.stderr and "P read nothing of the first turn" in up.stderr, up.stderr
    assert all_markers(home, "nopull") == []


def test_the_canary_pulls_past_a_threshold_above_its_default_size(tmp_path, home):
    # the canary's default turn is 160 items (~330 tokens here): below 1000 no pull was due, and up passed
    path, _ = write_config(tmp_path, "bigpull", kv_transfer={"kv_recompute_threshold": 1000},
                           router={"port": free_ports(1)[0], "decode_only_max_tokens": 600})
    up = pdserve("up", str(path))
    try:
        assert up.returncode == 0, up.stderr
        said = pdserve("logs", "bigpull", "supervisor", "-n", "400").stdout
        pulled = re.search(r"canary moved .*D->P (\d+) tokens", said)      # the canary `up` waited for
        assert pulled and int(pulled.group(1)) >= 1000, said
        doctor = pdserve("doctor", str(path))
        pulled = re.search(r"D->P (\d+) tokens", doctor.stdout)
        assert doctor.returncode == 0 and pulled and int(pulled.group(1)) >= 1000, doctor.stdout
    finally:
        assert pdserve("down", "bigpull").returncode == 0


def test_up_fails_when_gpu_kv_moves_slower_than_the_floor_and_the_opt_out_lets_it_run(tmp_path, home):
    """An emulated transport (UCX over TCP, 0.6 GB/s on one H200) works, so only its rate shows it."""
    path, cfg = write_config(tmp_path, "slow", server_args=["--xfer-gbps", "0.5"])   # GPU buffers by default
    # The floor is under test, not the cost model: at 0.5 GB/s it may (rightly) judge a pull slower than
    # recomputing on a busy box, and the canary's second turn then reads nothing from D (seen in 3 of 4 runs).
    cfg["router"]["cost_aware"] = False
    path.write_text(yaml.safe_dump(cfg))
    up = pdserve("up", str(path))
    assert up.returncode == 1
    assert "below the floor of 5 GB/s" in up.stderr and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in up.stderr, up.stderr
    assert all_markers(home, "slow") == []
    cfg["kv_transfer"] = {"min_transfer_gbps": 0}
    path.write_text(yaml.safe_dump(cfg))
    assert pdserve("up", str(path)).returncode == 0
    try:
        doctor = pdserve("doctor", str(path), "--min-gbps", "2")
        assert doctor.returncode == 1 and "fail canary" in doctor.stdout and "0.50 GB/s" in doctor.stdout, doctor.stdout
        again = pdserve("doctor", str(path))
        assert again.returncode == 0, again.stdout     # the cluster's own floor: none
    finally:
        assert pdserve("down", "slow").returncode == 0


def test_hung_server_is_restarted(tmp_path, home):
    path, cfg = write_config(tmp_path, "hung", server_args=["--spawn-child"])
    cfg["supervisor"].update(unhealthy_grace=1, stop_timeout=2)
    path.write_text(yaml.safe_dump(cfg))
    assert pdserve("up", str(path)).returncode == 0
    try:
        decode = next(p for p in status_json("hung")["processes"] if p["name"] == "decode-0")
        children = psutil.Process(decode["pid"]).children(recursive=True)
        os.kill(decode["pid"], signal.SIGSTOP)           # alive but answers nothing: hung
        wait_for(lambda: next(p for p in status_json("hung")["processes"] if p["name"] == "decode-0")
                 ["state"] == "unhealthy", timeout=30, what="unhealthy")
        wait_for(lambda: (lambda d: d["restarts"] == 1 and d["state"] == "ready")(
            next(p for p in status_json("hung")["processes"] if p["name"] == "decode-0")), timeout=60,
            what="restart of the hung server")
        assert not psutil.pid_exists(decode["pid"]) or psutil.Process(decode["pid"]).status() == "zombie"
        assert not any(c.is_running() and c.status() != "zombie" for c in children)
    finally:
        assert pdserve("down", "hung").returncode == 0


def test_shell_completion_offers_commands_and_cluster_names(home):
    for name in ("alpha", "beta"):
        (home / "clusters" / name).mkdir(parents=True)
        (home / "clusters" / name / "plan.json").write_text("{}")
    exe = Path(sys.executable).with_name("pdserve")     # the console script, as a shell would run it

    def complete(words: str) -> list[str]:
        env = {**os.environ, "_PDSERVE_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(len(words.split(" ")) - 1)}
        return subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=30).stdout.split()

    assert {"up", "status", "down", "restart", "logs"} <= set(complete("pdserve "))
    assert complete("pdserve status ") == ["alpha", "beta"]
    assert complete("pdserve logs b") == ["beta"]


def test_doctor_checks_the_machine_and_the_running_cluster(tmp_path, home):
    path, _ = write_config(tmp_path, "doc")
    idle = pdserve("doctor", str(path))
    assert idle.returncode == 0 and "live checks skipped" in idle.stdout and "ok   ports:" in idle.stdout
    assert pdserve("up", str(path)).returncode == 0
    try:
        router = status_json("doc")["router"]
        # The start-up canary's second turn found its first by history and pulled it; the first looked up
        # nothing, so no miss is recorded for a conversation no client had.
        assert router["reuse_hits"] == 1 and router["misses_by_reason"] == {}, router
        live = pdserve("doctor", str(path))
        assert live.returncode == 0, live.stdout
        assert "ok   canary: canary moved P->D" in live.stdout and ", D->P " in live.stdout, live.stdout
        assert "decode-0 transfers: P->D reads:" in live.stdout and "prefill-0 transfers: D->P reads:" in live.stdout
    finally:
        assert pdserve("down", "doc").returncode == 0
    cfg = yaml.safe_load(path.read_text())
    cfg["decode"]["cpus"] = [4096]
    path.write_text(yaml.safe_dump(cfg))
    bad = pdserve("doctor", str(path))
    assert bad.returncode == 1 and "fail decode.cpus: CPU 4096 does not exist" in bad.stdout and "hint:" in bad.stdout
    refused = pdserve("up", str(path))
    assert refused.returncode == 2 and "CPU 4096 does not exist" in refused.stderr
    assert pdserve("plan", str(path)).returncode == 1


def test_a_killed_leader_s_markerless_child_is_gone_before_the_restart_and_others_keep_being_served(tmp_path, home):
    """SIGKILL of one pid (what the OOM killer does) leaves a child with no marker in its environment (like
    vLLM's retitled EngineCore): it is found by its process group and killed before the new server starts.
    Meanwhile another server is being stopped slowly (hung: SIGTERM cannot act), and the loop keeps
    restarting the killed one instead of waiting on that stop."""
    path, cfg = write_config(tmp_path, "tree", server_args=["--spawn-child", "--child-without-marker"])
    cfg["supervisor"].update(unhealthy_grace=0.5, stop_timeout=15)
    path.write_text(yaml.safe_dump(cfg))
    assert pdserve("up", str(path)).returncode == 0
    try:
        procs = {p["name"]: p for p in status_json("tree")["processes"]}
        prefill = psutil.Process(procs["prefill-0"]["pid"])
        child = prefill.children()[0]
        assert b"PDSERVE_PROCESS" not in Path(f"/proc/{child.pid}/environ").read_bytes()
        os.kill(procs["decode-0"]["pid"], signal.SIGSTOP)     # hung: its stop will take the full 15 s
        wait_for(lambda: {p["name"]: p for p in status_json("tree")["processes"]}["decode-0"]["state"]
                 == "stopping", timeout=30, what="decode stopping")
        os.kill(prefill.pid, signal.SIGKILL)                   # one pid, not the group
        wait_for(lambda: (lambda p: p["restarts"] == 1 and p["state"] == "ready")(
            {p["name"]: p for p in status_json("tree")["processes"]}["prefill-0"]), timeout=12,
            what="prefill restarted while decode is still being stopped")
        st = status_json("tree")
        now = {p["name"]: p for p in st["processes"]}
        assert now["decode-0"]["state"] == "stopping"
        assert st["phase"] == "degraded"                       # no ready decode server: `status --json` says so
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, "the orphan outlived its leader"
        new_start = psutil.Process(now["prefill-0"]["pid"]).create_time()
        assert new_start >= prefill.create_time()
        # Proven; resumed, decode acts on its pending SIGTERM, so `down` need not wait out the 15 s stop.
        os.kill(procs["decode-0"]["pid"], signal.SIGCONT)
    finally:
        down = pdserve("down", "tree")
        assert down.returncode == 0, down.stderr
        assert all_markers(home, "tree") == []
