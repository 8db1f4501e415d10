"""Two "hosts" on one machine: network namespaces on a bridge, each running a real sshd.

The root namespace holds a bridge (BRIDGE_ADDR); each namespace gets one veth pair (eth0 inside, on the
bridge outside) and its own address, so the router in the root namespace and NIXL between the namespaces
cross real interfaces. Each namespace runs `sshd` on port 2222 with host keys, config and authorized key
made here, and the client trusts exactly those host keys (a known_hosts file of the rig's own, filled by
`ssh-keyscan -p 2222` and passed per host as UserKnownHostsFile). Namespaces share the filesystem and pid space: the same venv runs everywhere.

Needs root, `ip netns` and sshd (Debian openssh-server; scripts/install-test-deps.sh installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.plan.records import ClusterPlan, HostPlan

SUBNET = "10.79.0"            # apart from 10.77.0.x, which people here use by hand
BRIDGE, BRIDGE_ADDR = "pdmhbr0", f"{SUBNET}.1"
SSHD = "/usr/sbin/sshd"
SSH_PORT = 2222           # not 22: every ssh command pdserve runs or prints must carry the host's Port


def missing_capability() -> str | None:
    """Why the rig cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, sshd)"
    if not shutil.which("ip") or not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        return "needs iproute2 and openssh-server (scripts/install-test-deps.sh)"
    probe = subprocess.run(["ip", "netns", "add", "pdmhprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "pdmhprobe"], capture_output=True)
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


@dataclass
class NsHost:
    name: str            # host name in the cluster spec, also the namespace name
    address: str
    sshd_pid: int = 0

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.name, *argv, check=check)

    def pids(self) -> list[int]:
        """Every process whose network namespace is this one."""
        out = sh("ip", "netns", "pids", self.name, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]


@dataclass
class Rig:
    workdir: Path
    hosts: list[NsHost] = field(default_factory=list)

    @property
    def key(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    def host_spec(self, host: NsHost, **extra) -> dict:
        """The cluster.yaml `hosts:` entry for one namespace."""
        return {"name": host.name, "address": host.address, "user": "root", "identity_file": str(self.key),
                "ssh_options": [f"Port={SSH_PORT}", f"UserKnownHostsFile={self.known_hosts}", "IdentitiesOnly=yes",
                                "StrictHostKeyChecking=yes"], **extra}

    def stray_pids(self) -> dict[str, list[int]]:
        """Per namespace, the processes that are not sshd (its listener, or a kept ssh connection)."""
        return {h.name: [p for p in h.pids() if _comm(p) != "sshd"] for h in self.hosts}


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _sshd_config(rig: Rig, host: NsHost) -> Path:
    d = rig.workdir / host.name
    d.mkdir()
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519"))
    cfg = d / "sshd_config"
    cfg.write_text(f"""ListenAddress {host.address}
Port {SSH_PORT}
HostKey {d / 'host_ed25519'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {rig.workdir / 'authorized_keys'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxSessions 50
MaxStartups 50
""")
    return cfg


def _keyscan(rig: Rig, host: NsHost) -> None:
    """The host key into the rig's known_hosts as docs/multinode.md says (`ssh-keyscan -p PORT`: the entry
    then reads `[addr]:port`), after checking it is the key the host was given."""
    scanned = sh("ssh-keyscan", "-p", str(SSH_PORT), "-t", "ed25519", host.address).stdout.strip()
    pub = (rig.workdir / host.name / "host_ed25519.pub").read_text().split()
    assert scanned.split() == [f"[{host.address}]:{SSH_PORT}", pub[0], pub[1]], scanned
    with open(rig.known_hosts, "a") as f:
        f.write(scanned + "\n")


def _wait_port(address: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"sshd on {address}:{port} did not come up")


def _wait_pid_file(path: Path, timeout: float = 10.0) -> int:
    """sshd listens before it writes its pid file: on a loaded machine the port answers first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def teardown(rig: Rig) -> None:
    for host in rig.hosts:
        for pid in host.pids():           # whatever still runs in the namespace: servers, sshd sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sh("ip", "netns", "del", host.name, check=False)
        sh("ip", "link", "del", f"{host.name}v", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def make_rig(workdir: Path, names: tuple[str, ...] = ("pdmha", "pdmhb")) -> Rig:
    rig = Rig(workdir)
    for name in names:                      # leftovers of a killed run would make `ip` fail below
        sh("ip", "netns", "del", name, check=False)
        sh("ip", "link", "del", f"{name}v", check=False)
    sh("ip", "link", "del", BRIDGE, check=False)
    try:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(rig.key))
        (workdir / "authorized_keys").write_text(Path(f"{rig.key}.pub").read_text())
        os.makedirs("/run/sshd", exist_ok=True)      # sshd's privilege-separation directory
        for n, name in enumerate(names):
            host = NsHost(name, f"{SUBNET}.{n + 2}")
            rig.hosts.append(host)
            sh("ip", "netns", "add", name)
            sh("ip", "link", "add", f"{name}v", "type", "veth", "peer", "name", "eth0", "netns", name)
            sh("ip", "link", "set", f"{name}v", "master", BRIDGE, "up")
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
            host.run("ip", "link", "set", "eth0", "up")
            host.run("ip", "link", "set", "lo", "up")
            host.run("ip", "route", "add", "default", "via", BRIDGE_ADDR)
            cfg = _sshd_config(rig, host)
            subprocess.Popen(["ip", "netns", "exec", name, SSHD, "-f", str(cfg)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
            _wait_port(host.address, SSH_PORT)
            host.sshd_pid = _wait_pid_file(workdir / name / "sshd.pid")
            _keyscan(rig, host)
        return rig
    except BaseException:
        teardown(rig)
        raise


def cluster(rig, **host_changes) -> ClusterPlan:
    """A plan with no processes on the rig's hosts (ssh launcher), `host_changes` per host name."""
    hosts = [HostPlan(**{**rig.host_spec(h), "python": sys.executable, **host_changes.get(h.name, {})})
             for h in rig.hosts]
    return ClusterPlan(name="t", processes=[], router_config={}, router_config_path="", builtin_model=None,
                       model_path="", supervisor={}, launcher="ssh", hosts=hosts)
