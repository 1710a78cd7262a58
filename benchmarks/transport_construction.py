"""Benchmark: what a private process group costs next to torch's registered groups (gloo, CPU).

For 2 and 4 processes (torch.multiprocessing spawn, one machine, one TCPStore opened by the
parent on an OS-chosen port), each rank measures:

  private       ``actors.wire.communicator.private_group`` (what the transport builds: a ProcessGroup
                on a PrefixStore with a gloo backend, never registered in torch's ``_world``)
  init_pg       ``dist.init_process_group(backend="gloo", store=...)`` (the default group)
  new_group     ``dist.new_group(all ranks)`` after ``init_process_group`` (not counted)

Construction time: all ranks leave a store barrier together, each times its own call; the
table shows the median over ``--reps`` rounds of the slowest rank. Throughput: ranks r and r^1
exchange 64 MiB each way at once (``communicator.exchange`` on the private group,
``batch_isend_irecv`` on the others), one warm-up each, then ``--reps`` rounds with the three
methods interleaved (load from elsewhere hits them alike); median of the slowest rank; GB/s is
bytes received per rank over that time.

Usage:  PYTHONPATH=$PWD python benchmarks/transport_construction.py [--sizes 2 4] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20
TIMEOUT_S = 60.0
CPU = torch.device("cpu")


def _sync(store: dist.Store, key: str, n: int) -> None:
    """All ``n`` ranks leave together (as far as a store round trip allows)."""
    if store.add(key, 1) == n:
        store.set(key + "/go", b"1")
    store.wait([key + "/go"])


def _worker(rank: int, port: int, n: int, reps: int, nbytes: int) -> None:
    from actors.wire import communicator

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=timeout)
    peer = rank ^ 1
    send = torch.ones(nbytes, dtype=torch.uint8)
    recv = torch.zeros(nbytes, dtype=torch.uint8)
    result: dict[str, dict] = {}

    def p2p_private(pg):
        def run(nb):
            for w in communicator.exchange(pg, CPU, (peer, send[:nb]), (peer, recv[:nb])):
                w.wait()

        return run

    def p2p_registered(group):
        def run(nb):
            ops = [dist.P2POp(dist.isend, send[:nb], peer, group), dist.P2POp(dist.irecv, recv[:nb], peer, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        return run

    # (a) private groups
    times, groups = [], []
    for i in range(reps):
        _sync(store, f"sync/private/{i}", n)
        t0 = time.perf_counter()
        groups.append(communicator.private_group(store, f"bench/private/{i}", rank, n, CPU, TIMEOUT_S))
        times.append(time.perf_counter() - t0)

    # (c) init_process_group, (b) new_group after it
    init_times, new_times = [], []
    for i in range(reps):
        _sync(store, f"sync/init/{i}", n)
        t0 = time.perf_counter()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"bench/init/{i}", store), rank=rank, world_size=n, timeout=timeout
        )
        init_times.append(time.perf_counter() - t0)
        if i < reps - 1:
            dist.destroy_process_group()
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        group = dist.new_group(list(range(n)))
        new_times.append(time.perf_counter() - t0)
    # throughput, interleaved so that load from elsewhere hits every method alike
    runs = {"private": p2p_private(groups[0]), "new_group": p2p_registered(group), "init_pg": p2p_registered(None)}
    p2p: dict[str, list[float]] = {m: [] for m in runs}
    for run in runs.values():
        run(nbytes)  # warm-up: first use of the pair
    for _ in range(reps):
        for m, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run(nbytes)
            p2p[m].append(time.perf_counter() - t0)
    result["private"] = {"construct": times, "p2p": p2p["private"]}
    result["init_pg"] = {"construct": init_times, "p2p": p2p["init_pg"]}
    result["new_group"] = {"construct": new_times, "p2p": p2p["new_group"]}
    # the private groups still work after the user destroys everything registered
    dist.destroy_process_group()
    p2p_private(groups[-1])(1024)
    for g in groups:
        communicator.close(g)
    store.set(f"result/{rank}", json.dumps(result))


def measure(n: int, reps: int, nbytes: int) -> dict:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    mp.start_processes(_worker, args=(store.port, n, reps, nbytes), nprocs=n, join=True, start_method="spawn")
    per_rank = [json.loads(store.get(f"result/{r}")) for r in range(n)]
    out = {}
    for method in ("private", "new_group", "init_pg"):
        slowest = [max(per_rank[r][method]["construct"][i] for r in range(n)) for i in range(reps)]
        p2p = [max(per_rank[r][method]["p2p"][i] for r in range(n)) for i in range(reps)]
        out[method] = {
            "construct_ms": 1e3 * statistics.median(slowest),
            "construct_ms_range": [1e3 * min(slowest), 1e3 * max(slowest)],
            "p2p_seconds": statistics.median(p2p),
            "p2p_gbps": nbytes / statistics.median(p2p) / 1e9,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if any(n < 2 or n % 2 for n in args.sizes) or args.reps < 1 or args.mib < 1:
        ap.error("sizes must be even numbers >= 2 (ranks exchange in pairs); reps and mib >= 1")
    env = {"torch": torch.__version__, "cores": os.cpu_count(), "loadavg_before": os.getloadavg()}
    results = {n: measure(n, args.reps, args.mib * MIB) for n in args.sizes}
    env["loadavg_after"] = os.getloadavg()
    if args.json:
        print(json.dumps({"env": env, "results": results}, indent=1))
        return 0
    print(
        f"torch {env['torch']}, {env['cores']} cores, gloo; load average {env['loadavg_before'][0]:.1f} before, "
        f"{env['loadavg_after'][0]:.1f} after; median of {args.reps}"
    )
    print(f"{'procs':>5}  {'method':<10} {'construct ms (min-max)':>24}  {args.mib} MiB exchange s   GB/s")
    for n, res in results.items():
        for method, r in res.items():
            lo, hi = r["construct_ms_range"]
            print(
                f"{n:>5}  {method:<10} {r['construct_ms']:>8.1f} ({lo:6.1f}-{hi:6.1f})  "
                f"{r['p2p_seconds']:>17.3f}  {r['p2p_gbps']:5.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
