"""The real libuct_cuda.so of the installed NIXL wheel, loaded on a machine without CUDA: stub libcuda.so.1 and
libnvidia-ml.so.1 (built here with gcc: every function the library imports returns success; cuIpcCloseMemHandle
also writes the address it closes to $STUB_CLOSED_LOG), so engine/ipc_sweep.py can be run against UCX's own
table, lock, cache and destroy function. `child()` runs in a subprocess with LD_LIBRARY_PATH on the stubs.

The child builds what a server's pulls leave in UCX's table: one real cache per peer (uct_cuda_ipc_create_cache)
holding one mapped region (in the cache's real page table, ucs_pgtable_insert, and on its LRU list), each in
the table's bucket UCX's own hash puts it. It then asks the library itself, through uct_cuda_ipc_unmap_memhandle,
which caches it still finds (an unmap of a cached region lowers its in-flight count, at the region's offset).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.engine import ipc_sweep

CLOSED_LOG_ENV = "STUB_CLOSED_LOG"

STUB_SPECIAL = {
    "cuIpcCloseMemHandle": """int cuIpcCloseMemHandle(unsigned long long p) {
    FILE *f = fopen(getenv("STUB_CLOSED_LOG"), "a"); if (f) { fprintf(f, "%llu\\n", p); fclose(f); } return 0; }""",
    "cuDevicePrimaryCtxGetState": """int cuDevicePrimaryCtxGetState(int d, unsigned *flags, int *active) {
    *flags = 0; *active = 1; return 0; }""",
    "cuDevicePrimaryCtxRetain": "int cuDevicePrimaryCtxRetain(void **ctx, int d) { *ctx = (void *)1; return 0; }",
}


PACKAGES = ("nixl_cu13", "nixl_cu12")      # the GPU nodes' first (vLLM 0.26's CUDA 13 wheels)


def nixl_library(package: str | None = None) -> Path:
    """libuct_cuda.so of the installed nixl-cu13 (or nixl-cu12) wheel, or of `package`'s."""
    for name in (package,) if package else PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec and spec.origin:
            libs = Path(spec.origin).parent.parent / f"{name}.libs" / "ucx"
            found = [p for p in sorted(libs.glob("libuct_cuda.so*")) if not p.name.endswith(".la")]
            if found:
                return found[0]
    raise FileNotFoundError(f"no {package or 'nixl-cu13/nixl-cu12'} wheel with libuct_cuda.so is installed")


