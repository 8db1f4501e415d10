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
from tests.kits.spec_data import TWO_HOSTS, plan_of

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


def remote_cluster(tmp_path, monkeypatch, launcher: str):
    """A cluster folder whose decode-0 runs through `launcher` on host b (state.json and plan.json only)."""
    from pdserve.launchers.base import Handle, LauncherKind
    from pdserve.state.folder import ClusterDir, write_json_atomic
    from pdserve.state.records import ClusterState, Phase, ProcessRecord, ProcState
    from tests.kits.spec_data import with_
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    plan = plan_of(with_("launcher", launcher, with_("name", f"follow-{launcher}", TWO_HOSTS)))
    cdir = ClusterDir(plan.name)
    cdir.logs_dir.mkdir(parents=True)
    write_json_atomic(cdir.plan_path, plan.to_dict())
    log = cdir.log_path("decode-0")
    handle = Handle(LauncherKind(launcher), "b", 42, 1.0, "m", str(log))
    cdir.write_state(ClusterState(plan.name, Phase.RUNNING, "http://127.0.0.1:1", {
        "decode-0": ProcessRecord("decode-0", "decode", ProcState.READY, "10.0.0.2", 8200, handle)}))
    return plan, log


def test_follow_on_a_remote_log_prints_the_ssh_command_that_follows_it(tmp_path, monkeypatch):
    from pdserve.errors import UsageError
    from pdserve.orchestrate import ops
    plan, log = remote_cluster(tmp_path, monkeypatch, "ssh")
    with pytest.raises(UsageError) as err:
        ops.follow_log(plan.name, "decode-0")
    printed = err.value.hint.split("follow it there with: ", 1)[1]
    assert printed == SshLauncher(plan).shell_command("b", ["tail", "-F", str(log)])
    assert plan.host("b").address in shlex.split(printed)


def test_follow_on_a_slurm_step_reads_the_local_log_its_srun_client_writes(tmp_path, monkeypatch):
    from pdserve.orchestrate import ops
    plan, log = remote_cluster(tmp_path, monkeypatch, "slurm")
    log.write_text("")
    import threading
    lines = ops.follow_log(plan.name, "decode-0")      # not an ssh hint: pdserve never runs ssh for Slurm
    writer = threading.Timer(0.5, lambda: log.write_text("step output\n"))
    writer.start()
    try:
        assert next(lines) == "step output"
    finally:
        writer.cancel()
