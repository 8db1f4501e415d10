"""Servers on other hosts, started and watched through the system `ssh` (so ~/.ssh/config, the agent and
ProxyJump apply). Each call sends remote_ops.py's source to the host's Python with one request: nothing of
pdserve is installed or left running there but the servers, which run detached in their own session.

Host keys are checked as the user's ssh config says (never a blanket StrictHostKeyChecking=no); BatchMode
makes a missing key or unknown host an error instead of a prompt. A host that does not answer is
remembered as unreachable for a backoff period, during which every call on it raises HostUnreachable at
once, so a supervisor tick never waits on it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from pdserve.errors import PdserveError
from pdserve.launchers.base import Handle, HostHealth, HostUnreachable, LauncherKind
from pdserve.launchers.remote import program, remote_argv
from pdserve.plan.records import MARKER_ENV, ClusterPlan, HostPlan, ProcessPlan

SSH_ERROR = 255       # ssh's own exit status: could not connect / authenticate / lost the connection


def control_dir() -> Path:
    """ControlMaster sockets: short path (unix sockets allow ~100 bytes), private to this user."""
    path = Path(f"/tmp/pdserve-ssh-{os.getuid()}")
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def control_path(host: HostPlan, cluster: str) -> str:
    """The shared connection's socket, keyed by everything of the host entry that shapes a connection
    (destination, user, port, key, options) and by the cluster: a changed entry never reuses a master
    made with other settings, and `down` of one cluster closes no other's. ssh's %C (a hash of the
    resolved host, port and user) covers what ~/.ssh/config changes."""
    settings = [cluster, host.destination, host.user, host.port, host.identity_file, list(host.ssh_options)]
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    return f"{control_dir()}/{digest}-%C"


def _options(host: HostPlan, cluster: str, connect_timeout: float) -> list[str]:
    argv: list[str] = []
    for opt in host.ssh_options:      # before ours: for each option ssh keeps the first value it is given
        argv += ["-o", opt]
    argv += ["-o", "BatchMode=yes",
             "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
             "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2",
             "-o", "ControlMaster=auto", "-o", "ControlPersist=300",
             "-o", f"ControlPath={control_path(host, cluster)}"]
    if host.user:
        argv += ["-l", host.user]
    if host.port:
        argv += ["-p", str(host.port)]
    if host.identity_file:
        argv += ["-i", os.path.expanduser(host.identity_file)]
    return argv


def ssh_argv(host: HostPlan, remote: list[str], connect_timeout: float, cluster: str) -> list[str]:
    """The one source of every ssh command pdserve runs, and (shlex.join) of every one it prints."""
    return ["ssh", "-T", *_options(host, cluster, connect_timeout), host.destination, "--", shlex.join(remote)]


class SshLauncher:
    """The Launcher for hosts reached over ssh. One per cluster plan: it keeps each host's reachability."""

    kind = LauncherKind.SSH

    def __init__(self, plan: ClusterPlan, *, connect_timeout: float = 5.0, call_timeout: float = 20.0,
                 backoff_max: float = 30.0, base_env: dict[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run):
        self.plan = plan
        self.connect_timeout, self.call_timeout, self.backoff_max = connect_timeout, call_timeout, backoff_max
        self._base_env = base_env
        self._run = run
        self._health: dict[str, HostHealth] = {}

    # -- reachability ------------------------------------------------------------------------------
    def host_health(self, host: str) -> HostHealth:
        """What the launcher last learned of a host (for status: which host and why)."""
        return self._health.setdefault(host, HostHealth())

    def command(self, host_name: str, remote: list[str]) -> list[str]:
        """The ssh argv that runs `remote` on a host, exactly as this launcher runs it."""
        return ssh_argv(self._host(host_name), remote, self.connect_timeout, self.plan.name)

    def shell_command(self, host_name: str, remote: list[str]) -> str:
        """The same command as one shell line, for messages: pasted into a shell it runs exactly that."""
        return shlex.join(self.command(host_name, remote))

    def control_command(self, host_name: str, command: str) -> list[str]:
        """`ssh -O check|exit` on the host's shared connection (the same options, so the same socket)."""
        host = self._host(host_name)
        return ["ssh", "-O", command, *_options(host, self.plan.name, self.connect_timeout), host.destination]

    def close(self) -> list[str]:
        """Close the shared connections to the plan's hosts (`down`); the hosts whose master was open."""
        closed = []
        for host in self.plan.hosts:
            try:
                res = self._run(self.control_command(host.name, "exit"), capture_output=True, timeout=10)
            except subprocess.TimeoutExpired:
                continue
            if res.returncode == 0:
                closed.append(host.name)
        return closed

    def _host(self, host_name: str) -> HostPlan:
        host = self.plan.host(host_name)
        if host is None:
            raise PdserveError(f"host {host_name} is not in the plan's hosts")
        return host

    def _failed(self, host: str, reason: str) -> HostUnreachable:
        h = self.host_health(host)
        if h.reachable:
            h.since = time.time()
        h.reachable, h.reason, h.failures = False, reason, h.failures + 1
        h.retry_at = time.monotonic() + min(self.backoff_max, 2.0 ** h.failures)
        return HostUnreachable(host, reason, self.shell_command(host, ["true"]))

    def call(self, host_name: str, request: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Run one remote_ops request on a host; HostUnreachable when ssh cannot get there in time."""
        host = self._host(host_name)
        argv = self.command(host_name, remote_argv(host.python))
        h = self.host_health(host_name)
        if not h.reachable and time.monotonic() < h.retry_at:
            raise HostUnreachable(host_name, h.reason + " (retrying later)", self.shell_command(host_name, ["true"]))
        limit = timeout or self.call_timeout
        try:
            res = self._run(argv, input=program(request).encode(), capture_output=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise self._failed(host_name, f"no answer over ssh within {limit:g} s") from None
        stderr = res.stderr.decode("utf-8", "replace").strip()
        if res.returncode == SSH_ERROR:
            raise self._failed(host_name, stderr.splitlines()[-1] if stderr else "ssh failed")
        h.reachable, h.failures, h.reason = True, 0, ""
        lines = res.stdout.decode("utf-8", "replace").strip().splitlines()
        if res.returncode != 0 or not lines:
            raise PdserveError(f"{request['op']} on host {host_name} failed: "
                               f"{(stderr.splitlines() or ['exit %d' % res.returncode])[-1]}",
                               hint=f"is {host.python} a Python 3 on {host_name}?")
        return json.loads(lines[-1])

    # -- the Launcher contract -----------------------------------------------------------------------
    def start(self, plan: ProcessPlan, log_path: Path) -> Handle:
        base = os.environ if self._base_env is None else self._base_env
        # Secrets named by env_from travel inside the request on stdin: never on a command line or in a file.
        env = {**plan.env, **{t: base[s] for t, s in plan.env_from.items() if s in base}}
        got = self.call(plan.host_name, {"op": "start", "name": plan.name, "argv": plan.argv, "env": env,
                                         "log_path": str(log_path)})
        return Handle(LauncherKind.SSH, plan.host_name, got["pid"], got["start_time"], plan.env.get(MARKER_ENV, ""),
                      str(log_path))

    def _status(self, handle: Handle) -> dict[str, Any]:
        return self.call(handle.host, {"op": "status", "pid": handle.pid, "start_time": handle.start_time,
                                       "marker": handle.marker}, timeout=self.connect_timeout + 3)

    def is_alive(self, handle: Handle) -> bool:
        """Raises HostUnreachable (promptly: bounded by the connect timeout, then at once while backing
        off) rather than answering False for a process that may well be alive."""
        return bool(self._status(handle)["alive"])

    def exit_code(self, handle: Handle) -> int | None:
        return None     # the leader is the remote init's child, not ours: its exit status is not observable

    def tree_alive(self, handle: Handle) -> int:
        return int(self._status(handle)["tree"])

    def signal(self, handle: Handle, sig: int) -> int:
        return int(self.call(handle.host, {"op": "signal", "pid": handle.pid, "start_time": handle.start_time,
                                           "marker": handle.marker, "sig": int(sig)})["sent"])

    def adopt(self, handle: Handle) -> Handle | None:
        st = self._status(handle)
        return handle if st["alive"] and st["marker"] else None

    def read_log(self, handle: Handle, lines: int) -> list[str]:
        return list(self.call(handle.host, {"op": "log", "log_path": handle.log_path, "lines": lines})["lines"])

    def probe(self, host_name: str, address: str, ports: list[int], efa: bool) -> dict[str, Any]:
        """Preflight facts of one host (software versions, GPUs, EFA, ports already taken there)."""
        return self.call(host_name, {"op": "probe", "address": address, "ports": ports, "efa": efa}, timeout=60)