def build_stubs(library: Path, into: Path) -> None:
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(library)], check=True, capture_output=True,
                               text=True).stdout.split()
    for soname, prefix in (("libcuda.so.1", "cu"), ("libnvidia-ml.so.1", "nvml")):
        names = sorted({n.partition("@")[0] for n in undefined if n.startswith(prefix) and n[len(prefix)].isupper()})
        body = ["#include <stdio.h>", "#include <stdlib.h>"]
        body += [STUB_SPECIAL.get(n, f"int {n}(void) {{ return 0; }}") for n in names]
        source = into / f"{soname}.c"
        source.write_text("\n".join(body) + "\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(into / soname), str(source)], check=True)


def run_child(tmp: Path, scenario: str, package: str | None = None) -> dict:
    """Run `child(scenario)` against the real library (of `package`'s wheel); its JSON report."""
    library = nixl_library(package)
    build_stubs(library, tmp)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp), CLOSED_LOG_ENV: str(tmp / "closed.log")}
    out = subprocess.run([sys.executable, "-c", f"from tests.kits.uct_cuda_rig import child; child({scenario!r})",
                          str(library)], env=env, capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    log = tmp / "closed.log"
    report["closed"] = [int(x) for x in log.read_text().split()] if log.exists() else []
    return report


# ---- in the child ----------------------------------------------------------------------------------------

REGION_SIZE = 0x108
HANDLE_TYPE_LEGACY, HANDLE_TYPE_AT, MAPPED_AT, DEVICE_AT = 1, 0x30, 0xf0, 0x100
PGTABLE_AT = 0x38      # uct_cuda_ipc_cache_t: its pthread_rwlock_t, then the page table


def _hash(pid: int, ns: int, device: int) -> int:
    """uct_cuda_ipc_cache_hash_func, kh_int64_hash_func of it (khint32_t)."""
    value = (pid ^ (ns << 32) ^ ((device & 0xFFFFFFFF) << 24)) & (2**64 - 1)
    return ((value >> 33) ^ value ^ (value << 11)) & 0xFFFFFFFF


def child(scenario: str) -> None:
    library = sys.argv[1]
    lib = ctypes.CDLL(library)
    libc = ctypes.CDLL(None)
    libc.calloc.restype, libc.calloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]
    sweeper, said = ipc_sweep.attach(library)
    assert sweeper is not None, said
    caches, layout = sweeper.caches, sweeper.caches.layout
    create = lib.uct_cuda_ipc_create_cache
    create.argtypes, create.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p], ctypes.c_int8
    insert = lib.ucs_pgtable_insert
    insert.argtypes, insert.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int8
    unmap = lib.uct_cuda_ipc_unmap_memhandle
    unmap.argtypes = [ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int]

    def u32(address: int) -> ctypes.c_uint32:
        return ctypes.c_uint32.from_address(address)

    def ptr(address: int) -> ctypes.c_uint64:
        return ctypes.c_uint64.from_address(address)

    # The table, as kh_resize would leave it at 8 buckets (all empty: 0b10 each).
    base, n = caches.base, 8
    u32(base).value, u32(base + 12).value = n, int(n * 0.77 + 0.5)
    ptr(base + layout.flags).value = flags = libc.calloc(1, 4)
    u32(flags).value = 0xAAAAAAAA
    ptr(base + layout.keys).value = keys = libc.calloc(n, layout.key_size)
    ptr(base + layout.vals).value = vals = libc.calloc(n, 8)

    gone = subprocess.Popen(["true"])
    gone.wait()                                     # a pid that ran and is gone (reaped)
    peers = {"dead": gone.pid, "live": os.getpid(), "other_ns_dead": gone.pid}
    ns = sweeper.own_ns
    regions, cache_of = {}, {}
    for i, (name, pid) in enumerate(peers.items()):
        peer_ns = ns if name != "other_ns_dead" else ns ^ 1
        cache = ctypes.c_void_p()
        assert create(ctypes.byref(cache), name.encode()) == 0
        region = libc.calloc(1, REGION_SIZE)
        start = 0x7F00_0000_0000 + i * 0x100000
        ptr(region).value, ptr(region + 8).value = start, start + 0x1000      # ucs_pgt_region_t
        u32(region + HANDLE_TYPE_AT).value = HANDLE_TYPE_LEGACY
        ptr(region + 0xd0).value, ptr(region + layout.region_bytes).value = start, 0x1000   # d_bptr, b_len
        ptr(region + MAPPED_AT).value = 0x5000_0000 + i
        u32(region + DEVICE_AT).value = 0
        assert insert(cache.value + PGTABLE_AT, region) == 0
        head, link = cache.value + layout.cache_lru, region + layout.region_lru     # ucs_list_add_tail
        ptr(link).value, ptr(link + 8).value = head, ptr(head + 8).value
        ptr(ptr(head + 8).value).value = link
        ptr(head + 8).value = link
        bucket, step = _hash(pid, peer_ns, 0) & (n - 1), 0
        while not (u32(flags).value >> (bucket << 1)) & 2:       # taken: khash's probe
            step += 1
            bucket = (bucket + step) & (n - 1)
        u32(flags).value &= ~(3 << (bucket << 1))
        key = keys + bucket * layout.key_size
        u32(key).value, u32(key + 4).value, u32(key + 8).value = pid, peer_ns, 0
        ptr(vals + 8 * bucket).value = cache.value
        u32(base + 4).value += 1
        u32(base + 8).value += 1
        regions[name] = (region, start, 0x5000_0000 + i)
        cache_of[name] = cache.value

    def refcount(name: str) -> int:
        return ptr(regions[name][0] + layout.region_refcount).value

    report: dict = {"said": said, "mapped": {k: v[2] for k, v in regions.items()}}
    if scenario == "reader":
        # UCX itself holds the table's read lock: an unmap of the live peer's region waits, inside it, for
        # that cache's own lock, which this thread holds.
        cache_lock = cache_of["live"]
        assert libc.pthread_rwlock_wrlock(ctypes.c_void_p(cache_lock)) == 0
        ptr(regions["live"][0] + layout.region_refcount).value = 1
        live = regions["live"]
        reader = threading.Thread(target=unmap, args=(peers["live"], ns, live[1], live[2], 0, 1))
        reader.start()
        time.sleep(0.3)
        sweeper.grace_s = 0.0
        report["while_read"] = [d.__dict__ for d in sweeper.sweep()]
        libc.pthread_rwlock_unlock(ctypes.c_void_p(cache_lock))
        reader.join()
    if scenario == "in_use":
        ptr(regions["dead"][0] + layout.region_refcount).value = 1          # a copy still in flight
    if scenario == "held":
        # The dead peer's one region mapped once by an rkey's reachability check, learnt from the table as
        # the entry does when NIXL loads a peer (here the peer's cache is the one "loaded").
        ptr(regions["dead"][0] + layout.region_refcount).value = 1
        before = sweeper.peers() - {(peers["dead"], ns, 0)}
        report["regions"] = [[link - regions["dead"][0], count] for link, count in caches.regions(cache_of["dead"])]
        sweeper.note_loaded_peer(before)
        report["held"] = [[k[0] == peers["dead"], v - regions["dead"][0]] for k, v in sweeper.held.items()]
    sweeper.grace_s = 0.0
    report["first"] = [d.__dict__ for d in sweeper.sweep()]
    if scenario == "in_use":
        ptr(regions["dead"][0] + layout.region_refcount).value = 0          # it finished
        report["after_release"] = [d.__dict__ for d in sweeper.sweep()]
    report["size"] = u32(base + 4).value
    report["lock"] = u32(base + layout.lock).value
    # The library's own lookups: an unmap of a cached region lowers its count where the cache is still found;
    # where it was dropped the library finds no cache for the peer and touches nothing.
    dropped = {d["pid"] for d in report["first"] + report.get("after_release", [])}
    for name in ("dead", "live"):
        region, start, mapped = regions[name]
        if peers[name] in dropped and name == "dead":
            unmap(peers[name], ns, start, mapped, 0, 1)
            continue
        ptr(region + layout.region_refcount).value = 1
        unmap(peers[name], ns, start, mapped, 0, 1)
        report[f"{name}_refcount_after_unmap"] = refcount(name)
    report["entries"] = sorted(e.pid for e in caches.entries())
    print(json.dumps(report), flush=True)
    os._exit(0)       # UCX's exit cleanup would free this test's hand-made table
