"""The one factory the supervisor and `down` get launchers from."""

from __future__ import annotations

import pytest

from pdserve.errors import PdserveError
from pdserve.launchers import launcher_for, launcher_for_handle
from pdserve.launchers.base import Handle, LauncherKind
from pdserve.launchers.local import LocalLauncher
from pdserve.launchers.slurm import SlurmLauncher
from pdserve.launchers.ssh import SshLauncher
from tests.kits.spec_data import GOOD, TWO_HOSTS, plan_of, with_


def test_local_clusters_and_the_router_get_the_one_local_launcher():
    plan = plan_of(GOOD)
    local = {id(launcher_for(plan, p)) for p in plan.processes}
    remote_plan = plan_of(TWO_HOSTS)
    assert len(local) == 1 and isinstance(launcher_for(plan, plan.router), LocalLauncher)
    assert launcher_for(remote_plan, remote_plan.router) is launcher_for(plan, plan.router)


def test_remote_processes_get_their_clusters_launcher_and_handles_find_it_again():
    plan = plan_of(TWO_HOSTS)
    ssh = launcher_for(plan, plan.by_name("decode-0"))
    assert isinstance(ssh, SshLauncher) and ssh is launcher_for(plan, plan.by_name("prefill-0"))
    handle = Handle(LauncherKind.SSH, "b", 42, 1.0, "m", "/l")
    assert launcher_for_handle(plan, handle) is ssh       # keeps what it learned of each host
    slurm = plan_of(with_("launcher", "slurm", with_("name", "s", TWO_HOSTS)))
    assert isinstance(launcher_for(slurm, slurm.by_name("decode-0")), SlurmLauncher)
    assert isinstance(launcher_for_handle(None, Handle(LauncherKind.LOCAL, "local", 1, 1.0, "m", "/l")), LocalLauncher)
    with pytest.raises(PdserveError, match="needs the cluster's plan.json"):
        launcher_for_handle(None, handle)


def test_unreachable_hosts_collects_what_the_launchers_learned():
    import subprocess
    from pdserve.launchers import unreachable_hosts
    from pdserve.launchers.ssh import HostUnreachable
    plan = plan_of(with_("name", "unreach", TWO_HOSTS))
    ssh = launcher_for(plan, plan.by_name("decode-0"))
    ssh._run = lambda *a, **k: subprocess.CompletedProcess(a, 255, b"", b"ssh: connect to host 10.77.0.3 port 22: No route to host")
    assert unreachable_hosts(plan) == {}
    with pytest.raises(HostUnreachable, match="No route to host"):
        ssh.is_alive(Handle(LauncherKind.SSH, "b", 1, 1.0, "m", "/l"))
    assert unreachable_hosts(plan) == {"b": "ssh: connect to host 10.77.0.3 port 22: No route to host"}
