"""Benchmark: how busy the machine is while a group reallocates (is a move CPU-bound?).

Starts a local Ray with simulated nodes (as ``realloc bench`` does), a ``bench-1gb`` group in
``--src``, warms both directions up, then times ``--moves`` moves each way and reads, around
each, the workers' CPU seconds (``/proc/<pid>/stat``: user + system) and the machine's busy
seconds (``/proc/stat``: all but idle and iowait). On a saturated machine ``machine busy`` is
close to ``cores x wall``. Linux only (``/proc``).

Usage:  python benchmarks/cpu_during_move.py [--src tp=8] [--dst dp=4,tp=2] [--moves 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.group import ModelGroup  # noqa: E402
from realloc import ModelSpec, Topology  # noqa: E402
from tools.cluster import ray_for_command  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def workers_cpu(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (after the command name)
    return total / TICK


def machine_busy() -> float:
    with open("/proc/stat") as f:
        values = list(map(int, f.readline().split()[1:]))
    return (sum(values) - values[3] - values[4]) / TICK  # all but idle and iowait


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-1gb")
    parser.add_argument("--src", default="tp=8")
    parser.add_argument("--dst", default="dp=4,tp=2")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--moves", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spec = ModelSpec.preset(args.model)
    src, dst = Topology.parse(args.src), Topology.parse(args.dst)
    cores = len(os.sched_getaffinity(0))
    rows = []
    with ray_for_command(None, args.nodes, -(-src.world_size // args.nodes), 3 * spec.total_bytes() + (256 << 20)):
        group = ModelGroup.create(spec, src, name="cpu-probe", timeout_s=600)
        try:
            group.init_synthetic(0)
            pids = [info["pid"] for info in group.infos]
            for _ in range(2):  # warm-up: plans, communicators, reused pages
                group.reallocate(dst)
                group.reallocate(src)
            for _ in range(args.moves):
                for way, target in (("there", dst), ("back", src)):
                    cpu0, busy0, t0 = workers_cpu(pids), machine_busy(), time.perf_counter()
                    group.reallocate(target)
                    wall = time.perf_counter() - t0
                    rows.append({"way": way, "wall_seconds": wall, "workers_cpu_seconds": workers_cpu(pids) - cpu0,
                                 "machine_busy_seconds": machine_busy() - busy0, "cores": cores})
            bad = group.verify_synthetic(0)
        finally:
            group.shutdown()
    if args.json:
        print(json.dumps({"src": args.src, "dst": args.dst, "model": args.model, "rows": rows, "verified": not bad}))
    else:
        for r in rows:
            print(f"{r['way']:<6} wall {r['wall_seconds']:.3f}s  workers' CPU {r['workers_cpu_seconds']:.2f}s  "
                  f"machine busy {r['machine_busy_seconds']:.2f}s of {cores * r['wall_seconds']:.2f}s")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
