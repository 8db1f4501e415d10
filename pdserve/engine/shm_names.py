"""The POSIX shared memory a server's processes create, named after the server, and removed once it is gone.

vLLM's multi-process executor (every CPU server; tensor or pipeline parallel ones on GPUs) passes work between
its processes through rings in shared memory (multiprocessing.shared_memory: /dev/shm/psm_<random>, 160-240 MiB
each, filled as they are used). The creator unlinks a ring when it exits cleanly; a SIGKILLed process never
does, and vLLM's own shutdown SIGKILLs the engine core's children, among them the resource tracker that would
clean up after it when the engine core was forked (PDSERVE_ENGINE_FORK): every `down` of such a server left
two rings behind, every crash of any server as many. Here each segment a server's processes create is named
`pdserve-<hash of the server's marker>-<random>`, and what a server left is unlinked when its next start
begins (the entry, on whatever host it runs), when its API server exits (atexit), and by the supervisor once
every process of the server is gone (on the supervisor's own host). Unlinking takes only the name: a process
still mapping a segment keeps its memory until it unmaps it."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

PREFIX = "pdserve-"
SHM_DIR = Path("/dev/shm")
NAME_TRIES = 8


def owner_prefix(marker: str) -> str:
    """The name prefix of one server's segments (its marker: cluster folder and process name)."""
    return f"{PREFIX}{hashlib.blake2b(marker.encode(), digest_size=6).hexdigest()}-"


def name_created_segments(prefix: str) -> None:
    """From now on in this process (and the children it forks or spawns through the entry), a segment created
    without a name gets one under `prefix` (patched once a process)."""
    from multiprocessing import shared_memory
    cls = shared_memory.SharedMemory
    if getattr(cls.__init__, "pdserve_prefix", None) is not None:
        return
    create_or_open = cls.__init__

    def init(self, name=None, create=False, size=0, *args, **kwargs):
        if not (create and name is None):
            return create_or_open(self, name, create, size, *args, **kwargs)
        for attempt in range(NAME_TRIES):            # as the stdlib retries its own random names
            try:
                return create_or_open(self, prefix + secrets.token_hex(4), create, size, *args, **kwargs)
            except FileExistsError:
                if attempt == NAME_TRIES - 1:
                    raise

    init.pdserve_prefix = prefix
    cls.__init__ = init


def named_under(prefix: str, shm_dir: Path = SHM_DIR) -> list[Path]:
    """The segments whose name starts with `prefix` (one server's), in name order."""
    return sorted(shm_dir.glob(prefix + "*"))


def remove_left(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every segment named under `prefix`; the names removed."""
    removed = []
    for path in named_under(prefix, shm_dir):
        try:
            path.unlink()
        except FileNotFoundError:       # its creator unlinked it meanwhile
            continue
        removed.append(path.name)
    return removed
