"""CPU, memory and GPU memory of a server's whole process tree (vLLM's API server, engine core and workers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from pdserve.observe.proctree import process_tree


@dataclass(frozen=True)
class TreeUsage:
    cpu_percent: float | None   # summed over the tree since the previous sample
    rss: int | None             # resident bytes, summed over the tree
    gpu_bytes: int | None       # GPU memory of the tree's processes; None where no GPU is visible


class TreeSampler:
    """Keeps psutil handles between samples, so CPU percentages cover the time since the last sample."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], psutil.Process] = {}

    def sample(self, pid: int | None, gpu_by_pid: dict[int, int] | None = None, start_time: float | None = None,
               mark: str = "") -> TreeUsage:
        """The usage of the tree of the leader started as (pid, start_time) with this mark, as stop and
        `down` find it (proctree.process_tree); all None if nothing of it is left. gpu_by_pid comes from
        `gpu_memory_by_pid()`."""
        tree = process_tree(pid, start_time, mark)
        if not tree:
            return TreeUsage(None, None, None)
        cpu, rss = 0.0, 0
        for proc in tree:
            try:
                key = (proc.pid, proc.create_time())
                known = self._seen.setdefault(key, proc)
                cpu += known.cpu_percent(None)   # 0.0 on a process's first sample
                rss += known.memory_info().rss
            except psutil.Error:
                continue
        gpu = None if gpu_by_pid is None else sum(gpu_by_pid.get(p.pid, 0) for p in tree)
        return TreeUsage(cpu, rss, gpu)


def gpu_memory_by_pid(nvidia_smi: str | None = None) -> dict[int, int] | None:
    """GPU memory used per process (bytes), from nvidia-smi; None when no NVIDIA GPU is visible.

    nvidia-smi rather than NVML bindings: it is on every machine with the driver, and one call per refresh
    is cheap next to the one-second refresh."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used: dict[int, int] = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            # MiB per process; a process on several GPUs appears once per GPU
            used[int(fields[0])] = used.get(int(fields[0]), 0) + int(fields[1]) * 1024 * 1024
    return used


GPU_LEFT_THRESHOLD_MIB = 1024   # a CUDA context alone is a few hundred MiB; a leaked KV cache is tens of GiB


@dataclass(frozen=True)
class GpuLeft:
    index: int
    used_mib: int
    pids: list[int]             # processes nvidia-smi lists on that GPU (often none: in a container, or
                                # when a peer's CUDA-IPC import holds a dead server's memory)

    def describe(self) -> str:
        held_by = f"processes {', '.join(map(str, self.pids))}" if self.pids else "no process listed"
        return f"GPU {self.index} still holds {self.used_mib} MiB ({held_by})"


def _nvidia_smi(args: list[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def physical_gpus(visible: list[str], inherited: str | None) -> list[str]:
    """The devices that CUDA_VISIBLE_DEVICES entries name, as nvidia-smi knows them (index or UUID): a
    plan's `0` is the first of the launching environment's own CUDA_VISIBLE_DEVICES, when it has one."""
    outer = [d.strip() for d in inherited.split(",") if d.strip()] if inherited else None
    out = []
    for dev in (d.strip() for d in visible):
        if outer is not None and dev.isdigit():
            dev = outer[int(dev)] if int(dev) < len(outer) else ""
        if dev:
            out.append(dev)
    return out


def process_gpus(visible: str | None) -> list[str]:
    """The devices a process's CUDA_VISIBLE_DEVICES value names, as nvidia-smi knows them; [] when unset."""
    return physical_gpus(visible.split(","), os.environ.get("CUDA_VISIBLE_DEVICES")) if visible else []


@dataclass(frozen=True)
class GpuFree:
    index: int
    total_mib: int
    free_mib: int


def gpu_free_memory(devices: list[str], run: Callable[[list[str]], str | None] | None = None) -> list[GpuFree] | None:
    """Total and free memory of the GPUs among `devices` (nvidia-smi indices or UUIDs); None without
    nvidia-smi."""
    out = (run or _nvidia_smi)(["--query-gpu=index,uuid,memory.total,memory.free", "--format=csv,noheader,nounits"])
    if out is None:
        return None
    wanted, gpus = set(devices), []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and fields[0].isdigit() and fields[2].isdigit() and fields[3].isdigit() \
                and (fields[0] in wanted or fields[1] in wanted):
            gpus.append(GpuFree(int(fields[0]), int(fields[2]), int(fields[3])))
    return gpus


def gpus_still_holding(devices: list[str], settle_s: float, run: Callable[[list[str]], str | None] | None = None,
                       sleep: Callable[[float], None] = time.sleep, step: float = 0.5) -> list[GpuLeft] | None:
    """gpus_holding_memory, asked again every `step` s until nothing is held or settle_s has passed: the
    driver frees a dead process's memory shortly after it exits, not at once. None without nvidia-smi."""
    waited = 0.0
    while True:
        left = gpus_holding_memory(devices, run=run or _nvidia_smi)
        if not left or waited >= settle_s:
            return left
        sleep(step)
        waited += step


def gpus_holding_memory(devices: list[str], threshold_mib: int = GPU_LEFT_THRESHOLD_MIB,
                        run: Callable[[list[str]], str | None] = _nvidia_smi) -> list[GpuLeft] | None:
    """GPUs among `devices` (nvidia-smi indices or UUIDs) whose used memory is above threshold_mib; None
    when nvidia-smi is absent or fails. Whole-GPU used memory rather than per-process: a dead decode
    server's KV cache kept by P's CUDA-IPC import belongs to no listed process."""
    gpus = run(["--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"])
    if gpus is None:
        return None
    apps = run(["--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader,nounits"]) or ""
    pids_by_uuid: dict[str, list[int]] = {}
    for line in apps.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[1].isdigit():
            pids_by_uuid.setdefault(fields[0], []).append(int(fields[1]))
    wanted = set(devices)
    left = []
    for line in gpus.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit() or not fields[2].isdigit():
            continue
        index, uuid, used = int(fields[0]), fields[1], int(fields[2])
        if (fields[0] in wanted or uuid in wanted) and used > threshold_mib:
            left.append(GpuLeft(index, used, sorted(pids_by_uuid.get(uuid, []))))
    return left
