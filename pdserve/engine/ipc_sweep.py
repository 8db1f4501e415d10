"""Drops the CUDA IPC mappings a server holds of a peer that died, so UCX's mapping cache can stay on.

Over CUDA IPC each server maps its peer's KV cache (D reads P's blocks, P pulls D's). With
`UCX_CUDA_IPC_CACHE` on, UCX keeps every mapping in a per-peer cache (its global `uct_cuda_ipc_remote_cache`,
a khash keyed by the peer's pid, pid namespace and device) until the process exits: a crashed peer's GPU
memory stays held by the survivor, and the peer cannot start again beside it (docs/gpu.md, "A crash costs no
request"). UCX has no call that drops one peer's cache (1.22 closed it at endpoint teardown and reverted that,
openucx/ucx #11335, #11744). Off, each transfer maps and unmaps its regions (slower: plan/transport.py).

Here the survivor does what UCX does not: a thread of the process that holds NIXL's agent looks, every
second, for caches whose peer is gone (its pid missing or a zombie, in this process's pid namespace); after a
short grace it drops each such cache in one native step under the table's own lock (engine/ipc_drop.py: the bucket
checked, none of its regions in a copy, UCX's own `uct_cuda_ipc_destroy_cache`, which closes each handle, so the
dead peer's memory is freed, and the bucket deleted as `kh_del` does). The look itself reads the table without
the lock (what it finds is only a candidate: the native step checks it again). Offsets come from the
disassembly of known builds (BUILDS, by the library file's sha256); on any other build the entry turns the cache
off before UCX starts (guard_cache) and says so.

One count is no copy: UCX maps one region of the first peer on each GPU while NIXL loads that peer's metadata
(its reachability check, openucx/ucx #11288) and keeps it mapped until NIXL unloads the peer, which vLLM does
only once a replacement has handshaken, and the replacement cannot start while the dead peer's memory is held.
The entry learns that region around NIXL's add_remote_agent (a cache that appeared during it, one region mapped
once) and forgets it at remove_remote_agent; the native step frees it with the rest.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from pdserve.engine import ipc_drop
from pdserve.engine.names import IPC_SWEEP_ENV, UCX_LEAK_GUARD

LIBRARY = "libuct_cuda.so"
CACHE_ENV = "UCX_CUDA_IPC_CACHE"
TABLE_SYMBOL = "uct_cuda_ipc_remote_cache"
DESTROY_SYMBOL = "uct_cuda_ipc_destroy_cache"
NS_TYPE_PID = 3                  # UCS_SYS_NS_TYPE_PID, as ucs_sys_get_ns takes it
MAX_BUCKETS = 1 << 16            # more than any process's peers: a bigger count is a table read mid-resize
GRACE_S = 2.0                    # a copy posted just before the peer died finishes well within this
STUCK_S = 30.0                   # a dead peer's region still in a copy this long is said once in the log
INTERVAL_S = 1.0


@dataclass(frozen=True)
class Layout:
    """Offsets in one build of libuct_cuda.so (objdump -d of uct_cuda_ipc_unmap_memhandle, its khash lookup,
    uct_cuda_ipc_destroy_cache and the region close it calls). engine/ipc_drop.py's code has these built in:
    a build with other offsets needs its own code."""
    build: str
    # uct_cuda_ipc_remote_cache: khash_t {u32 n_buckets, size, n_occupied, upper_bound; u32 *flags;
    # key *keys; cache **vals}, then its ucs_rw_spinlock_t (u32 state)
    flags: int = 0x10
    keys: int = 0x18
    vals: int = 0x20
    lock: int = 0x28
    key_size: int = 12            # {pid_t pid; u32 pid_ns; CUdevice device}
    # uct_cuda_ipc_cache_t: its LRU list head (every cached region is on it)
    cache_lru: int = 0x70
    # uct_cuda_ipc_cache_region_t: its LRU link, the key's length, the region's in-flight operations
    region_lru: int = 0x20
    region_bytes: int = 0xd8
    region_refcount: int = 0xf8


# In these builds uct_cuda_ipc_destroy_cache takes a second argument: non-zero closes each region's handle,
# 0 only frees the regions.
BUILDS = {
    "ed9612eb87801cd50dc77e704ab4adffd724651015d41a2a700d2f312511b6f4": Layout("nixl-cu13 1.5.1"),
    "076f42cb3fd1ac0819b1d6db2af92274edb5b0eefd562cf97ed1d48007e72f07": Layout("nixl-cu12 1.5.1"),
}


@dataclass(frozen=True)
class Dropped:
    pid: int
    device: int
    regions: int
    nbytes: int


Peer = tuple[int, int, int]       # a cache's key: the peer's pid, its pid namespace, the device


@dataclass(frozen=True)
class Entry:
    bucket: int
    pid: int
    ns: int
    device: int
    cache: int

    @property
    def peer(self) -> Peer:
        return self.pid, self.ns, self.device


class RemoteCaches:
    """UCX's table of per-peer caches at `base`: looked at without its lock, changed only by ipc_drop's step."""

    def __init__(self, base: int, layout: Layout, destroy: int, drop_step: ipc_drop.DropFunction):
        self.base, self.layout, self.destroy, self.drop_step = base, layout, destroy, drop_step

    def _ptr(self, address: int) -> int:
        return ctypes.c_void_p.from_address(address).value or 0

    def entries(self) -> list[Entry]:
        """The occupied buckets as they look now (candidates: a resize may be under way)."""
        n = ctypes.c_uint32.from_address(self.base).value
        flags, keys = self._ptr(self.base + self.layout.flags), self._ptr(self.base + self.layout.keys)
        vals = self._ptr(self.base + self.layout.vals)
        if not (flags and keys and vals) or n > MAX_BUCKETS:
            return []
        found = []
        for i in range(n):
            if (ctypes.c_uint32.from_address(flags + 4 * (i >> 4)).value >> ((i & 0xF) << 1)) & 3:
                continue                                   # empty or deleted
            key = keys + i * self.layout.key_size
            pid, ns, device = (ctypes.c_uint32.from_address(key + 4 * j).value for j in range(3))
            found.append(Entry(i, ctypes.c_int32(pid).value, ns, ctypes.c_int32(device).value,
                               self._ptr(vals + 8 * i)))
        return found

    def regions(self, cache: int, limit: int = 4096) -> list[tuple[int, int]]:
        """(LRU link, count) of each of a cache's regions, read without its lock: only for a cache no other
        thread can reach yet (its peer's agent still being loaded)."""
        head, found = cache + self.layout.cache_lru, []
        link = self._ptr(head)
        while link and link != head and len(found) < limit:
            found.append((link, ctypes.c_uint64.from_address(
                link + self.layout.region_refcount - self.layout.region_lru).value))
            link = self._ptr(link)
        return found

    def drop(self, entry: Entry, held: int = 0) -> tuple[int, Dropped | None]:
        """ipc_drop's step for the entry: (DROPPED and what went, or IN_USE / CHANGED and None). `held`: the
        LRU link of the region an rkey of the peer holds (its one count is not a copy), or 0."""
        counts = (ctypes.c_uint64 * 2)()
        code = self.drop_step(self.base, entry.bucket, entry.cache, self.destroy, ctypes.byref(counts), held)
        if code != ipc_drop.DROPPED:
            return code, None
        return code, Dropped(entry.pid, entry.device, counts[0], counts[1])


def agent_name(agent: object) -> object:
    """NIXL's add_remote_agent answers bytes; its remove_remote_agent takes a str too."""
    return agent.decode(errors="replace") if isinstance(agent, bytes) else agent


def pid_alive(pid: int) -> bool:
    """Whether `pid` (of this pid namespace) runs: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class DeadPeerSweeper:
    """Drops the caches of peers found dead for GRACE_S and not in use; one sweep a call."""

    def __init__(self, caches: RemoteCaches, own_ns: int, alive: Callable[[int], bool] = pid_alive,
                 grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic):
        self.caches, self.own_ns, self.alive, self.grace_s, self.clock = caches, own_ns, alive, grace_s, clock
        self.dead_since: dict[int, float] = {}
        self.stuck: set[int] = set()     # dead peers whose mappings a copy has held for STUCK_S (said once)
        self.held: dict[Peer, int] = {}                  # the LRU link of the region an rkey holds, by peer
        self.held_by_agent: dict[object, Peer] = {}      # NIXL's name of each such peer

    def note_loaded_peer(self, before: set[Peer], agent: object = None) -> Peer | None:
        """After NIXL loaded one peer's metadata: a cache that appeared meanwhile with one region, mapped once,
        is that peer's, and its one count is the rkey's hold. More than one new cache: no telling whose."""
        new = [e for e in self.caches.entries() if e.peer not in before]
        if len(new) == 1:
            regions = self.caches.regions(new[0].cache)
            if len(regions) == 1 and regions[0][1] == 1:
                self.held[new[0].peer], self.held_by_agent[agent_name(agent)] = regions[0][0], new[0].peer
                return new[0].peer
        return None

    def note_unloaded_agent(self, agent: object) -> None:
        """NIXL unloaded a peer: its rkeys, and so the hold, are gone (a count left on that region is a copy's)."""
        peer = self.held_by_agent.pop(agent_name(agent), None)
        if peer is not None:
            self.held.pop(peer, None)

    def peers(self) -> set[Peer]:
        return {e.peer for e in self.caches.entries()}

    def sweep(self) -> list[Dropped]:
        now, seen, dropped = self.clock(), set(), []
        for entry in self.caches.entries():
            if entry.ns != self.own_ns or self.alive(entry.pid):
                continue            # alive, or of another pid namespace (its pids cannot be checked from here)
            seen.add(entry.pid)
            if entry.pid not in self.dead_since:
                print(f"pdserve-ipc-sweep: peer pid {entry.pid} (device {entry.device}) is gone: its mappings go in "
                      f"{self.grace_s:.0f} s unless a copy holds them", flush=True)
            since = self.dead_since.setdefault(entry.pid, now)
            if now - since < self.grace_s:
                continue
            code, gone = self.caches.drop(entry, self.held.get(entry.peer, 0))
            if gone is not None:
                self.held.pop(entry.peer, None)
                dropped.append(gone)
            elif code == ipc_drop.IN_USE and now - since >= STUCK_S and entry.pid not in self.stuck:
                self.stuck.add(entry.pid)
                print(f"pdserve-ipc-sweep: dead peer pid {entry.pid}: its mappings are still in a copy after "
                      f"{now - since:.0f} s; kept until it ends", flush=True)
        self.dead_since = {pid: t for pid, t in self.dead_since.items() if pid in seen}
        return dropped


def loaded_library(maps: str = "/proc/self/maps") -> str | None:
    with open(maps) as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5].rstrip("\n")).startswith(LIBRARY):
                return fields[5].rstrip("\n")
    return None


