"""gpu_sharing: mps through `pdserve up` / `down` with the real supervisor: the MPS control daemon (a stand-in,
tests/kits/fake_mps.py, beside a stand-in nvidia-smi that lists one GPU) ready before either server on the GPU
starts, each server its client, the daemon stopped after the servers and nothing left running."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

import yaml

from pdserve.plan.gpu_sharing import PIPE_ENV
from pdserve.launchers.local import marked_processes
from tests.kits.cli_runner import all_markers, pdserve, status_json, write_config
from tests.kits.fake_mps import install_fake_mps
from tests.kits.waits import wait_for


def mps_config(tmp_path: Path, monkeypatch, name: str) -> Path:
    """A fake-server cluster of both servers on GPU 0 with gpu_sharing: mps, the stand-ins first on PATH."""
    bin_dir = tmp_path / "bin"
    install_fake_mps(bin_dir)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in *-L*) echo 'GPU 0: Stand-in GPU (UUID: GPU-0)' ;; esac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    path, cfg = write_config(tmp_path, name, share_gpus=True, gpu_sharing="mps")
    cfg["prefill"]["gpus"] = cfg["decode"]["gpus"] = [0]
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_the_mps_daemon_runs_first_serves_both_servers_and_quits_last(tmp_path, home, monkeypatch):
    up = pdserve("up", str(mps_config(tmp_path, monkeypatch, "mpsed")))
    try:
        assert up.returncode == 0, up.stderr
        procs = {p["name"]: p for p in status_json("mpsed")["processes"]}
        assert procs["mps"]["role"] == "mps" and procs["mps"]["state"] == "ready"
        log = (home / "clusters" / "mpsed" / "logs" / "supervisor.log").read_text()
        started = [line.split(" INFO ")[1].split(" started")[0] for line in log.splitlines() if " started, pid " in line]
        assert started.index("mps") < started.index("prefill-0") < started.index("decode-0"), log
        pipe = None
        for name in ("prefill-0", "decode-0"):
            environ = Path(f"/proc/{procs[name]['pid']}/environ").read_bytes().split(b"\0")
            value = next(v for v in environ if v.startswith(PIPE_ENV.encode() + b"=")).split(b"=", 1)[1].decode()
            assert pipe in (None, value)
            pipe = value
        assert Path(pipe, "control").exists()                     # where the daemon listens
    finally:
        down = pdserve("down", "mpsed")
    assert down.returncode == 0, down.stderr
    # The stop's SIGTERM reaches the whole tree, the daemon too (the script's `quit` then finds it gone).
    assert not Path(pipe, "control").exists()
    root = home / "clusters" / "mpsed"
    assert all_markers(home, "mpsed") == [] and marked_processes(f"{root}#mps") == []


def test_a_sigkilled_mps_leader_leaves_no_daemon_behind_and_is_started_again(tmp_path, home, monkeypatch):
    # The OOM killer takes one pid: the start script the supervisor watches, not the daemon it started.
    assert pdserve("up", str(mps_config(tmp_path, monkeypatch, "mpskill"))).returncode == 0
    try:
        leader = next(p for p in status_json("mpskill")["processes"] if p["name"] == "mps")["pid"]
        [daemon] = psutil.Process(leader).children()
        os.kill(leader, signal.SIGKILL)
        wait_for(lambda: not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE, timeout=30,
                 what="the old daemon gone")
        wait_for(lambda: any(p["name"] == "mps" and p["state"] == "ready" and p["restarts"] == 1
                             for p in status_json("mpskill")["processes"]), timeout=30, what="mps ready again")
        assert len(marked_processes(f"{home / 'clusters' / 'mpskill'}#mps")) == 2      # the new script, its daemon
    finally:
        assert pdserve("down", "mpskill").returncode == 0
    assert marked_processes(f"{home / 'clusters' / 'mpskill'}#mps") == []
