#!/usr/bin/env python3
"""PyTorch's torch.distributed NCCL send/recv between two processes, one GPU each: the peer that
`vmmdemo xfer --peer torch` measures beside cuvmm's NCCL binding, in the same run.

Timing is the same as cuvmm's: the receiver (rank 1) does --warmup transfers, synchronizes the
device, reads the clock, does --iters transfers, synchronizes, reads the clock; GB/s is
size * iters / elapsed / 1e9. The receiver then checks the last transfer against the sender's
pattern. Prints one line of JSON on stdout. The environment (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE,
NCCL_SOCKET_IFNAME, NCCL_NVLS_ENABLE, ...) is inherited by both processes.

    torch_sendrecv.py --size BYTES [--warmup 3] [--iters 10] [--devices 0,1]
"""
import argparse
import json
import os
import socket
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PIECE = 256 << 20  # the pattern is made and checked in pieces, to keep temporaries small


def pattern(torch, start, n, device):
    """Bytes start..start+n of a position-dependent pattern: byte i is (i * 131 + 7) mod 251."""
    return ((torch.arange(start, start + n, device=device, dtype=torch.int64) * 131 + 7) % 251).to(torch.uint8)


def fill(torch, buf):
    for off in range(0, buf.numel(), PIECE):
        n = min(PIECE, buf.numel() - off)
        buf[off:off + n] = pattern(torch, off, n, buf.device)


def check(torch, buf):
    for off in range(0, buf.numel(), PIECE):
        n = min(PIECE, buf.numel() - off)
        if not torch.equal(buf[off:off + n], pattern(torch, off, n, buf.device)):
            return False
    return True


def rank_main(rank, args, port, queue):
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", args.devices[rank])
    torch.cuda.set_device(dev)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    start = time.perf_counter()
    # device_id makes the communicator eagerly, so init_seconds covers NCCL's initialization.
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    init_seconds = time.perf_counter() - start
    buf = torch.zeros(args.size, dtype=torch.uint8, device=dev)
    if rank == 0:
        fill(torch, buf)
    torch.cuda.synchronize()

    def step():
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    result = None
    if rank == 1:
        verified = check(torch, buf)
        result = {
            "gbps": args.size * args.iters / seconds / 1e9,
            "seconds": seconds,
            "size_bytes": args.size,
            "warmup": args.warmup,
            "iters": args.iters,
            "verified": verified,
            "init_seconds": init_seconds,
            "torch_version": torch.__version__,
            "nccl_version": ".".join(str(v) for v in torch.cuda.nccl.version()),
        }
    dist.barrier()
    dist.destroy_process_group()
    if result is not None:
        queue.put(result)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, required=True, help="bytes per transfer")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--devices", default="0,1", help="the sender's and the receiver's GPU")
    args = p.parse_args()
    args.devices = [int(d) for d in args.devices.split(",")]
    if len(args.devices) != 2 or args.size <= 0:
        p.error("--devices wants two ordinals and --size a positive byte count")

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = None
    deadline = time.time() + 600
    try:
        while result is None and time.time() < deadline:
            try:
                result = queue.get(timeout=1)
            except Exception:  # queue.Empty: stop waiting once a rank has failed or both ended
                if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode is not None for p in procs):
                    break
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    if result is None or any(proc.exitcode != 0 for proc in procs):
        print("torch_sendrecv: a rank failed", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
