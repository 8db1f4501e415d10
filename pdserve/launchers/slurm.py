"""Servers as Slurm job steps inside an existing allocation: each one `srun --overlap --nodes=1 --ntasks=1
--nodelist=<host>` step, named after the cluster and process, so `down` finds it by name and `scancel`s it
even when the supervisor (and the srun client it started) died. Slurm's own process tracking does the
cleanup: a cancelled step takes its processes with it.

The srun client runs on this machine as the leader of its own session, its output (the step's, forwarded
by Slurm) appended to the local log; it lives exactly as long as the step.
"""

from __future__ import annotations

import json
import os
import signal as signals
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pdserve.errors import PdserveError
from pdserve.launchers.base import Handle, HostHealth, LauncherKind
from pdserve.launchers.local import LocalLauncher
from pdserve.launchers.remote import program, remote_argv
from pdserve.plan.records import LOCAL_HOST, MARKER_ENV, ClusterPlan, ProcessPlan
from pdserve.observe.logfiles import last_lines


@dataclass(frozen=True)
class SlurmSettings:
    """The plan's settings for this launcher (the spec's `slurm:` section)."""
    job_id: str | None = None          # the allocation srun steps join (default: $SLURM_JOB_ID)
    srun_args: list[str] = field(default_factory=list)


def step_name(cluster: str, process: str) -> str:
    return f"pdserve.{cluster}.{process}"


class SlurmLauncher:
    kind = LauncherKind.SLURM

    @property
    def settings(self) -> SlurmSettings:
        return SlurmSettings(**self.plan.launcher_settings)

    def __init__(self, plan: ClusterPlan, *, base_env: dict[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run):
        self.plan = plan
        self._base_env = base_env
        self._run = run
        self._clients = LocalLauncher(base_env)      # the local srun clients

    def job_id(self) -> str:
        base = os.environ if self._base_env is None else self._base_env
        job = self.settings.job_id or base.get("SLURM_JOB_ID")
        if not job:
            raise PdserveError("launcher slurm runs inside an allocation, but no job id is known",
                               hint="run pdserve under salloc/sbatch, or set slurm.job_id in the config")
        return job

    def _srun(self, host: str, name: str, argv: list[str]) -> list[str]:
        return ["srun", "--overlap", f"--jobid={self.job_id()}", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                f"--job-name={name}", "--export=ALL", "--kill-on-bad-exit=1", *self.settings.srun_args, *argv]

    def _slurm(self, *argv: str) -> subprocess.CompletedProcess:
        try:
            return self._run(list(argv), capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            raise PdserveError(f"{argv[0]} did not answer in 30 s", hint="is slurmctld reachable? (`sinfo`)") from None

    def steps(self, handle: Handle) -> list[str]:
        """Ids (job.step) of the running steps named after the handle's process."""
        res = self._slurm("squeue", "--steps", "--noheader", f"--jobs={handle.job_id}", "--format=%i %j")
        if res.returncode != 0:
            raise PdserveError(f"squeue failed: {res.stderr.strip()}", hint="is the allocation still running?")
        return [sid for sid, name in (ln.split(None, 1) for ln in res.stdout.splitlines() if " " in ln.strip())
                if name.strip() == handle.step_name]

    def start(self, plan: ProcessPlan, log_path: Path) -> Handle:
        name = step_name(self.plan.name, plan.name)
        client = ProcessPlan(**{**vars(plan), "argv": self._srun(plan.host_name, name, plan.argv)})
        local = self._clients.start(client, log_path)
        return Handle(LauncherKind.SLURM, plan.host_name, local.pid, local.start_time, plan.env.get(MARKER_ENV, ""),
                      str(log_path), job_id=self.job_id(), step_name=name)

    def _client(self, handle: Handle) -> Handle:
        return Handle(LauncherKind.LOCAL, LOCAL_HOST, handle.pid, handle.start_time, handle.marker, handle.log_path)

    def is_alive(self, handle: Handle) -> bool:
        """Its srun client runs (a step just asked for is not in squeue yet: right after a start it was
        taken for dead and cancelled, once in CI), or its step does (the client may be gone with a dead
        supervisor's machine session)."""
        return self._clients.is_alive(self._client(handle)) or bool(self.steps(handle))

    def exit_code(self, handle: Handle) -> int | None:
        return self._clients.exit_code(self._client(handle))

    def tree_alive(self, handle: Handle) -> int:
        return len(self.steps(handle)) + self._clients.tree_alive(self._client(handle))

    def signal(self, handle: Handle, sig: int) -> int:
        sent = 0
        for sid in self.steps(handle):
            # SIGKILL: cancel the step (Slurm kills all its processes); else deliver the signal to its tasks.
            argv = ["scancel", sid] if sig == signals.SIGKILL else ["scancel", f"--signal={int(sig)}", sid]
            sent += self._slurm(*argv).returncode == 0
        if sig == signals.SIGKILL:
            sent += self._clients.signal(self._client(handle), sig)
        return sent

    def adopt(self, handle: Handle) -> Handle | None:
        return handle if handle.job_id and self.steps(handle) else None

    def read_log(self, handle: Handle, lines: int) -> list[str]:
        return last_lines(Path(handle.log_path), lines)

    def host_health(self, host: str) -> HostHealth:
        """Slurm reaches its nodes itself: a node is never marked unreachable here."""
        return HostHealth()

    def probe(self, host_name: str, address: str, ports: list[int], efa: bool) -> dict[str, Any]:
        """Preflight facts of one node, gathered by a short step on it."""
        request = {"op": "probe", "address": address, "ports": ports, "efa": efa}
        host = self.plan.host(host_name)
        argv = self._srun(host_name, step_name(self.plan.name, "preflight"), remote_argv(host.python if host else None))
        try:
            res = self._run(argv, input=program(request), capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise PdserveError(f"preflight step on {host_name} did not finish in 120 s", hint="`sinfo`, `squeue`") from None
        lines = res.stdout.strip().splitlines()
        if res.returncode != 0 or not lines:
            raise PdserveError(f"preflight step on {host_name} failed: {res.stderr.strip()[-300:]}",
                               hint="is the node in the allocation (`squeue -j $SLURM_JOB_ID`)?")
        return json.loads(lines[-1])
