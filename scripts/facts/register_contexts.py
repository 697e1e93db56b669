#!/usr/bin/env python3
"""How fast cuMemHostRegister pins memory with one CUDA context live, and with two.

    python3 scripts/facts/register_contexts.py [GiB]     (default 16; needs two GPUs)

Maps GiB of anonymous memory with transparent huge pages, faults it in, then registers it in
256 MiB pieces and unregisters it, twice per case: with PORTABLE|DEVICEMAP and with DEVICEMAP
alone, first with device 0's primary context the only one, then with device 1's retained too.
Uses cuda.bindings (cuda-python) and NumPy. docs/driver-facts.md quotes its figures.
"""
import ctypes
import mmap
import sys
import time

import numpy as np
from cuda.bindings import driver as cu

GIB = 1 << 30
PIECE = 256 << 20
HUGE = 2 << 20
PORTABLE, DEVICEMAP = 1, 2


def check(result):
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(result)
    return result[1:]


def aligned_memory(size):
    mem = mmap.mmap(-1, size + HUGE)
    mem.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    np.frombuffer(mem, dtype=np.uint8)[::4096] = 1  # fault every page in
    return mem, (base + HUGE - 1) & ~(HUGE - 1)


def retain(ordinal):
    dev = check(cu.cuDeviceGet(ordinal))[0]
    return check(cu.cuDevicePrimaryCtxRetain(dev))[0]


def register_all(base, size, flags, label):
    ptrs = [base + i * PIECE for i in range(size // PIECE)]
    start = time.perf_counter()
    for p in ptrs:
        check(cu.cuMemHostRegister(p, PIECE, flags))
    reg = time.perf_counter() - start
    start = time.perf_counter()
    for p in ptrs:
        check(cu.cuMemHostUnregister(p))
    unreg = time.perf_counter() - start
    print(f"{label:32s} register {reg:.3f} s ({size / reg / 1e9:.1f} GB/s), unregister {unreg:.3f} s", flush=True)


def main():
    size = int(sys.argv[1]) * GIB if len(sys.argv) > 1 else 16 * GIB
    check(cu.cuInit(0))
    _mem, base = aligned_memory(size)
    ctx0 = retain(0)
    check(cu.cuCtxSetCurrent(ctx0))
    register_all(base, size, PORTABLE | DEVICEMAP, "warm-up")
    for contexts in ("one context", "two contexts"):
        if contexts == "two contexts":
            retain(1)
            check(cu.cuCtxSetCurrent(ctx0))
        for _ in range(2):
            register_all(base, size, PORTABLE | DEVICEMAP, f"{contexts}, PORTABLE|DEVICEMAP")
            register_all(base, size, DEVICEMAP, f"{contexts}, DEVICEMAP")


if __name__ == "__main__":
    main()
