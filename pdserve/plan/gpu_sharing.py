"""CUDA MPS for servers sharing a GPU (`gpu_sharing: mps`): the control daemon as a managed process, and what
makes each server on a GPU its client.

Without MPS, P and D on one GPU time-slice it: one CUDA context runs at a time, so under load P's prefills
wait for D's decode steps (and P's pull out of D's memory waits like its compute). As clients of one MPS
server they run on the GPU's SMs at once: on one H200 the 32k workload's long turns went from 620 to 404 ms
p50 under this daemon, crash runs still failing 0 requests (docs/gpu.md, 2026-12-05). The daemon runs in the foreground
under the supervisor, first (roles.py), and every server on a GPU waits until it answers; a stop's SIGTERM
reaches its whole tree, and its start script also sends it `quit` (NVIDIA's documented stop). Its folders are
short paths under /tmp named after the cluster folder: MPS makes Unix sockets in the pipe folder, whose paths
may not exceed 108 bytes.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from pdserve.plan.records import MARKER, MARKER_ENV, EnvDefault, ProcessPlan, env_slot
from pdserve.roles import MPS
from pdserve.spec.schema import ClusterSpec, RoleSpec

MPS_CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
MPS_NAME = "mps"
HEALTH_SCHEME = "mps"          # health_url mps://PIPE_DIR: the control daemon answers there (supervise/health.py)
# The daemon's folders made, the daemon run; a stop (SIGTERM) asks it to quit the documented way, which also
# ends the MPS server it started, and the script ends with the daemon (its exit status when it died alone).
# The trap comes first: a stop right after the start must not leave the daemon behind.
START_SCRIPT = (f'mkdir -p "${PIPE_ENV}" "${LOG_ENV}" || exit 1; '
                """trap 'echo quit | "$0"; wait $daemon; exit 0' TERM INT; "$0" -f & daemon=$!; wait $daemon""")


def uses_mps(spec: ClusterSpec) -> bool:
    return spec.gpu_sharing == "mps"       # only with share_gpus (spec/load.py refuses it otherwise)


def mps_dirs(cluster_dir: Path) -> tuple[str, str]:
    """(pipe folder, log folder) of the cluster's daemon."""
    root = f"/tmp/pdserve-mps-{hashlib.sha256(str(cluster_dir).encode()).hexdigest()[:12]}"
    return f"{root}/pipe", f"{root}/log"


def mps_client_settings(spec: ClusterSpec, role: RoleSpec, cluster_dir: Path) -> list[EnvDefault]:
    """The environment that makes a server on a GPU a client of the cluster's daemon."""
    if not uses_mps(spec) or not role.gpus:
        return []
    pipe, log = mps_dirs(cluster_dir)
    why = "gpu_sharing: mps: a client of the cluster's MPS daemon, so servers sharing a GPU run on it at once"
    return [EnvDefault(PIPE_ENV, pipe, why), EnvDefault(LOG_ENV, log, why)]


def mps_plans(spec: ClusterSpec, cluster_dir: Path, marker) -> list[ProcessPlan]:
    """The control daemon, in the foreground (-f) so the supervisor owns it; `marker(name)` as for every
    process (plan/records.py). It stops after the servers (roles.py's order, reversed)."""
    if not uses_mps(spec):
        return []
    pipe, log = mps_dirs(cluster_dir)
    argv = ["/bin/sh", "-c", START_SCRIPT, shutil.which(MPS_CONTROL) or MPS_CONTROL]
    return [ProcessPlan(name=MPS_NAME, role=MPS, argv=argv,
                        env={MARKER_ENV: marker(MPS_NAME), PIPE_ENV: pipe, LOG_ENV: log},
                        host="127.0.0.1", port=0, health_url=f"{HEALTH_SCHEME}://{pipe}",
                        host_specific={MARKER: env_slot(MARKER_ENV)})]