def attach(path: str) -> tuple[DeadPeerSweeper | None, str]:
    """A sweeper over the loaded library at `path`, or None and why not."""
    layout = known_build(path)
    if layout is None:
        return None, f"no (a UCX build pdserve has not checked: {path})"
    drop_step = ipc_drop.native_drop()
    if drop_step is None:
        return None, "no (its native step runs on x86-64 Linux only)"
    # The loaded one (dlopen of its own path): its symbols and its libucs's.
    lib = ctypes.CDLL(path)
    get_ns = lib.ucs_sys_get_ns
    get_ns.argtypes, get_ns.restype = [ctypes.c_int], ctypes.c_uint32
    destroy = ctypes.cast(getattr(lib, DESTROY_SYMBOL), ctypes.c_void_p).value
    base = ctypes.addressof(ctypes.c_char.in_dll(lib, TABLE_SYMBOL))
    return DeadPeerSweeper(RemoteCaches(base, layout, destroy, drop_step), get_ns(NS_TYPE_PID)), \
        f"yes ({layout.build})"


def cache_on(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(CACHE_ENV, "y").strip().lower() not in ("n", "no", "off", "0", "false")


def known_build(path: str) -> Layout | None:
    with open(path, "rb") as f:
        return BUILDS.get(hashlib.sha256(f.read()).hexdigest())


def transport_libraries(backend_module: str, env: Mapping[str, str] = os.environ) -> list[str]:
    """The libuct_cuda.so files UCX would load for NIXL's backend package (`nixl_cu13._api`'s
    `nixl_cu13.libs/ucx/`, or UCX_MODULE_DIR); [] where it has none."""
    package = backend_module.partition(".")[0]
    if env.get("UCX_MODULE_DIR"):
        folder = env["UCX_MODULE_DIR"]
    elif (spec := importlib.util.find_spec(package)) is not None and spec.origin:
        folder = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), f"{package}.libs", "ucx")
    else:
        return []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n == LIBRARY or n.startswith(LIBRARY + ".")]


