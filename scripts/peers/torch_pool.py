#!/usr/bin/env python3
"""Replay a cuvmm pool trace on PyTorch's CUDA caching allocator and print the result as JSON.

vmmdemo pool --peer torch runs this with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, on the
same (scaled) trace it replays on its own allocators, and includes the JSON printed on the last line
of stdout. The keys are those of vmmdemo's per-allocator result.

Trace format (docs/pool.md): one allocation per line, "<size> <stream> <lifetime> [tag]"; lifetime is
the number of later allocations before the block is freed, "-" for never; '#' starts a comment.
Every --verify-every-th block is filled with a byte pattern when allocated and checked before it is
freed. Latencies are of torch.empty and of dropping the last reference (the allocator's free), as a
Python program sees them.
"""
import argparse
import json
import os
import sys
import time


def parse_size(s):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "kib": 1 << 10, "mib": 1 << 20,
             "gib": 1 << 30, "tib": 1 << 40, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "b": 1}
    low = s.strip().lower()
    for suf in sorted(units, key=len, reverse=True):
        if low.endswith(suf):
            return int(float(low[: -len(suf)]) * units[suf])
    return int(low)


def read_trace(path):
    events = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            if len(fields) not in (3, 4):
                sys.exit(f"trace line {n}: want <size> <stream> <lifetime> [tag]: {line!r}")
            life = -1 if fields[2] == "-" else int(fields[2])
            events.append((parse_size(fields[0]), int(fields[1]), life))
    return events


def percentile(v, q):
    # Interpolates between the two nearest ranks, as measure's percentile does, so that both sides
    # of the comparison report the same statistic.
    if not v:
        return 0
    s = sorted(v)
    pos = q * (len(s) - 1)
    lo = int(pos)
    frac = pos - lo
    if frac == 0 or lo + 1 >= len(s):
        return int(s[min(lo, len(s) - 1)] + 0.5)
    return int(s[lo] * (1 - frac) + s[lo + 1] * frac + 0.5)  # whole nanoseconds, rounded as measure rounds them


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--verify-every", type=int, default=16)
    ap.add_argument("--cache-iters", type=int, default=20000)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()

    import torch

    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    events = read_trace(args.trace)
    streams = [torch.cuda.Stream(device=dev) for _ in range(max(1, args.streams))]
    frees = [[] for _ in range(len(events) + 1)]
    for i, (_, _, life) in enumerate(events):
        if life >= 0:
            frees[min(i + life + 1, len(events))].append(i)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    res = {"verified": True, "verified_blocks": 0, "allocs": 0, "failed_allocs": 0, "largest_request_served_bytes": 0}
    live = [None] * len(events)
    alloc_lat, free_lat = [], []
    in_use = peak_in_use = 0

    def release(j):
        nonlocal in_use
        b = live[j]
        if b is None:
            return
        live[j] = None
        t, size, stream, seed = b
        in_use -= size
        if seed is not None:
            with torch.cuda.stream(stream):  # reductions to scalars: no temporary the size of the block
                ok = int(t.min().item()) == seed and int(t.max().item()) == seed
            if not ok:
                res["verified"] = False
                res["note"] = f"block {j} of {size} bytes changed while allocated"
        with torch.cuda.stream(stream):
            t0 = time.perf_counter_ns()
            del t, b
            free_lat.append(time.perf_counter_ns() - t0)

    start = time.perf_counter()
    for i, (size, s, _) in enumerate(events):
        for j in frees[i]:
            release(j)
        stream = streams[s % len(streams)]
        with torch.cuda.stream(stream):
            t0 = time.perf_counter_ns()
            try:
                t = torch.empty(size, dtype=torch.uint8, device=dev)
            except torch.cuda.OutOfMemoryError as e:
                alloc_lat.append(time.perf_counter_ns() - t0)
                res["failed_allocs"] += 1
                res.setdefault("first_failure", f"allocation {i} of {size} bytes: {str(e).splitlines()[0]}")
                continue
            alloc_lat.append(time.perf_counter_ns() - t0)
            seed = None
            if i % args.verify_every == 0:
                seed = (i * 37 + 11) % 251
                t.fill_(seed)
                res["verified_blocks"] += 1
        live[i] = (t, size, stream, seed)
        del t
        res["allocs"] += 1
        in_use += size
        peak_in_use = max(peak_in_use, in_use)
        res["largest_request_served_bytes"] = max(res["largest_request_served_bytes"], size)
    for j in range(len(live) - 1, -1, -1):
        release(j)
    torch.cuda.synchronize()
    res["replay_seconds"] = time.perf_counter() - start

    res["peak_mapped_bytes"] = torch.cuda.max_memory_reserved(dev)
    res["peak_in_use_bytes"] = peak_in_use
    res["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
    res["mapped_over_in_use"] = res["peak_mapped_bytes"] / peak_in_use if peak_in_use else 0
    res["alloc_p50_ns"], res["alloc_p99_ns"] = percentile(alloc_lat, 0.5), percentile(alloc_lat, 0.99)
    res["free_p50_ns"], res["free_p99_ns"] = percentile(free_lat, 0.5), percentile(free_lat, 0.99)

    # alloc+free pairs from the cache, the sizes vmmdemo uses, on one stream after a warm-up pair each
    sizes = [4 << 10, 256 << 10, 2 << 20, 32 << 20]
    lat = []
    with torch.cuda.stream(streams[0]):
        for n in sizes:
            x = torch.empty(n, dtype=torch.uint8, device=dev)
            del x
        for k in range(args.cache_iters):
            t0 = time.perf_counter_ns()
            x = torch.empty(sizes[k % len(sizes)], dtype=torch.uint8, device=dev)
            del x
            lat.append(time.perf_counter_ns() - t0)
    res["cache_alloc_free_p50_ns"], res["cache_alloc_free_p99_ns"] = percentile(lat, 0.5), percentile(lat, 0.99)
    res["note"] = res.get("note", "") or (
        f"torch {torch.__version__}, PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}; "
        "peak mapped: max_memory_reserved; latencies include the Python call")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
