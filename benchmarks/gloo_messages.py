"""Benchmark: gloo point-to-point throughput by message size, one message at a time or several posted at once.

Two spawned processes (``torch.distributed`` gloo over loopback) move ``--total-mb`` from rank 0
to rank 1 cut into messages of each ``--sizes-mb``, three ways: ``seq`` (blocking send/recv
per message, what an executor that waits for each message does), ``window4`` (up to 4
messages posted ahead) and ``all`` (every message posted, then waited). gloo's unbound-buffer
send is a rendezvous (the receiver's "ready" reaches the sender before the bytes go), so a
message costs a round trip between the two processes on top of its bytes; posting ahead
overlaps those round trips. Best of 4 after a warm-up.

Usage:  python benchmarks/gloo_messages.py [--total-mb 128] [--sizes-mb 64,2,1]
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, port: int, total: int, sizes: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.ones(total, dtype=torch.uint8)
    for size in sizes:
        count = total // size
        for mode, window in (("seq", 1), ("window4", 4), ("all", count)):
            best = float("inf")
            for rep in range(5):
                dist.barrier()
                start = time.perf_counter()
                pending = []
                for i in range(count):
                    part = buf[i * size : (i + 1) * size]
                    op = dist.isend if rank == 0 else dist.irecv
                    pending.append(op(part, 1 - rank))
                    if len(pending) >= window:
                        pending.pop(0).wait()
                for work in pending:
                    work.wait()
                if rep:
                    best = min(best, time.perf_counter() - start)
            if rank == 1:
                print(
                    f"messages of {size / 1e6:7.2f} MB x {count:4d}  {mode:8s} {total / best / 1e9:5.2f} GB/s",
                    flush=True,
                )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=128)
    parser.add_argument("--sizes-mb", default="64,2,1")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [int(float(x) * (1 << 20)) for x in args.sizes_mb.split(",")]
    mp.start_processes(_run, args=(port, args.total_mb << 20, sizes), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
