"""CPU and memory of a server's whole process tree (vLLM's API server, engine core and workers)."""

from __future__ import annotations

import psutil


class TreeSampler:
    """Keeps psutil handles between samples, so CPU percentages cover the time since the last sample."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], psutil.Process] = {}

    def sample(self, pid: int | None) -> tuple[float | None, int | None]:
        """(CPU percent summed over the tree since the previous call, resident bytes); None if gone."""
        if not pid:
            return None, None
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None, None
        cpu, rss = 0.0, 0
        for proc in tree:
            try:
                key = (proc.pid, proc.create_time())
                known = self._seen.setdefault(key, proc)
                cpu += known.cpu_percent(None)   # 0.0 on a process's first sample
                rss += known.memory_info().rss
            except psutil.Error:
                continue
        return cpu, rss


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"
