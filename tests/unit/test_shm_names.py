"""pdserve.engine.shm_names: a server's shared memory is named after it, and what it left is unlinked (the real
/dev/shm, vLLM's own ring buffer, the entry's hook in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from pdserve.engine.names import MARKER_ENV
from pdserve.engine.shm_names import SHM_DIR, named_under, owner_prefix, remove_left

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this system")


def run(code: str, marker: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, MARKER_ENV: marker})
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def test_a_prefix_is_one_servers_own_and_fits_a_file_name():
    a, b = owner_prefix("/home/c#prefill-0"), owner_prefix("/home/c#prefill-1")
    assert a == owner_prefix("/home/c#prefill-0") and a != b and a.startswith("pdserve-")
    assert len(a) + 8 < 255


def test_segments_get_the_servers_name_vllms_rings_too_and_readers_still_attach(tmp_path):
    prefix = owner_prefix(f"{tmp_path}#decode-0")
    code = f"""
from multiprocessing import shared_memory
from pdserve.engine.shm_names import name_created_segments
name_created_segments({prefix!r}); once = shared_memory.SharedMemory.__init__
name_created_segments({prefix!r}); assert shared_memory.SharedMemory.__init__ is once    # twice: one patch
made = shared_memory.SharedMemory(create=True, size=4096)
made.buf[:5] = b"hello"
seen = shared_memory.SharedMemory(name=made.name)             # a reader attaches by the name it is handed
assert bytes(seen.buf[:5]) == b"hello"
from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
ring = ShmRingBuffer(n_reader=1, max_chunk_bytes=1024, max_chunks=2)
print(made.name, ring.handle()[3])
seen.close()
"""
    names = run(code, f"{tmp_path}#decode-0").stdout.split()
    remove_left(prefix)
    assert len(names) == 2 and all(n.startswith(prefix) for n in names), names


def test_remove_left_takes_only_the_servers_own(tmp_path):
    mine, other = owner_prefix("a#decode-0"), owner_prefix("a#decode-1")
    for name in (mine + "1", mine + "2", other + "1", "psm_0001"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_left(mine, shm_dir=tmp_path) == [mine + "1", mine + "2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other + "1", "psm_0001"])


def test_the_entry_unlinks_what_its_predecessor_left_then_what_it_leaves_at_exit(tmp_path):
    marker = f"{tmp_path}#prefill-0"
    prefix = owner_prefix(marker)
    dead = shared_memory.SharedMemory(name=prefix + "dead0001", create=True, size=4096)   # a crashed server's
    dead.close()
    unrelated = shared_memory.SharedMemory(create=True, size=4096)
    try:
        code = """
from multiprocessing import shared_memory
from pdserve.engine import entry
entry.name_shared_memory(server=True)
ring = shared_memory.SharedMemory(create=True, size=4096)
# as when vLLM's shutdown SIGKILLs the resource tracker: nothing but the entry's exit unlinks it
from multiprocessing import resource_tracker
resource_tracker.unregister(ring._name, "shared_memory")
print("made", ring.name)
"""
        res = run(code, marker)
        said = res.stdout.splitlines()
        assert said[0] == f"pdserve-shm: unlinked 1 shared-memory segment(s) the previous server left: {prefix}dead0001"
        assert said[1].startswith("made " + prefix)
        assert named_under(prefix) == []             # its own, unlinked at exit
        assert Path(SHM_DIR / unrelated.name).exists()
    finally:
        unrelated.close()
        unrelated.unlink()
        remove_left(prefix)


def test_without_a_marker_nothing_is_renamed_or_removed():
    code = """
from multiprocessing import shared_memory
from pdserve.engine import entry
entry.name_shared_memory(server=True)
seg = shared_memory.SharedMemory(create=True, size=4096)
print(seg.name)
seg.close(); seg.unlink()
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != MARKER_ENV})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1].startswith("psm_")
