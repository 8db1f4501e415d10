"""engine/ipc_sweep.py: the survivor drops UCX's cached CUDA IPC mappings of a peer that died.

Against the real libuct_cuda.so of the installed NIXL wheel (tests/kits/uct_cuda_rig.py: stub CUDA driver, the
library's own table, lock, caches, page tables and destroy function), and its policy with fakes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import time

import pytest

from pdserve.engine import ipc_sweep
from pdserve.engine import ipc_drop
from pdserve.engine.ipc_drop import CHANGED, DROPPED, IN_USE
from pdserve.engine.ipc_sweep import CACHE_ENV, DeadPeerSweeper, Dropped, Entry, Layout, pid_alive
from pdserve.engine.names import IPC_SWEEP_ENV
from tests.kits.uct_cuda_rig import PACKAGES, nixl_library, run_child


@pytest.mark.parametrize("package", PACKAGES)
def test_the_installed_nixl_ucx_is_a_build_the_sweeper_knows(package):
    # A new NIXL wheel brings a new UCX: its offsets must be read again (objdump, see Layout) before it is added.
    path = nixl_library(package)
    assert hashlib.sha256(path.read_bytes()).hexdigest() in ipc_sweep.BUILDS, path


@pytest.mark.parametrize("package", PACKAGES)
def test_a_dead_peers_cache_is_destroyed_with_its_handles_closed_in_the_real_library(tmp_path, package):
    report = run_child(tmp_path, "plain", package)
    dead = report["first"]
    assert report["said"] == f"yes ({package.replace('_', '-')} 1.5.1)"
    assert len(dead) == 1 and dead[0]["regions"] == 1 and dead[0]["nbytes"] == 4096
    assert report["closed"] == [report["mapped"]["dead"]]       # cuIpcCloseMemHandle of its mapping, only
    assert report["size"] == 2 and report["lock"] == 0          # kh_del's count; the lock given back
    # UCX still finds the live peer's cache by its own hash (its unmap lowered the region's in-flight count)
    # and the one of another pid namespace is left: its pid says nothing here.
    assert report["live_refcount_after_unmap"] == 0
    assert len(report["entries"]) == 2 and dead[0]["pid"] in report["entries"]


def test_a_mapping_in_use_is_kept_until_its_copy_is_done_in_the_real_library(tmp_path):
    report = run_child(tmp_path, "in_use")
    assert report["first"] == []
    assert [d["regions"] for d in report["after_release"]] == [1]
    assert report["closed"] == [report["mapped"]["dead"]] and report["lock"] == 0



def test_a_dead_peers_region_an_rkey_holds_is_dropped_in_the_real_library(tmp_path):
    report = run_child(tmp_path, "held")
    assert report["regions"] == [[0x20, 1]]                       # its LRU link, its one count, read back
    assert report["held"] == [[True, 0x20]]
    assert [d["regions"] for d in report["first"]] == [1]
    assert report["closed"] == [report["mapped"]["dead"]] and report["lock"] == 0 and report["size"] == 2

def test_nothing_is_dropped_while_ucx_holds_the_table_in_the_real_library(tmp_path):
    report = run_child(tmp_path, "reader")
    assert report["while_read"] == []                  # the library's reader kept the sweeper out
    assert [d["regions"] for d in report["first"]] == [1] and report["lock"] == 0
    assert report["closed"] == [report["mapped"]["dead"]]


class FakeCaches:
    def __init__(self, entries: list[Entry], busy: set[int] = frozenset(), lock_free: bool = True):
        self.table, self.busy, self.lock_free = list(entries), set(busy), lock_free
        self.asked: list[tuple[int, int]] = []
        self.region_counts: dict[int, list[tuple[int, int]]] = {}

    def regions(self, cache: int) -> list[tuple[int, int]]:
        return self.region_counts.get(cache, [])

    def entries(self) -> list[Entry]:
        return list(self.table)

    def drop(self, entry: Entry, held: int = 0) -> tuple[int, Dropped | None]:
        self.asked.append((entry.pid, held))
        if not self.lock_free:
            return CHANGED, None
        if entry.cache in self.busy:
            return IN_USE, None
        self.table.remove(entry)
        return DROPPED, Dropped(entry.pid, entry.device, 1, 10)


def sweeper(caches, dead: set[int], now: list[float], grace: float = 2.0) -> DeadPeerSweeper:
    return DeadPeerSweeper(caches, own_ns=7, alive=lambda pid: pid not in dead, grace_s=grace,
                           clock=lambda: now[0])


def test_a_dead_peer_is_dropped_after_the_grace_and_never_a_live_one_or_another_namespaces():
    entries = [Entry(0, 100, 7, 0, 0xA), Entry(1, 200, 7, 0, 0xB), Entry(2, 100, 8, 0, 0xC)]
    caches, now = FakeCaches(entries), [10.0]
    s = sweeper(caches, dead={100}, now=now)
    assert s.sweep() == []                     # first seen dead: the grace starts
    now[0] = 11.9
    assert s.sweep() == []
    now[0] = 12.0
    assert [d.pid for d in s.sweep()] == [100]
    assert [e.cache for e in caches.table] == [0xB, 0xC]



def test_the_region_an_rkey_holds_is_learnt_when_nixl_loads_the_peer_and_named_at_its_drop():
    # UCX maps one region of the first peer on a GPU while NIXL loads that peer's metadata (its reachability
    # check) and keeps it mapped until NIXL unloads the peer: that count is no copy.
    caches, now = FakeCaches([Entry(0, 300, 7, 0, 0xD)]), [0.0]
    s = sweeper(caches, dead={100}, now=now, grace=0.0)
    before = s.peers()
    caches.table.append(Entry(1, 100, 7, 0, 0xA))
    caches.region_counts[0xA] = [(0xA70, 1)]
    s.note_loaded_peer(before, b"d-agent")
    assert s.held == {(100, 7, 0): 0xA70}
    assert [d.pid for d in s.sweep()] == [100] and caches.asked == [(100, 0xA70)] and s.held == {}


def test_a_hold_is_forgotten_when_nixl_unloads_its_peer():
    # vLLM unloads a replaced or invalid peer (rkeys released: UCX unmaps the hold) and may load it again,
    # which maps nothing new: a count on that region is then a copy's.
    caches = FakeCaches([])
    s = sweeper(caches, dead={100}, now=[0.0], grace=0.0)
    caches.table.append(Entry(1, 100, 7, 0, 0xA))
    caches.region_counts[0xA] = [(0xA70, 1)]
    s.note_loaded_peer(set(), b"d-agent")
    s.note_unloaded_agent(b"other-agent")
    assert s.held == {(100, 7, 0): 0xA70}
    s.note_unloaded_agent("d-agent")                            # NIXL's answer was bytes; a str removes it
    assert s.held == {} and s.held_by_agent == {}
    s.sweep()
    assert caches.asked == [(100, 0)]


def test_no_hold_is_learnt_where_the_new_cache_cannot_be_told_apart():
    caches = FakeCaches([])
    s = sweeper(caches, dead=set(), now=[0.0])
    caches.table += [Entry(0, 100, 7, 0, 0xA), Entry(1, 200, 7, 0, 0xB)]         # two peers' caches appeared
    caches.region_counts = {0xA: [(0xA70, 1)], 0xB: [(0xB70, 1)]}
    s.note_loaded_peer(set())
    assert s.held == {}
    for counts in ([(0xC70, 0)], [(0xC70, 1), (0xC90, 1)], [(0xC70, 2)]):      # not one region mapped once
        caches.table, caches.region_counts = [Entry(2, 400, 7, 0, 0xC)], {0xC: counts}
        s.note_loaded_peer(set())
        assert s.held == {}


def test_a_table_held_by_ucx_is_left_for_the_next_sweep():
    caches = FakeCaches([Entry(0, 100, 7, 0, 0xA)], lock_free=False)
    s = sweeper(caches, dead={100}, now=[0.0], grace=0.0)
    assert s.sweep() == [] and len(caches.table) == 1
    caches.lock_free = True
    assert [d.pid for d in s.sweep()] == [100]


def test_a_cache_in_use_waits_and_a_pid_seen_alive_again_restarts_its_grace():
    caches, now, dead = FakeCaches([Entry(0, 100, 7, 0, 0xA)], busy={0xA}), [0.0], {100}
    s = sweeper(caches, dead=dead, now=now)
    s.sweep()
    now[0] = 5.0
    assert s.sweep() == []                     # past the grace, but a copy holds a region
    caches.busy.clear()
    dead.clear()                               # (a pid the table holds runs again)
    assert s.sweep() == [] and s.dead_since == {}
    dead.add(100)
    now[0] = 6.0
    assert s.sweep() == []                     # its grace starts over
    now[0] = 8.0
    assert [d.pid for d in s.sweep()] == [100]


def test_a_dead_peers_mappings_held_by_a_copy_are_said_once(capsys):
    caches, now = FakeCaches([Entry(0, 100, 7, 0, 0xA)], busy={0xA}), [0.0]
    s = sweeper(caches, dead={100}, now=now)
    for t in (0.0, 10.0, 29.0, 30.0, 31.0, 60.0):
        now[0] = t
        assert s.sweep() == []
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "is gone" in line] == [
        "pdserve-ipc-sweep: peer pid 100 (device 0) is gone: its mappings go in 2 s unless a copy holds them"]
    said = [line for line in out if "still in a copy" in line]
    assert said == ["pdserve-ipc-sweep: dead peer pid 100: its mappings are still in a copy after 30 s; kept "
                    "until it ends"]
    caches.busy.clear()
    now[0] = 61.0
    assert [d.pid for d in s.sweep()] == [100]


class Table:
    """A table in UCX's layout (Layout's offsets), in this process's memory: 4 buckets, bucket 1 holding a
    cache with two regions on its LRU list."""

    def __init__(self, lock: int = 0, refcount: int = 0):
        self.raw = (ctypes.c_uint8 * 0x40)()
        self.flags = (ctypes.c_uint32 * 1)(0xAAAAAAAA & ~(3 << 2))          # bucket 1 occupied
        self.keys = (ctypes.c_uint32 * 12)()
        self.vals = (ctypes.c_uint64 * 4)()
        self.cache = (ctypes.c_uint8 * 0x100)()
        self.regions = [(ctypes.c_uint8 * 0x108)() for _ in range(2)]
        base = ctypes.addressof(self.raw)
        self.base = base
        self.u32(0).value, self.u32(4).value = 4, 1
        for offset, array in ((0x10, self.flags), (0x18, self.keys), (0x20, self.vals)):
            ctypes.c_uint64.from_address(base + offset).value = ctypes.addressof(array)
        self.u32(0x28).value = lock
        self.vals[1] = ctypes.addressof(self.cache)
        head = ctypes.addressof(self.cache) + 0x70
        links = [ctypes.addressof(r) + 0x20 for r in self.regions]
        chain = [head, *links, head]
        for here, after in zip(chain, chain[1:]):
            ctypes.c_uint64.from_address(here).value = after
        for i, r in enumerate(self.regions):
            ctypes.c_uint64.from_address(ctypes.addressof(r) + 0xd8).value = 4096 * (i + 1)
        ctypes.c_uint64.from_address(ctypes.addressof(self.regions[1]) + 0xf8).value = refcount

    def u32(self, offset: int) -> ctypes.c_uint32:
        return ctypes.c_uint32.from_address(self.base + offset)


def drop_on(table: Table, bucket: int = 1, cache: int | None = None, held: int = 0) -> tuple[int, list[int],
                                                                                        tuple[int, int]]:
    destroyed: list[int] = []
    destroy = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)(lambda c, close: destroyed.append((c, close)))
    counts = (ctypes.c_uint64 * 2)()
    code = ipc_drop.native_drop()(table.base, bucket, cache if cache is not None else ctypes.addressof(table.cache),
                                  ctypes.cast(destroy, ctypes.c_void_p).value, ctypes.byref(counts), held)
    return code, destroyed, (counts[0], counts[1])


@pytest.mark.parametrize("lock", [0, 1])       # free, or free with a writer waiting (ucs_rw_spinlock_t)
def test_the_native_step_drops_the_cache_under_the_lock_and_gives_it_back(lock):
    table = Table(lock=lock)
    code, destroyed, counts = drop_on(table)
    assert code == DROPPED and destroyed == [(ctypes.addressof(table.cache), 1)]   # handles closed
    assert counts == (2, 4096 + 8192)
    assert (table.flags[0] >> 2) & 3 == 1 and table.u32(4).value == 0             # kh_del: deleted, size 0
    assert table.u32(0x28).value == lock


@pytest.mark.parametrize("lock", [2, 3, 4, 8])   # a writer, a writer and a waiter, one reader, two
def test_the_native_step_leaves_a_table_ucx_holds(lock):
    table = Table(lock=lock)
    assert drop_on(table)[:2] == (CHANGED, []) and table.u32(0x28).value == lock and table.u32(4).value == 1


def test_the_native_step_leaves_a_bucket_that_changed_or_a_region_in_a_copy():
    table = Table()
    assert drop_on(table, cache=0x1234)[:2] == (CHANGED, [])        # the bucket holds another cache now
    assert drop_on(table, bucket=2)[:2] == (CHANGED, [])            # an empty bucket
    assert drop_on(table, bucket=9)[:2] == (CHANGED, [])            # past the table
    busy = Table(refcount=1)
    assert drop_on(busy)[:2] == (IN_USE, []) and busy.u32(4).value == 1
    other = ctypes.addressof(busy.regions[0]) + 0x20
    assert drop_on(busy, held=other)[:2] == (IN_USE, [])            # the count is on a region no rkey holds
    for t in (table, busy):
        assert t.u32(0x28).value == 0 and (t.flags[0] >> 2) & 3 == 0


def test_the_native_step_frees_the_region_an_rkey_holds_but_not_one_also_in_a_copy():
    held = Table(refcount=1)
    link = ctypes.addressof(held.regions[1]) + 0x20
    code, destroyed, counts = drop_on(held, held=link)
    assert code == DROPPED and destroyed == [(ctypes.addressof(held.cache), 1)] and counts == (2, 4096 + 8192)
    assert held.u32(0x28).value == 0 and held.u32(4).value == 0
    copying = Table(refcount=2)                                     # the hold and a copy in flight
    assert drop_on(copying, held=ctypes.addressof(copying.regions[1]) + 0x20)[:2] == (IN_USE, [])
    assert copying.u32(0x28).value == 0 and copying.u32(4).value == 1


def test_the_native_code_is_its_source_assembled(tmp_path):
    (tmp_path / "drop.s").write_text(ipc_drop.ASM)
    subprocess.run(["as", "--64", "-o", str(tmp_path / "drop.o"), str(tmp_path / "drop.s")], check=True)
    subprocess.run(["objcopy", "-O", "binary", "-j", ".text", str(tmp_path / "drop.o"), str(tmp_path / "drop.bin")],
                   check=True)
    assert (tmp_path / "drop.bin").read_bytes() == ipc_drop.CODE


def test_the_native_codes_offsets_are_the_layouts():
    layout = Layout("any")
    for operand in (f"[rbx+{layout.lock:#x}]", f"[rbx+{layout.flags:#x}]", f"[rbx+{layout.vals:#x}]",
                    f"[r13+{layout.cache_lru:#x}]", f"[rax+{layout.region_refcount - layout.region_lru:#x}]",
                    f"[rax+{layout.region_bytes - layout.region_lru:#x}]"):
        assert operand in ipc_drop.ASM, operand


def test_pid_alive_tells_running_from_gone_and_zombie():
    gone = subprocess.Popen(["true"])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])     # exited, not reaped yet
    deadline = time.monotonic() + 30
    while open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pid_alive(os.getpid())
    assert not pid_alive(gone.pid) and not pid_alive(zombie.pid)
    zombie.wait()


def test_start_says_why_it_does_not_run(monkeypatch):
    monkeypatch.setenv(IPC_SWEEP_ENV, "0")
    assert ipc_sweep.start() == "off (PDSERVE_IPC_SWEEP=0)"
    monkeypatch.delenv(IPC_SWEEP_ENV)
    monkeypatch.setenv(CACHE_ENV, "n")
    assert ipc_sweep.start().startswith("not needed (UCX_CUDA_IPC_CACHE=n")
    monkeypatch.delenv(CACHE_ENV)
    assert ipc_sweep.start() == "not needed (no CUDA IPC transport loaded)"   # this process has no UCX CUDA


def test_a_ucx_build_it_has_not_checked_is_left_alone(tmp_path):
    other = tmp_path / "libuct_cuda.so.0.0.0"
    other.write_bytes(nixl_library().read_bytes() + b"\0")
    sweeper_, said = ipc_sweep.attach(str(other))
    assert sweeper_ is None and said.startswith("no (a UCX build pdserve has not checked: ")


def test_the_entry_starts_it_once_after_nixls_first_agent_has_its_ucx_backend():
    # UCX loads its CUDA transport when the UCX backend is created, after the agent's constructor: a sweeper
    # started before it would find no library and never run.
    code = ("from pdserve.engine import ipc_sweep\nimport nixl._api as api\nevents = []\n"
            "create, start = api.nixl_agent.create_backend, ipc_sweep.start\n"
            "api.nixl_agent.create_backend = lambda self, *a, **k: (events.append('backend'), create(self, *a, **k))[1]\n"
            "ipc_sweep.start = lambda: (events.append('sweeper'), start())[1]\n"
            "assert ipc_sweep.patch_agent_start()\n"
            "import os; assert os.environ['UCX_RCACHE_MAX_UNRELEASED'] == '1024'   # vLLM's, set before NIXL\n"
            "for i in range(2): api.nixl_agent(f'a{i}', api.nixl_agent_config(backends=['UCX']))\n"
            "print(events)\n")
    env = {k: v for k, v in os.environ.items() if k != "UCX_RCACHE_MAX_UNRELEASED"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stdout.splitlines() if line.startswith("pdserve-ipc-sweep:")]
    assert said == ["pdserve-ipc-sweep: dropping a dead peer's CUDA IPC mappings: "
                    "not needed (no CUDA IPC transport loaded)"]
    assert out.stdout.strip().splitlines()[-1] == "['backend', 'sweeper', 'backend']"


def test_the_cache_is_turned_off_before_ucx_starts_where_the_sweeper_cannot_run(tmp_path):
    other = tmp_path / "libuct_cuda.so.0.0.0"
    other.write_bytes(nixl_library().read_bytes() + b"\0")
    env = {"UCX_CUDA_IPC_CACHE": "y"}
    said = ipc_sweep.guard_cache([str(nixl_library()), str(other)], env)
    assert env["UCX_CUDA_IPC_CACHE"] == "n" and said.startswith("UCX_CUDA_IPC_CACHE=n (a UCX build pdserve has not")
    env = {}                                                    # UCX's own default is on
    assert ipc_sweep.guard_cache([str(other)], env) and env == {"UCX_CUDA_IPC_CACHE": "n"}
    for kept in ({"UCX_CUDA_IPC_CACHE": "y"}, {"UCX_CUDA_IPC_CACHE": "n"}):
        env = dict(kept)
        assert ipc_sweep.guard_cache([str(nixl_library())], env) is None and env == kept
    env = {"UCX_CUDA_IPC_CACHE": "y", IPC_SWEEP_ENV: "0"}          # the user's word: leave UCX's setting
    assert ipc_sweep.guard_cache([str(other)], env) is None and env["UCX_CUDA_IPC_CACHE"] == "y"
    env = {"UCX_CUDA_IPC_CACHE": "y"}
    assert ipc_sweep.guard_cache([], env) is None and env["UCX_CUDA_IPC_CACHE"] == "y"   # no CUDA transport


def test_the_libraries_guarded_are_the_ones_of_nixls_backend_package(tmp_path):
    import nixl._api as api
    assert ipc_sweep.transport_libraries(api.__name__) == [str(nixl_library())]
    (tmp_path / "libuct_cuda.la").write_text("")
    (tmp_path / "libuct_cuda.so.0.0.0").write_text("")
    assert ipc_sweep.transport_libraries(api.__name__, {"UCX_MODULE_DIR": str(tmp_path)}) == \
        [str(tmp_path / "libuct_cuda.so.0.0.0")]


def test_the_entry_turns_the_cache_off_for_a_ucx_build_it_has_not_checked(tmp_path):
    (tmp_path / "libuct_cuda.so.0.0.0").write_bytes(nixl_library().read_bytes() + b"\0")
    code = ("import os\nfrom pdserve.engine import ipc_sweep\nassert ipc_sweep.patch_agent_start()\n"
            "print('cache', os.environ['UCX_CUDA_IPC_CACHE'])\n")
    env = {**os.environ, "UCX_CUDA_IPC_CACHE": "y", "UCX_MODULE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cache n" in out.stdout.splitlines()
    assert "pdserve-ipc-sweep: UCX_CUDA_IPC_CACHE=n (a UCX build pdserve has not checked" in out.stdout


def test_the_entry_learns_each_loaded_peers_hold_around_nixls_add_remote_agent():
    code = ("from pdserve.engine import ipc_sweep\nimport nixl._api as api\n"
            "class Noted:\n"
            "    def __init__(self): self.calls = []\n"
            "    def peers(self): self.calls.append('peers'); return {(1, 2, 3)}\n"
            "    def note_loaded_peer(self, before, name): self.calls.append(('noted', before, name))\n"
            "    def note_unloaded_agent(self, name): self.calls.append(('unloaded', name))\n"
            "assert ipc_sweep.patch_agent_start()\n"
            "a, b = (api.nixl_agent(n, api.nixl_agent_config(backends=['UCX'])) for n in ('a', 'b'))\n"
            "noted = Noted(); ipc_sweep.RUNNING.append(noted)\n"
            "print('name', a.add_remote_agent(b.get_agent_metadata()))\n"
            "a.remove_remote_agent('b')\n"
            "print(noted.calls)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "name b'b'" in out.stdout.splitlines()        # NIXL's own answer, passed back
    assert "['peers', ('noted', {(1, 2, 3)}, b'b'), ('unloaded', 'b')]" in out.stdout.splitlines()
