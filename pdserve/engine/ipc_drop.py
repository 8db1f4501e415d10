"""The one step of engine/ipc_sweep.py that runs under UCX's lock, as machine code (x86-64) called with the GIL held.

UCX's table of per-peer CUDA IPC caches is guarded by a spinlock that NIXL's threads take without Python's GIL,
and some of NIXL's Python calls take it while holding the GIL. Python code holding that spinlock could lose the
GIL between two bytecodes to such a caller, which would then spin forever on the lock: so the locked step is
one native call, made through ctypes.PYFUNCTYPE (the GIL stays held for its whole length), that takes the lock,
checks the bucket still holds the cache it was asked to drop and that none of the cache's regions is in a copy
(counting them and their bytes; the region an rkey of the peer holds, if named, may keep that one count), calls
UCX's uct_cuda_ipc_destroy_cache(cache, 1) (1: close each handle), marks the bucket deleted as kh_del does, and
gives the lock back. It returns DROPPED, IN_USE or CHANGED (the lock
held by another, or the bucket no longer the one asked for).

The offsets are engine/ipc_sweep.py's Layout (the same in both checked builds); ASM is the source, assembled
with `as --64` and `objcopy -O binary -j .text` into CODE (tests/unit/test_ipc_sweep.py assembles it again and
compares).
"""

from __future__ import annotations

import ctypes
import mmap
import platform

CHANGED, DROPPED, IN_USE = 0, 1, 2

ASM = """\
.intel_syntax noprefix
.text
.globl drop
# int drop(table *rdi, uint32 bucket esi, cache *rdx, destroy rcx, uint64 out[2] r8, held link r9)
drop:
    push rbx
    push r12
    push r13
    push r14
    push r15
    mov rbx, rdi
    mov r12d, esi
    mov r13, rdx
    mov r14, rcx
    mov r15, r8
    mov eax, dword ptr [rbx+0x28]       # the lock: no reader, no writer (a waiting writer's bit may be set)
    cmp eax, 2
    jae 9f
    mov edx, eax
    or edx, 2
    lock cmpxchg dword ptr [rbx+0x28], edx
    jne 9f
    cmp r12d, dword ptr [rbx]           # bucket < n_buckets
    jae 8f
    mov rax, qword ptr [rbx+0x10]       # flags: the bucket's two bits 0 (occupied)
    mov edx, r12d
    shr edx, 4
    mov r8d, dword ptr [rax+rdx*4]
    mov ecx, r12d
    and ecx, 15
    add ecx, ecx
    shr r8d, cl
    test r8d, 3
    jnz 8f
    mov rax, qword ptr [rbx+0x20]       # vals[bucket] is the cache asked for
    mov edx, r12d
    cmp qword ptr [rax+rdx*8], r13
    jne 8f
    mov qword ptr [r15], 0
    mov qword ptr [r15+8], 0
    lea rdx, [r13+0x70]                 # the cache's LRU list: every region, linked at region+0x20
    mov rax, qword ptr [rdx]
1:
    cmp rax, rdx
    je 2f
    mov rcx, qword ptr [rax+0xd8]       # region->refcount (region+0xf8): copies in flight, and the rkey's hold
    test rcx, rcx
    jz 5f
    cmp rax, r9                         # the region an rkey holds: free if that hold is its only count
    jne 7f
    cmp rcx, 1
    jne 7f
5:
    inc qword ptr [r15]
    mov rcx, qword ptr [rax+0xb8]       # region->key.b_len (region+0xd8)
    add qword ptr [r15+8], rcx
    mov rax, qword ptr [rax]
    jmp 1b
2:
    mov rdi, r13
    mov esi, 1
    call r14                            # uct_cuda_ipc_destroy_cache(cache, 1)
    mov rax, qword ptr [rbx+0x10]       # kh_del: the bucket's deleted bit, one entry fewer
    mov edx, r12d
    shr edx, 4
    mov ecx, r12d
    and ecx, 15
    add ecx, ecx
    mov r8d, 1
    shl r8d, cl
    or dword ptr [rax+rdx*4], r8d
    dec dword ptr [rbx+4]
    lock sub dword ptr [rbx+0x28], 2
    mov eax, 1
    jmp 3f
7:
    lock sub dword ptr [rbx+0x28], 2
    mov eax, 2
    jmp 3f
8:
    lock sub dword ptr [rbx+0x28], 2
9:
    xor eax, eax
3:
    pop r15
    pop r14
    pop r13
    pop r12
    pop rbx
    ret
"""

CODE = bytes.fromhex(
    "5341544155415641574889fb4189f44989d54989ce4d89c78b432883f8020f83df00000089c283ca02f00fb153280f85"
    "cf000000443b230f83c1000000488b43104489e2c1ea04448b04904489e183e10f01c941d3e841f7c0030000000f859b"
    "000000488b43204489e24c392cd00f858a00000049c7070000000049c7470800000000498d5570488b024839d0742a48"
    "8b88d80000004885c9740b4c39c875524883f901754c49ff07488b88b800000049014f08488b00ebd14c89efbe010000"
    "0041ffd6488b43104489e2c1ea044489e183e10f01c941b80100000041d3e044090490ff4b04f0836b2802b801000000"
    "eb13f0836b2802b802000000eb07f0836b280231c0415f415e415d415c5bc3")

DropFunction = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_uint64 * 2), ctypes.c_void_p)


def supported() -> bool:
    """Whether CODE can run here (x86-64)."""
    return platform.machine() in ("x86_64", "AMD64")


def native_drop() -> DropFunction | None:
    """CODE in an executable page of its own (written, then made read+execute), as a function; None off
    x86-64 Linux."""
    if not supported():
        return None
    libc = ctypes.CDLL(None)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     -1, 0)
    if page in (None, ctypes.c_void_p(-1).value):
        return None
    ctypes.memmove(page, CODE, len(CODE))
    if libc.mprotect(page, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        return None
    return DropFunction(page)      # the page is never unmapped: the function lives as long as the process
