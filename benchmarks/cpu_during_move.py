"""Benchmark: how busy the machine is while a group reallocates (is a move CPU-bound?).

Starts a local Ray with simulated nodes (as ``realloc bench`` does), a ``bench-1gb`` group in
``--src``, warms both directions up, then times ``--moves`` moves each way and reads, around
each, the CPU seconds (``/proc/<pid>/stat``: user + system) of every process by kind: the
workers, the driver (this process), Ray's own processes (GCS, raylets, agents), kernel threads
(``ksoftirqd`` carries the loopback TCP of gloo), and everything else; and the machine's busy
seconds (``/proc/stat``: all but idle and iowait). On a saturated machine ``machine busy`` is
close to ``cores x wall``, and what is not the workers' is what a move could still win back.
Linux only (``/proc``).

Usage:  python benchmarks/cpu_during_move.py [--src tp=8] [--dst dp=4,tp=2] [--moves 4] [--json]

The clock ticks are 10 ms (``SC_CLK_TCK``), so single moves of tens of ms read coarsely; the
means over ``--moves`` (a tick lands in a move in proportion to its length) are the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.driver.group import ModelGroup
from realloc import ModelSpec, Topology
from realloc_tools.cluster import ray_for_command

TICK = os.sysconf("SC_CLK_TCK")


KINDS = ("workers", "driver", "ray", "kernel", "other")


def _kind(pid: int, name: str, ppid: int, workers: set[int]) -> str:
    if pid in workers:
        return "workers"
    if pid == os.getpid():
        return "driver"
    if pid == 2 or ppid == 2:  # kthreadd and its children
        return "kernel"
    if name.startswith("ray::") or name in ("gcs_server", "raylet"):
        return "ray"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "other"
    return "ray" if b"/site-packages/ray/" in cmd else "other"


def cpu_by_process(workers: set[int]) -> dict[int, tuple[str, float]]:
    """Every process's (kind, CPU seconds so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:  # exited meanwhile
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        pid = int(entry)
        # ppid, utime, stime (after the command name)
        out[pid] = (_kind(pid, name, int(fields[1]), workers), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by kind between two :func:`cpu_by_process` snapshots (processes that started
    in between count from zero; ones that exited are lost)."""
    out = dict.fromkeys(KINDS, 0.0)
    for pid, (kind, seconds) in after.items():
        out[kind] += seconds - before.get(pid, (kind, 0.0))[1]
    return out


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
            pids = {info["pid"] for info in group.infos}
            for _ in range(2):  # warm-up: plans, communicators, reused pages
                group.reallocate(dst)
                group.reallocate(src)
            for _ in range(args.moves):
                for way, target in (("there", dst), ("back", src)):
                    cpu0, busy0 = cpu_by_process(pids), machine_busy()
                    t0, driver0 = time.perf_counter(), time.process_time()
                    group.reallocate(target)
                    wall, driver = time.perf_counter() - t0, time.process_time() - driver0
                    busy = machine_busy() - busy0
                    by_kind = cpu_delta(cpu0, cpu_by_process(pids))
                    # this process's own figure from around the call alone: the snapshots' reading
                    # of /proc (about a millisecond each) would otherwise count as the driver's
                    by_kind["driver"] = driver
                    rows.append(
                        {
                            "way": way,
                            "wall_seconds": wall,
                            "workers_cpu_seconds": by_kind["workers"],
                            "cpu_seconds_by_kind": by_kind,
                            "machine_busy_seconds": busy,
                            "cores": cores,
                        }
                    )
            bad = group.verify_synthetic(0)
        finally:
            group.shutdown()
    if args.json:
        print(json.dumps({"src": args.src, "dst": args.dst, "model": args.model, "rows": rows, "verified": not bad}))
    else:
        for r in rows:
            kinds = "  ".join(f"{k} {v * 1e3:.0f}" for k, v in r["cpu_seconds_by_kind"].items())
            print(
                f"{r['way']:<6} wall {r['wall_seconds'] * 1e3:.0f} ms  CPU ms: {kinds}  "
                f"machine busy {r['machine_busy_seconds'] * 1e3:.0f} of {cores * r['wall_seconds'] * 1e3:.0f}"
            )
        for way in ("there", "back"):
            mine = [r for r in rows if r["way"] == way]
            mean = {k: statistics.fmean(r["cpu_seconds_by_kind"][k] for r in mine) * 1e3 for k in KINDS}
            print(
                f"mean {way:<6} wall {statistics.fmean(r['wall_seconds'] for r in mine) * 1e3:.1f} ms  "
                f"machine busy {statistics.fmean(r['machine_busy_seconds'] for r in mine) * 1e3:.1f} ms  CPU ms: "
                + "  ".join(f"{k} {v:.1f}" for k, v in mean.items())
            )
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