def guard_cache(libraries: list[str], env: MutableMapping[str, str] = os.environ) -> str | None:
    """Before UCX starts: with the cache on and the sweeper unable to run on this UCX build (one pdserve has
    not checked, or not x86-64), turn the cache off, so a crashed peer's GPU memory is never held. Says what it
    did, or None. PDSERVE_IPC_SWEEP=0 leaves UCX's setting as it is."""
    if env.get(IPC_SWEEP_ENV) == "0" or not cache_on(env):
        return None
    unknown = [path for path in libraries if known_build(path) is None]
    if not unknown and (not libraries or ipc_drop.supported()):   # (native_drop would map a page to find out)
        return None
    env[CACHE_ENV] = "n"
    why = f"a UCX build pdserve has not checked: {unknown[0]}" if unknown else "not x86-64 Linux"
    return f"{CACHE_ENV}=n ({why}: a crashed peer's mappings could not be dropped)"


def run(sweeper: DeadPeerSweeper, stop: threading.Event, interval_s: float = INTERVAL_S) -> None:
    while not stop.wait(interval_s):
        for d in sweeper.sweep():
            print(f"pdserve-ipc-sweep: dropped {d.regions} CUDA IPC mapping(s) of dead peer pid {d.pid} "
                  f"(device {d.device}, {d.nbytes / 2**20:.0f} MiB)", flush=True)


