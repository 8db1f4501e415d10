"""What a user copies and what a user changes, against the real sshd rig (port 2222, its own known_hosts):
every ssh command pdserve prints runs as printed, and a changed host entry takes effect on the next `plan`
instead of riding an open shared connection made with the old settings. No vLLM: seconds."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml

from pdserve.launchers.ssh import HostUnreachable, SshLauncher
from pdserve.spec.load import DEFAULT_CONFIG
from tests.kits.vllm_cluster import pdserve
from tests.kits.netns_rig import SSH_PORT, cluster, sh
from tests.kits.ports import free_ports

PROBE = {"op": "log", "log_path": "/nonexistent", "lines": 1}


def in_backticks(hint: str) -> str:
    found = re.search(r"`([^`]+)`", hint)
    assert found, hint
    return found.group(1)


def shell(command: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """A printed command, run the way a user runs it: pasted into a shell."""
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)


def test_the_unreachable_hint_is_the_connection_pdserve_makes(rig):
    host = rig.hosts[0]
    launcher = SshLauncher(cluster(rig), connect_timeout=2, backoff_max=1)
    sh("ip", "link", "set", f"{host.name}v", "down")
    try:
        with pytest.raises(HostUnreachable) as err:
            launcher.call(host.name, PROBE)
        printed = in_backticks(err.value.hint)
        with pytest.raises(HostUnreachable, match="retrying later") as again:
            launcher.call(host.name, PROBE)
        assert in_backticks(again.value.hint) == printed
        assert shell(printed).returncode == 255, "the printed check fails while the host is off, as pdserve did"
    finally:
        sh("ip", "link", "set", f"{host.name}v", "up")
    print("printed:", printed)
    assert host.address in printed and f"Port={SSH_PORT}" in printed
    res = shell(printed)
    assert res.returncode == 0, res.stderr


def plan_config(rig, tmp_path, name: str, change: dict | None = None) -> str:
    a, b = rig.hosts
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    ports = free_ports(4)
    cfg.update(name=name, launcher="ssh",
               hosts=[{**rig.host_spec(h, python=sys.executable), **(change or {}).get(h.name, {})} for h in (a, b)])
    cfg["prefill"].update(host=a.name, port=ports[0], nixl_side_channel_port=ports[1])
    cfg["decode"].update(host=b.name, port=ports[2], nixl_side_channel_port=ports[3])
    path = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_changed_host_entry_takes_effect_on_the_next_plan(rig, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    a = rig.hosts[0]
    good = pdserve("plan", plan_config(rig, tmp_path, "mh-cmds"))
    assert good.returncode == 0, good.stderr
    spec = rig.host_spec(a, python=sys.executable)
    launcher = SshLauncher(dataclasses.replace(cluster(rig), name="mh-cmds"))     # the good entries
    try:
        # An unknown host key (another known_hosts, strict checking): the open master must not answer for it.
        strict = {a.name: {"ssh_options": [o for o in spec["ssh_options"] if not o.startswith("UserKnownHostsFile")]
                           + ["UserKnownHostsFile=/dev/null"]}}
        strict_file = plan_config(rig, tmp_path, "mh-cmds", strict)
        res = pdserve("plan", strict_file)
        assert res.returncode == 1 and "Host key verification failed" in res.stderr, res.stderr
        printed = in_backticks(res.stderr.split("hint:")[-1])
        assert shell(printed).returncode == 255, "the hint's command fails the same way"
        doctor = pdserve("doctor", strict_file)
        assert doctor.returncode == 1 and in_backticks(doctor.stdout.split("hint:")[1]) == printed, doctor.stdout
        # No key at all: refused, although a master made with the key is open.
        res = pdserve("plan", plan_config(rig, tmp_path, "mh-cmds", {a.name: {"identity_file": None}}))
        assert res.returncode == 1 and "Permission denied" in res.stderr, res.stderr
        # The first plan's master was open all along (so the refusals above were not for want of one).
        check = launcher.control_command(a.name, "check")
        assert subprocess.run(check, capture_output=True).returncode == 0, "plan left a shared connection open"
        assert pdserve("plan", plan_config(rig, tmp_path, "mh-cmds")).returncode == 0
    finally:
        closed = launcher.close()
    assert closed == [h.name for h in rig.hosts]
    assert subprocess.run(check, capture_output=True).returncode == 255, "closed"
