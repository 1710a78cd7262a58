"""Benchmark: does this machine's copy rate scale with the processes copying at once?

Starts ``--procs`` processes (1, 2, ... by default up to the CPUs this process may use), each
with two warm buffers of ``--mb`` MiB; all copy at once with ``torch.Tensor.copy_`` (one torch
thread each), timed barrier -> copy -> barrier, best of ``--repeats``: bytes of all processes
over the time from all starting to the last finishing (a process timing only its own copy
could run while the others wait for a CPU and look fast). Prints that rate per count and what
each process saw of its own copy. ``realloc bench``'s lower bound charges copies at what such
concurrent copiers reach (``memcpy_cores_gbps``), not at cores x one core (docs/benchmarks.md).

Usage:  python benchmarks/memcpy_concurrency.py [--mb 127] [--repeats 3] [--procs 1,2,4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _copier(nbytes: int, repeats: int, barrier, out) -> None:
    import torch

    torch.set_num_threads(1)
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    together = own = float("inf")
    for _ in range(repeats):
        barrier.wait()
        t = time.perf_counter()
        b.copy_(a)
        own = min(own, time.perf_counter() - t)
        barrier.wait()
        together = min(together, time.perf_counter() - t)
    out.put((together, nbytes / own / 1e9))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=127)
    parser.add_argument("--repeats", type=int, default=3)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parser.add_argument("--procs", default=",".join(str(n) for n in sorted({1, 2, cpus, 2 * cpus})))
    args = parser.parse_args(argv)
    nbytes = int(args.mb * (1 << 20))
    ctx = mp.get_context("spawn")
    for n in (int(x) for x in args.procs.split(",")):
        barrier, out = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_copier, args=(nbytes, args.repeats, barrier, out)) for _ in range(n)]
        for p in procs:
            p.start()
        results = [out.get() for _ in procs]
        for p in procs:
            p.join()
        wall = max(t for t, _ in results)
        own = sorted(r for _, r in results)
        print(
            f"{n} process(es) copying {args.mb:g} MiB each at once: {n * nbytes / wall / 1e9:.1f} GB/s together "
            f"(each one's own copy: {', '.join(f'{r:.1f}' for r in own)} GB/s; best of {args.repeats})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
