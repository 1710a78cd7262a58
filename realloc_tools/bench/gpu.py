"""``realloc bench-gpu``: reallocation between workers that share one GPU, against the GPU's own
copy bandwidth measured in the same run.

Every worker holds its shards in CUDA memory (``use_gpu=True``, ``gpus_per_worker=1/workers``):
the RLHF case where the trainer and the generation engine run on the same GPUs (colocated, as in
veRL's hybrid engine). A move is then all device-to-device copies: each worker reads its boxes
straight out of its peers' buffers through CUDA IPC (``actors/wire/zero_copy.py``) and out of its own
(local copies). Nothing crosses a network, so the bound is the GPU's memory bandwidth:

* ``hbm_copy_gbps``: one large contiguous ``copy_`` in one worker, timed with CUDA events (bytes
  copied per second; the bytes the memory moves are twice that, read and written).
* per direction: ``bytes_copied`` (what the workers wrote into their destination buffers, from
  their own counters), ``seconds`` (the driver's wall time of ``reallocate``: planning, Ray round
  trips, handle exchange, copies, commit) and ``execute_seconds`` (the slowest worker's transfer
  phase); ``fraction_of_hbm`` = (bytes_copied / seconds) / hbm_copy_gbps, and the same over
  ``execute_seconds``. The issue's goal is 0.8.

Every direction is verified element by element against ``synthetic_box`` on the device (every
rank), after its first and last timed arrival. Numbers: docs/benchmarks.md ("GPU").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any

import ray
import torch

from realloc.layout import Topology
from realloc_tools.bench.cli import check_run_args, parse_transitions
from realloc_tools.cluster import ray_for_command

MB = 1 << 20
#: Default transitions for 8 workers: FSDP trainer <-> TP engine, a pp change, a replicated engine.
GPU_TRANSITIONS = (("fsdp=8", "tp=8"), ("pp=2,tp=4", "tp=8"), ("tp=8", "dp=2,tp=4"))


def add_bench_gpu_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-gpu",
        help="time reallocate between workers sharing one GPU against its copy bandwidth",
        description="Start workers that share one GPU (CUDA buffers, CUDA IPC between them), move a model "
        "between layouts both ways, verify every arrival on the device, and compare the copy throughput "
        "with one large device-to-device copy measured in the same run.",
    )
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray on this machine's GPU)")
    p.add_argument("--model", default="llama-7b", help="preset or HF config.json (default: llama-7b, 13.5 GB bf16)")
    p.add_argument(
        "--transitions",
        help="'a->b;c->d' (default: "
        + "; ".join(f"{a}->{b}" for a, b in GPU_TRANSITIONS)
        + "); each is timed both ways (also 'all' and 'default' of realloc bench)",
    )
    p.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default 64)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed round trips per transition after a warm-up (default 5)"
    )
    p.add_argument(
        "--probe-mb", type=float, default=2048, help="bytes of the copy-bandwidth probe in MiB (default 2048)"
    )
    p.add_argument(
        "--zero-copy",
        choices=("on", "off"),
        default="on",
        help="off: every route through the gloo transport, staged through pinned host memory",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_bench_gpu)


def parse_gpu_transitions(text: str | None) -> list[tuple[Topology, Topology]]:
    """``--transitions`` as ``realloc bench`` reads it; :data:`GPU_TRANSITIONS` when not given."""
    if text is None:
        return [(Topology.parse(a), Topology.parse(b)) for a, b in GPU_TRANSITIONS]
    return parse_transitions(text)


def run_bench_gpu(args: argparse.Namespace) -> int:
    from realloc.spec import load_spec

    spec = load_spec(args.model)
    transitions = parse_gpu_transitions(args.transitions)
    for a, b in transitions:
        a.check(spec)
        b.check(spec)
    check_run_args(args)
    if args.address is None and not torch.cuda.is_available():
        raise ValueError("bench-gpu needs a CUDA device on this machine (or --address of a Ray cluster with GPUs)")
    report = bench_gpu(
        spec,
        transitions,
        address=args.address,
        bucket_bytes=int(args.bucket_mb * MB),
        repeats=args.repeats,
        probe_bytes=int(args.probe_mb * MB),
        zero_copy=args.zero_copy == "on",
        seed=args.seed,
    )
    print(json.dumps(report) if args.json else format_gpu_report(report))
    return 0 if report["verified"] else 1


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[bench-gpu {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def bench_gpu(
    spec,
    transitions: list[tuple[Topology, Topology]],
    *,
    address: str | None = None,
    bucket_bytes: int = 64 * MB,
    repeats: int = 5,
    probe_bytes: int = 2048 * MB,
    zero_copy: bool = True,
    seed: int = 0,
) -> dict:
    from actors.driver.group import ModelGroup

    workers = transitions[0][0].world_size
    report: dict[str, Any] = {
        "model": spec.name,
        "model_bytes": spec.total_bytes(),
        "workers": workers,
        "transitions": [f"{a} -> {b}" for a, b in transitions],
        "bucket_bytes": bucket_bytes,
        "repeats": repeats,
        "zero_copy": zero_copy,
    }
    started = time.perf_counter()
    with ray_for_command(address, 1, workers + 1, gpus_per_node=1) as where:
        group = ModelGroup.create(
            spec,
            transitions[0][0],
            name="bench-gpu",
            use_gpu=True,
            gpus_per_worker=1 / workers,
            bucket_bytes=bucket_bytes,
            timeout_s=600,
            zero_copy=zero_copy,
        )
        try:
            report["machine"] = {
                "where": where,
                "torch": torch.__version__,
                "ray": __import__("ray").__version__,
                **group.run(_device_info, writes=False)[0],
            }
            _log(
                f"{spec.name} ({spec.total_bytes() / 1e9:.2f} GB) on {workers} workers sharing "
                f"{report['machine']['device_name']}"
            )
            report["probe"] = group.run(_copy_probe, probe_bytes, writes=False)[0]
            _log(
                f"copy probe: {report['probe']['hbm_copy_gbps']:.0f} GB/s copied "
                f"({report['probe']['strided_copy_gbps']:.0f} GB/s for a strided half of a matrix)"
            )
            t = time.perf_counter()
            group.init_synthetic(seed)
            _log(f"synthetic weights written in {time.perf_counter() - t:.1f}s")
            ok = _verified(group, seed)
            directions = []
            for src, dst in transitions:
                ok &= _transition(group, src, dst, repeats, seed, report["probe"], directions)
            report["directions"] = directions
            report["memory"] = group.run(_memory_info, writes=False)
            report["verified"] = ok
        finally:
            group.shutdown()
    hbm = [d["fraction_of_hbm"] for d in report["directions"]]
    report["worst_fraction_of_hbm"] = min(hbm)
    report["worst_execute_fraction_of_hbm"] = min(d["execute_fraction_of_hbm"] for d in report["directions"])
    report["goal_80_percent_of_hbm"] = report["worst_fraction_of_hbm"] >= 0.8
    report["total_seconds"] = time.perf_counter() - started
    return report


def _verified(group, seed: int) -> bool:
    bad = group.verify_synthetic(seed)
    if bad:
        _log(f"{group.topology}: WRONG shards {sorted(bad.items())[:3]}")
    return not bad


def _transition(group, src: Topology, dst: Topology, repeats: int, seed: int, probe: dict, out: list) -> bool:
    """Both directions of ``src -> dst``: a verified warm-up round trip, then ``repeats`` timed
    round trips (the last arrival each way verified again)."""
    ok = True
    if group.topology != src:
        group.reallocate(src)
        ok &= _verified(group, seed)
    for target in (dst, src):  # warm-up: plans, IPC mappings, the allocator's blocks
        group.reallocate(target)
        ok &= _verified(group, seed)
    runs: dict[str, list] = {"forward": [], "back": []}
    phases: dict[str, list[dict]] = {}
    for i in range(repeats):
        for way, target in (("forward", dst), ("back", src)):
            t = time.perf_counter()
            stats = group.reallocate(target)
            runs[way].append((time.perf_counter() - t, stats))
            if i == repeats - 1:
                phases[way] = ray.get([a.last_phases.remote() for a in group.actors], timeout=60)
                ok &= _verified(group, seed)
    for way, a, b in (("forward", src, dst), ("back", dst, src)):
        walls = [w for w, _ in runs[way]]
        executes = [s.seconds for _, s in runs[way]]
        last = runs[way][-1][1]
        copied = last.bytes_local + last.bytes_intra_node + last.bytes_inter_node
        wall, execute = statistics.median(walls), statistics.median(executes)
        rate = probe["hbm_copy_gbps"] * 1e9
        d = {
            "src": str(a),
            "dst": str(b),
            "bytes_copied": copied,
            "bytes_local": last.bytes_local,
            "bytes_intra_node": last.bytes_intra_node,
            "bytes_inter_node": last.bytes_inter_node,
            "seconds": walls,
            "median_seconds": wall,
            "execute_seconds": executes,
            "execute_median_seconds": execute,
            "copy_bound_seconds": copied / rate,
            "gbps": copied / wall / 1e9,
            "execute_gbps": copied / execute / 1e9,
            "fraction_of_hbm": copied / wall / rate,
            "execute_fraction_of_hbm": copied / execute / rate,
            "peak_extra_bytes_per_actor": last.peak_extra_bytes_per_actor,
            "plan_steps": last.planned["num_steps"],
            "plan_routes": last.planned["num_routes"],
            # the last timed move's seconds by phase: the slowest worker's, and each phase's maximum
            "phases_slowest_worker": max(phases[way], key=lambda p: sum(p.values())),
            "phases_max": {k: max(p.get(k, 0.0) for p in phases[way]) for k in phases[way][0]},
        }
        out.append(d)
        _log(
            f"{a} -> {b}: {copied / 1e9:.2f} GB in {wall * 1e3:.1f} ms ({d['fraction_of_hbm']:.0%} of the copy "
            f"bandwidth; execute {execute * 1e3:.1f} ms, {d['execute_fraction_of_hbm']:.0%}; bound "
            f"{d['copy_bound_seconds'] * 1e3:.1f} ms); slowest worker's phases (ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in d["phases_slowest_worker"].items())
        )
    return ok


# -- worker side (group.run) -----------------------------------------------------------------------


def _device_info(ctx) -> dict:
    p = torch.cuda.get_device_properties(ctx.device)
    return {
        "device_name": p.name,
        "device_memory_bytes": p.total_memory,
        "multiprocessors": p.multi_processor_count,
        "cuda": torch.version.cuda,
    }


def _event_median(fn, reps: int) -> float:
    """Median seconds of ``fn()`` on the current stream, timed with CUDA events after 3 warm-ups."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_probe(ctx, nbytes: int) -> dict | None:
    """Rank 0 only: one large contiguous device-to-device copy, and a strided one (half the
    columns of a bf16 matrix: what a tensor-parallel row split copies). Its blocks go back to
    the GPU afterwards (the other workers share it)."""
    if ctx.rank != 0:
        return None
    out = _probe_rates(ctx, nbytes)
    torch.cuda.empty_cache()
    return out


