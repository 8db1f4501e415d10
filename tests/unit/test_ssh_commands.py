"""The ssh commands pdserve runs and prints come from one place: the printed line splits back into the very
argv that runs, the shared connection's socket is keyed by every connection setting, and messages print
commands verbatim. (On the real sshd rig: tests/multihost/test_ssh_commands.py.)"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess

import pytest

from pdserve.launchers.base import HostUnreachable
from pdserve.launchers.ssh import SshLauncher, control_path
from pdserve.plan.records import HostPlan
from tests.unit.test_plan import plan_of
from tests.unit.test_topology import TWO_HOSTS

HOST = HostPlan(name="gpu-left", address="10.66.0.11", user="ubuntu", port=2222, identity_file="/keys/my key",
                ssh_options=["UserKnownHostsFile=/etc/pdserve hosts/[lab]", "IdentitiesOnly=yes"])


def launcher_with(host: HostPlan, run=subprocess.run) -> SshLauncher:
    plan = plan_of(TWO_HOSTS)
    return SshLauncher(dataclasses.replace(plan, hosts=[host]), run=run)


def test_the_printed_command_is_the_argv_that_runs():
    launcher = launcher_with(HOST)
    argv = launcher.command(HOST.name, ["tail", "-F", "/var/log/pd serve/decode-0.log"])
    printed = launcher.shell_command(HOST.name, ["tail", "-F", "/var/log/pd serve/decode-0.log"])
    assert shlex.split(printed) == argv
    assert argv[argv.index("--") - 1] == "10.66.0.11", "the address, not the host's name"
    for part in ("-p", "2222", "-i", "/keys/my key", "UserKnownHostsFile=/etc/pdserve hosts/[lab]"):
        assert part in argv
    assert argv[-1] == "tail -F '/var/log/pd serve/decode-0.log'", "one remote command line, quoted for the remote shell"


@pytest.mark.parametrize("change", [{"address": "10.66.0.12"}, {"ssh_host": "left"}, {"user": "root"},
                                    {"port": 22}, {"identity_file": None},
                                    {"ssh_options": ["UserKnownHostsFile=/dev/null", "IdentitiesOnly=yes"]}])
def test_every_connection_setting_keys_the_shared_connection(change):
    assert control_path(HOST, "c") == control_path(dataclasses.replace(HOST), "c")
    assert control_path(dataclasses.replace(HOST, **change), "c") != control_path(HOST, "c")


def test_clusters_do_not_share_connections_and_the_python_does_not_matter():
    assert control_path(HOST, "a") != control_path(HOST, "b")
    assert control_path(dataclasses.replace(HOST, python="/opt/venv/bin/python"), "a") == control_path(HOST, "a")
    assert control_path(HOST, "a").endswith("-%C") and len(control_path(HOST, "a")) < 90


def test_an_unreachable_host_hint_names_the_connection_pdserve_made():
    def refused(argv, **kw):
        return subprocess.CompletedProcess(argv, 255, b"", b"ssh: connect to host 10.66.0.11 port 2222: Connection refused")

    launcher = launcher_with(HOST, run=refused)
    for _ in range(2):            # the second call fails at once, while backing off: the same hint
        with pytest.raises(HostUnreachable) as err:
            launcher.call(HOST.name, {"op": "log", "log_path": "/x", "lines": 1})
        assert f"`{launcher.shell_command(HOST.name, ['true'])}`" in err.value.hint


def test_down_closes_each_hosts_shared_connection():
    seen = []

    def run(argv, **kw):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0 if argv[-1] == "10.66.0.11" else 255, b"", b"")

    other = dataclasses.replace(HOST, name="gpu-right", address="10.66.0.12")
    launcher = launcher_with(HOST, run=run)
    launcher.plan = dataclasses.replace(launcher.plan, hosts=[HOST, other])
    assert launcher.close() == ["gpu-left"]
    assert [a[:3] for a in seen] == [["ssh", "-O", "exit"]] * 2
    assert f"ControlPath={control_path(other, launcher.plan.name)}" in seen[1]


def test_messages_print_brackets_verbatim(capsys):
    from pdserve.ui import console
    console.error("host [a] is unreachable", "check that `ssh -o UserKnownHostsFile=/k/[lab] 10.0.0.1 -- true` works")
    err = capsys.readouterr().err
    assert "host [a] is unreachable" in err and "UserKnownHostsFile=/k/[lab] 10.0.0.1" in err