RUNNING: list[DeadPeerSweeper] = []      # this process's sweeper, once started


def start() -> str:
    """Start the sweeper thread in this process (after NIXL's agent loaded UCX); says what was done."""
    if os.environ.get(IPC_SWEEP_ENV) == "0":
        return f"off ({IPC_SWEEP_ENV}=0)"
    if not cache_on():
        return f"not needed ({CACHE_ENV}=n: UCX unmaps after each transfer)"
    path = loaded_library()
    if path is None:
        return "not needed (no CUDA IPC transport loaded)"
    sweeper, said = attach(path)
    if sweeper is not None:
        RUNNING.append(sweeper)
        threading.Thread(target=run, args=(sweeper, threading.Event()), name="pdserve-ipc-sweep",
                         daemon=True).start()
    return said


def patch_agent_start() -> bool:
    """Start the sweeper once, right after this process's first NIXL agent is made with its backends (UCX loads
    its CUDA transport when the UCX backend is created, after the agent's own constructor)."""
    os.environ.setdefault(*UCX_LEAK_GUARD)
    try:
        import nixl._api as nixl_api
    except ImportError:
        return False
    guarded = guard_cache(transport_libraries(nixl_api.__name__))
    if guarded:
        print(f"pdserve-ipc-sweep: {guarded}", flush=True)
    agent_class = nixl_api.nixl_agent
    init = agent_class.__init__
    if getattr(init, "pdserve_ipc_sweep", False):
        return True
    started: list[str] = []

    def init_then_sweeper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not started:
            started.append(start())
            print(f"pdserve-ipc-sweep: dropping a dead peer's CUDA IPC mappings: {started[0]}", flush=True)

    add_remote = agent_class.add_remote_agent

    def add_remote_then_note_hold(self, *args, **kwargs):
        before = RUNNING[0].peers() if RUNNING else set()
        name = add_remote(self, *args, **kwargs)
        if RUNNING and (peer := RUNNING[0].note_loaded_peer(before, name)) is not None:
            print(f"pdserve-ipc-sweep: peer pid {peer[0]} (device {peer[2]}): one region mapped by UCX's "
                  "reachability check until NIXL unloads the peer; dropped with the rest if it dies", flush=True)
        return name

    remove_remote = agent_class.remove_remote_agent

    def remove_remote_then_forget_hold(self, agent, *args, **kwargs):
        result = remove_remote(self, agent, *args, **kwargs)
        if RUNNING:
            RUNNING[0].note_unloaded_agent(agent)
        return result

    init_then_sweeper.pdserve_ipc_sweep = True
    agent_class.__init__ = init_then_sweeper
    agent_class.add_remote_agent = add_remote_then_note_hold
    agent_class.remove_remote_agent = remove_remote_then_forget_hold
    return True
