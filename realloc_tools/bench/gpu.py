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
    p.add_argument(
        "--weight-format",
        help="then copy a trainer (--format-src) into a generator (--format-dst) holding this format (e.g. "
        "fp8_block128), beside the same copy in the model's dtypes: `realloc bench --weight-format` on the GPU",
    )
    p.add_argument("--format-src", default="fsdp=8", help="the --weight-format copy's trainer layout (default fsdp=8)")
    p.add_argument(
        "--format-dst",
        default="tp=2",
        help="the --weight-format copy's generator layout (default tp=2: llama-7b's MLP splits into whole 128-blocks)",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="then time delta copies on the GPU: a trainer stepping AdamW into a generator, "
        "copy_to(delta=True) beside a full copy after every step: `realloc bench --delta` on the GPU",
    )
    p.add_argument(
        "--delta-model",
        default="bench-1gb",
        help="the delta copies' model (default bench-1gb: its fp32 masters and AdamW state sit beside the moves')",
    )
    p.add_argument("--delta-steps", type=int, default=3, help="AdamW steps per learning rate of --delta (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_bench_gpu)


def parse_gpu_transitions(text: str | None) -> list[tuple[Topology, Topology]]:
    """``--transitions`` as ``realloc bench`` reads it; :data:`GPU_TRANSITIONS` when not given."""
    if text is None:
        return [(Topology.parse(a), Topology.parse(b)) for a, b in GPU_TRANSITIONS]
    return parse_transitions(text)


def run_bench_gpu(args: argparse.Namespace) -> int:
    from realloc.layout import Layout
    from realloc.spec import load_spec
    from realloc.spec.formats import check_weight_format

    spec = load_spec(args.model)
    transitions = parse_gpu_transitions(args.transitions)
    for a, b in transitions:
        a.check(spec)
        b.check(spec)
    check_run_args(args)
    copy = None
    if args.weight_format is not None:
        check_weight_format(args.weight_format)
        copy = (Topology.parse(args.format_src), Topology.parse(args.format_dst))
        copy[0].check(spec)
        Layout(spec, copy[1], weight_format=args.weight_format)  # the format's block rule
    if args.delta_steps < 1:
        raise ValueError(f"--delta-steps must be at least 1, got {args.delta_steps}")
    delta_spec = load_spec(args.delta_model) if args.delta else None
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
        weight_format=args.weight_format,
        format_copy=copy,
        delta_spec=delta_spec,
        delta_steps=args.delta_steps,
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
    weight_format: str | None = None,
    format_copy: tuple[Topology, Topology] | None = None,
    delta_spec=None,
    delta_steps: int = 3,
) -> dict:
    """The moves of ``transitions`` on workers sharing the GPU; then, with ``weight_format``, the
    copy ``format_copy`` (trainer layout, generator layout) between two groups into that format
    beside the model's dtypes (:func:`realloc_tools.bench.formats.measure`), and with
    ``delta_spec`` delta copies beside full ones (:func:`realloc_tools.bench.delta.measure`),
    every group on the same GPU, each part after the last one's workers have left it."""
    from actors.driver.group import ModelGroup
    from realloc_tools.bench import delta, formats

    workers = transitions[0][0].world_size
    copy_workers = sum(t.world_size for t in format_copy) if weight_format and format_copy else 0
    slots = max(workers, copy_workers, 8 if delta_spec is not None else 0)
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
    with ray_for_command(address, 1, slots + 1, gpus_per_node=1) as where:
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
        on_gpu = {"use_gpu": True, "timeout_s": 600}
        if weight_format is not None:
            _wait_for_gpu_memory()
            src, dst = format_copy
            share = {**on_gpu, "gpus_per_worker": 1 / copy_workers, "zero_copy": zero_copy}
            rows = formats.measure(spec, src, dst, weight_format, repeats, bucket_bytes, seed, _log, **share)
            report["weight_format"] = rows
            report["verified"] &= all(r["verified"] for r in rows)
        if delta_spec is not None:
            _wait_for_gpu_memory()
            lrs = [1e-6, 3e-6]
            rows = delta.measure(delta_spec, lrs, delta_steps, bucket_bytes, _log, **on_gpu, gpus_per_worker=1 / 8)
            report["delta"] = rows
            report["verified"] &= all(r["exact"] for r in rows)
    hbm = [d["fraction_of_hbm"] for d in report["directions"]]
    report["worst_fraction_of_hbm"] = min(hbm)
    report["worst_execute_fraction_of_hbm"] = min(d["execute_fraction_of_hbm"] for d in report["directions"])
    report["goal_80_percent_of_hbm"] = report["worst_fraction_of_hbm"] >= 0.8
    report["total_seconds"] = time.perf_counter() - started
    return report


def _wait_for_gpu_memory(timeout_s: float = 60.0) -> None:
    """Until the workers of the part before have left the GPU (their processes exit after
    ``shutdown``, a while later): 90% of its memory free, or ``timeout_s`` passed (then the next
    part runs on what is free, and says so if that is not enough)."""
    if not torch.cuda.is_available():  # a driver without the GPU (--address): nothing to read
        return
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = torch.cuda.mem_get_info()
        if free >= 0.9 * total or time.monotonic() > deadline:
            _log(f"GPU memory free: {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
            return
        time.sleep(0.5)


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
    if "weight_format" in r:
        from realloc_tools.bench.formats import format_rows

        lines += ["copies between two groups on the GPU, by generator format:", format_rows(r["weight_format"])]
    if "delta" in r:
        from realloc_tools.bench.delta import format_rows

        lines += ["delta copies on the GPU, beside full ones:", format_rows(r["delta"])]
    return "\n".join(lines)
