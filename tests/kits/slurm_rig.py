"""A real one-node Slurm on this machine, started by the tests: munged, slurmctld and slurmd (Debian's
slurm-wlm and munge), every file and socket in a folder of the rig's own (SLURM_CONF points there), the
node at 127.0.0.1, process tracking by linuxproc and no task plugin (no cgroups needed). An sbatch job
holds the allocation the srun steps join, as `salloc`/`sbatch` would on a real cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.kits.waits import wait_for

NODE = "pdnode"


def missing_capability() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd, munged)"
    for tool in ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scancel"):
        if not shutil.which(tool):
            return f"needs {tool} (Debian slurm-wlm; scripts/install-test-deps.sh)"
    if not (shutil.which("munged") or os.path.exists("/usr/sbin/munged")):
        return "needs munged (Debian munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]           # SLURM_CONF for every Slurm command
    job_id: str = ""
    pids: tuple[int, ...] = ()
    daemons: tuple[subprocess.Popen, ...] = ()

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              check=check, timeout=60)

    def steps(self) -> list[str]:
        """Names of the allocation's running steps (the batch step aside)."""
        out = self.run("squeue", "-s", "-h", "-j", self.job_id, "-o", "%j", check=False).stdout.split()
        return [n for n in out if n not in ("batch", "extern")]


def _daemon(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def start_slurm(root: Path) -> Slurm:
    munged = shutil.which("munged") or "/usr/sbin/munged"
    for d in ("state", "spool", "munge"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = root / "munge" / "munge.sock"
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=pdserve-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=pdtest Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
""")
    env = {"SLURM_CONF": str(conf)}
    procs = []
    try:
        procs.append(_daemon([munged, "-F", "--force", f"--socket={sock}", f"--key-file={key}",
                              f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={root / 'munge' / 'munged.log'}",
                              f"--seed-file={root / 'munge' / 'seed'}"], env, root / "munged.out"))
        wait_for(sock.exists, 10, "munged socket")
        procs.append(_daemon(["slurmctld", "-D", "-i", "-L", str(root / "slurmctld.log")], env, root / "slurmctld.out"))
        procs.append(_daemon(["slurmd", "-D", "-N", NODE, "-L", str(root / "slurmd.log")], env, root / "slurmd.out"))
        slurm = Slurm(root, env, pids=tuple(p.pid for p in procs), daemons=tuple(procs))
        wait_for(lambda: "idle" in slurm.run("sinfo", "-h", "-o", "%T", check=False).stdout, 60, "node idle")
        job = slurm.run("sbatch", "--parsable", "-N1", "-n1", "-o", str(root / "alloc.out"),
                        "--wrap", "sleep 100000").stdout.strip()
        slurm.job_id = job.split(";")[0]
        wait_for(lambda: slurm.run("squeue", "-h", "-j", slurm.job_id, "-o", "%T", check=False).stdout.strip() == "RUNNING",
              60, "allocation running")
        return slurm
    except BaseException:
        stop_slurm(Slurm(root, env, pids=tuple(p.pid for p in procs), daemons=tuple(procs)))
        raise


def _rig_processes(conf: str) -> list[int]:
    """Every process that carries this rig's SLURM_CONF: the daemons, and the slurmstepd of each job or
    step, which runs in its own session and lingers when slurmd goes first."""
    needle = f"SLURM_CONF={conf}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read() + b"\0":
                        found.append(int(name))
            except OSError:
                pass
    return found


def stop_slurm(slurm: Slurm) -> None:
    if slurm.job_id:
        slurm.run("scancel", slurm.job_id, check=False)
        try:
            wait_for(lambda: not slurm.run("squeue", "-h", "-j", slurm.job_id, check=False).stdout.strip(), 20,
                  "the allocation to end")
        except AssertionError:
            pass
    for pid in _rig_processes(slurm.env["SLURM_CONF"]):
        if pid not in slurm.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in reversed(slurm.pids):
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    time.sleep(1)
    for pid in slurm.pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in _rig_processes(slurm.env["SLURM_CONF"]):     # nothing of the rig may outlive it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for daemon in slurm.daemons:
        daemon.wait(timeout=10)                                # reaped, not left as zombies