def _probe_rates(ctx, nbytes: int) -> dict:
    a = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).random_(0, 256)
    b = torch.empty_like(a)
    contiguous = _event_median(lambda: b.copy_(a), 20)
    side = int(math.sqrt(nbytes // 2))
    m = a[: side * side * 2].view(torch.bfloat16).view(side, side)
    half = torch.empty(side, side // 2, dtype=torch.bfloat16, device=ctx.device)
    strided = _event_median(lambda: half.copy_(m[:, side // 2 :]), 20)
    out = {
        "probe_bytes": nbytes,
        "hbm_copy_gbps": nbytes / contiguous / 1e9,
        "hbm_read_write_gbps": 2 * nbytes / contiguous / 1e9,
        "strided_copy_gbps": half.numel() * 2 / strided / 1e9,
    }
    return out


def _memory_info(ctx) -> dict:
    return {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(ctx.device),
        "reserved_bytes": torch.cuda.memory_reserved(ctx.device),
    }


def format_gpu_report(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"{r['model']} ({r['model_bytes'] / 1e9:.2f} GB) on {r['workers']} workers sharing one "
        f"{m['device_name']} (CUDA {m['cuda']}, torch {m['torch']}); zero-copy {'on' if r['zero_copy'] else 'off'}",
        f"copy bandwidth (one {r['probe']['probe_bytes'] / 2**30:.1f} GiB copy_): {r['probe']['hbm_copy_gbps']:.0f} "
        f"GB/s copied ({r['probe']['hbm_read_write_gbps']:.0f} GB/s read+write); strided half of a matrix "
        f"{r['probe']['strided_copy_gbps']:.0f} GB/s",
        f"{'direction':<28} {'GB':>6} {'wall ms':>8} {'of HBM':>7} {'exec ms':>8} {'of HBM':>7} {'bound ms':>9}",
    ]
    for d in r["directions"]:
        lines.append(
            f"{d['src'] + ' -> ' + d['dst']:<28} {d['bytes_copied'] / 1e9:6.2f} {d['median_seconds'] * 1e3:8.1f} "
            f"{d['fraction_of_hbm']:7.0%} {d['execute_median_seconds'] * 1e3:8.1f} "
            f"{d['execute_fraction_of_hbm']:7.0%} {d['copy_bound_seconds'] * 1e3:9.1f}"
        )
    lines.append(
        f"worst: {r['worst_fraction_of_hbm']:.0%} of the copy bandwidth (wall), "
        f"{r['worst_execute_fraction_of_hbm']:.0%} (execute); goal 80%: "
        f"{'met' if r['goal_80_percent_of_hbm'] else 'not met'}; verified: {r['verified']}"
    )
    return "\n".join(lines)
