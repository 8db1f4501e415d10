"""Per-process log files: size-based rotation and reading (tail, follow).

Servers write straight into their log file (opened O_APPEND), so they never block on a pipe and keep
logging if the supervisor dies. Rotation is therefore copy-then-truncate, done by the supervisor: the
writer's next append lands at the start of the emptied file. A few lines written between the copy and
the truncate can be lost; that is the usual copytruncate trade-off.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path


def rotated(path: Path, i: int) -> Path:
    return path.with_name(f"{path.name}.{i}")


def rotate_if_large(path: Path, max_bytes: int, keep: int) -> bool:
    """Move a log over `max_bytes` to NAME.1 (NAME.1 -> NAME.2 ... up to `keep`) and empty it in place."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except OSError:
        return False
    for i in range(keep - 1, 0, -1):
        if rotated(path, i).exists():
            os.replace(rotated(path, i), rotated(path, i + 1))
    if keep > 0:
        shutil.copyfile(path, rotated(path, 1))
    with open(path, "r+b") as f:
        f.truncate(0)
    return True


def last_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines, reading backwards in chunks (logs can be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos = f.tell()
            data = b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(64 * 1024, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-n:] if n > 0 else []


# `pkg.module.SomeError: message` as Python prints the last line of a traceback (vLLM prefixes its own
# logger's lines with "(EngineCore pid=N) ERROR ...", so the pattern may start mid-line).
_EXCEPTION = re.compile(r"(?:^|\s)((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)):\s+(.*\S)")
# Wrappers that only point at the real cause printed before them.
_WRAPPERS = ("See root cause above", "See stack trace (above)")


def root_cause(lines: list[str]) -> str | None:
    """The exception that made a process fail: the last exception line that is not a wrapper pointing
    above (vLLM's API server ends with "Engine core initialization failed. See root cause above.")."""
    found = None
    for line in lines:
        m = _EXCEPTION.search(line)
        if m and not any(w in line for w in _WRAPPERS):
            found = f"{m.group(1)}: {m.group(2)}"
    return found


def follow(path: Path, poll: float = 0.25, stop=lambda: False) -> Iterator[str]:
    """Lines appended to `path` from now on; survives the file being truncated by rotation."""
    pos = path.stat().st_size if path.exists() else 0
    buf = b""
    while not stop():
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        if size < pos:          # rotated (truncated): start over at the top
            pos, buf = 0, b""
        if size > pos:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read(size - pos)
            pos += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")
        else:
            time.sleep(poll)
