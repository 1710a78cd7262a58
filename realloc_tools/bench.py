"""``realloc bench``: our ``reallocate`` against the transfers a user would otherwise write.

One run, one set of actors (8 by default, on 2 simulated nodes), one model (``bench-1gb``,
1.02 GB bf16), one transition (train ``dp=2,tp=2,pp=2`` -> generation ``dp=4,tp=2,pp=1``):

* ``ours``: ``ModelGroup.reallocate`` there and back ``--repeats`` times (driver wall time of
  each direction, after untimed warm-up round trips; the first also forms the process group).
* ``driver``: every source shard of dp replica 0 is fetched to the driver (``ray.get``), full
  tensors are assembled there, re-sliced per destination shard coordinate and pushed back
  (``ray.put``; each actor ``ray.get``s its coordinate's object and writes it into fresh
  destination buffers).
* ``broadcast`` (OpenRLHF style): per parameter, the owners of its tp shards send them to one
  owner, which assembles the full tensor and ``dist.broadcast``s it to every rank; every rank
  slices its destination boxes out of it.
* ``gather`` (veRL's path from an FSDP trainer, ``DTensor.full_tensor()``): per parameter, every
  rank all-gathers the full tensor over its data-parallel replica (the boxes of every rank,
  padded to one size), then slices its destination boxes out of it.
* ``dcp``: ``torch.distributed.checkpoint.save`` of ShardedTensors in the source layout (one
  replica writes each box) to ``/dev/shm``, ``dcp.load`` into ShardedTensors of the destination
  layout (DCP's planner reshards), then the directory is removed.

Every method must leave exact destination shards: ours is checked with the workers'
``verify_synthetic`` (dp replica 0 of the destination; the other replicas must be byte-identical,
or every rank with ``--verify exact``); baselines against ``synthetic_box`` (``--verify exact``)
or, by default, against CRC32s of ours' verified destination shards (``--verify digest``: the
same bytes, 25x cheaper on a 2-core machine). The same run measures gloo bandwidth between the two
nodes and memcpy, from which it derives a lower bound (formula in ``docs/benchmarks.md`` and in
the JSON's ``lower_bound_formula``).

The run fits the node's memory (issue 22): before each run of a baseline its peak is estimated
(:func:`baseline_memory_estimate`) and a baseline that would take the node past Ray's
memory-monitor threshold is skipped or cut short, with the reason in the report; each run's peak
is measured (:class:`_MemorySampler`); a baseline that fails is recorded with its error and the
group restored (:func:`recover_group`); ``driver``, which leaves object-store pages touched, runs
after every direction's others (``DEFERRED_BASELINES``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import itertools
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
import uuid
import zlib
from typing import Any, Sequence

import torch

from actors.trace import check_trace_path, write_chrome_trace
from realloc.boxes import box_index
from realloc.layout import Layout, Topology
from realloc.progress import Progress, write
from realloc.shards import TORCH_DTYPES, ShardStore, allocate_buffers
from realloc_tools.cluster import ray_for_command

BASELINES = ("driver", "broadcast", "dcp", "gather")
DEFAULT_SRC = "dp=2,tp=2,pp=2"
DEFAULT_DST = "dp=4,tp=2,pp=1"
#: ``--transitions all``: the RLHF default, a tp change, a pp change and a sharded (FSDP) source.
ALL_TRANSITIONS = (
    (DEFAULT_SRC, DEFAULT_DST),
    ("dp=4,tp=2", "tp=8"),
    (DEFAULT_SRC, "dp=1,tp=2,pp=4"),
    ("fsdp=8", "dp=4,tp=2"),
)
MB = 1 << 20
#: ``--staged-layouts``: the trainer's layout and the generator's, each on half the bench's 8 actors.
DEFAULT_STAGED = "dp=2,tp=2->tp=4"
#: ``--staged-calls``: generator calls timed while nothing else runs.
STAGED_IDLE_CALLS = 50
#: The issue's target for the pause at commit ("<= 10 ms plus the hook"; the bench's generator
#: worker class has no ``on_shards_changed`` hook, so the target is 10 ms flat).
STAGED_PAUSE_TARGET_SECONDS = 0.010
#: Generator calls the caller makes after a commit (or a stop-the-world copy) ends before it stops.
STAGED_CALLS_AFTER = 5

LOWER_BOUND_FORMULA = (
    "max(aggregate, critical_rank) with "
    "aggregate = bytes_inter_node / gloo_gbps + (bytes_intra_node + bytes_local_copy) / memcpy_gbps, "
    "critical_rank = max over ranks r of inter_recv[r] / gloo_p2p_gbps + (intra_recv[r] + local[r]) / memcpy_1core_gbps; "
    "gloo_gbps = max(gloo_p2p_gbps, gloo_aggregate_gbps), "
    "memcpy_gbps = min(max(memcpy_cores_gbps, memcpy_aggregate_gbps), min(cores, workers) * memcpy_1core_gbps) "
    "(min(cores, workers) actors, and every actor, copying at once: measured, never more than every core "
    "copying at the one-core rate); "
    "warm buffers (no first-touch page faults), no pack/unpack, bytes from the plan"
)

#: Actor-side state of the baselines between ``group.run`` calls (destination buffers to verify).
_STATE: dict[str, Any] = {}


# -- command line -------------------------------------------------------------------------------


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time reallocate against driver / broadcast / gather / DCP baselines on Ray actors",
        description="Time ModelGroup.reallocate against what a user would otherwise write (gather "
        "through the driver; OpenRLHF-style per-parameter broadcast; veRL-style full-tensor all-gather; "
        "torch.distributed.checkpoint save + resharding load through /dev/shm) on the same actors, both "
        "directions of several transitions, verify every result, and measure gloo bandwidth and memcpy "
        "for a lower bound per direction.",
    )
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray with simulated nodes)")
    p.add_argument("--model", default="bench-1gb", help="preset or HF config.json (default: bench-1gb, 1.02 GB bf16)")
    p.add_argument("--src", help=f"one transition's source layout (default with --dst: {DEFAULT_SRC})")
    p.add_argument("--dst", help=f"one transition's destination layout (default with --src: {DEFAULT_DST})")
    p.add_argument(
        "--transitions",
        help="'all' (the default without --src/--dst: "
        + "; ".join(f"{a}->{b}" for a, b in ALL_TRANSITIONS)
        + f"), 'default' ({DEFAULT_SRC}->{DEFAULT_DST}) or 'a->b;c->d'; each is timed both ways",
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes when starting Ray locally (default 2)")
    p.add_argument("--bucket-mb", type=float, default=64, help="bucket size in MiB (default 64)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed round trips src->dst->src of ours per transition after two warm-up ones (default 3)",
    )
    p.add_argument(
        "--baseline-repeats",
        type=int,
        default=3,
        help="runs of each baseline per direction; the median is reported (default 3)",
    )
    p.add_argument("--skip", default="", help=f"comma-separated baselines to skip ({', '.join(BASELINES)})")
    p.add_argument(
        "--verify",
        choices=("digest", "exact"),
        default="digest",
        help="how baselines are checked: CRC32 of every destination shard against ours' verified "
        "shards (default), or element-wise against synthetic_box (slow on big models)",
    )
    p.add_argument("--probe-mb", type=float, default=256, help="bytes of the gloo/memcpy probes in MiB (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-resident",
        action="store_true",
        help="skip the resident-layout loop (reallocate(..., keep=) on the first transition)",
    )
    p.add_argument(
        "--no-staged",
        action="store_true",
        help="skip the staged-update measurement (a trainer group copying into a serving generator "
        "group with copy_to(..., stage=True), after the moves)",
    )
    p.add_argument(
        "--staged-only",
        action="store_true",
        help="run the staged-update measurement alone (no transitions, baselines, probes or resident loop)",
    )
    p.add_argument(
        "--staged-layouts",
        default=DEFAULT_STAGED,
        help=f"the staged measurement's 'trainer->generator' layouts, one group each on actors of their "
        f"own (default {DEFAULT_STAGED}: half the bench's actors each)",
    )
    p.add_argument(
        "--staged-calls",
        type=int,
        default=STAGED_IDLE_CALLS,
        help=f"generator calls timed while idle in the staged measurement (default {STAGED_IDLE_CALLS})",
    )
    p.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run every baseline even where its estimated peak memory does not fit the node (by "
        "default such a baseline is skipped in that direction, with the reason in the output)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a baseline failed or was skipped for memory in some direction (by default "
        "that is reported and the exit status only says whether every result that ran verified)",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="run the delta measurement alone: a trainer stepping AdamW copies into a generator with "
        "copy_to(..., delta=True) after every step, beside a full copy (realloc_tools/delta_bench.py)",
    )
    p.add_argument(
        "--delta-models",
        default="small,bench-1gb",
        help="the delta measurement's models, comma-separated (default small,bench-1gb)",
    )
    p.add_argument(
        "--delta-lrs", default="1e-6,3e-6", help="the delta measurement's AdamW learning rates (default 1e-6,3e-6)"
    )
    p.add_argument("--delta-steps", type=int, default=10, help="AdamW steps per learning rate (default 10)")
    p.add_argument(
        "--weight-format",
        help="run the weight-format measurement alone: the trainer (--src) copied into a generator "
        "(--dst) in its own format, then in this one (e.g. fp8_block128; realloc_tools/format_bench.py)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write the timeline of every timed move of ours (each worker's phases and transfers) as "
        "Chrome trace JSON (open it in ui.perfetto.dev)",
    )
    p.set_defaults(func=run_bench)


def parse_transitions(
    text: str | None, src: str | None = None, dst: str | None = None
) -> list[tuple[Topology, Topology]]:
    """The transitions to time: ``--src/--dst`` (one), or ``--transitions`` (``all`` when neither)."""
    if text is not None and (src or dst):
        raise ValueError("give either --transitions or --src/--dst, not both")
    if src or dst:
        pairs = [(src or DEFAULT_SRC, dst or DEFAULT_DST)]
    elif text is None or text.strip() == "all":
        pairs = list(ALL_TRANSITIONS)
    elif text.strip() == "default":
        pairs = [(DEFAULT_SRC, DEFAULT_DST)]
    else:
        pairs = []
        for part in (p.strip() for p in text.split(";")):
            a, sep, b = part.partition("->")
            if not sep or not a.strip() or not b.strip():
                raise ValueError(f"--transitions: {part!r} is not 'src->dst' (e.g. 'dp=4,tp=2->tp=8')")
            pairs.append((a.strip(), b.strip()))
    out = [(Topology.parse(a), Topology.parse(b)) for a, b in pairs]
    for a, b in out:
        if a.world_size != b.world_size or a.world_size != out[0][0].world_size:
            raise ValueError(
                f"every layout needs the same number of ranks (one set of actors): {a} has "
                f"{a.world_size}, {b} has {b.world_size}, {out[0][0]} has {out[0][0].world_size}"
            )
        if a == b:
            raise ValueError(f"transition {a} -> {b}: source and destination are the same layout")
    return out


def parse_staged(text: str) -> tuple[Topology, Topology]:
    """``--staged-layouts``: ``'trainer->generator'`` (two groups, each on actors of its own)."""
    a, sep, b = text.partition("->")
    if not sep or not a.strip() or not b.strip():
        raise ValueError(f"--staged-layouts: {text!r} is not 'trainer->generator' (e.g. '{DEFAULT_STAGED}')")
    return Topology.parse(a.strip()), Topology.parse(b.strip())


def check_run_args(args: argparse.Namespace) -> None:
    """The options ``bench`` and ``bench-gpu`` share: ``--repeats``, ``--bucket-mb``, ``--probe-mb``."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if not (math.isfinite(args.bucket_mb) and args.bucket_mb * MB >= 1024):
        raise ValueError(f"--bucket-mb must be at least 1/1024, got {args.bucket_mb}")
    if not (math.isfinite(args.probe_mb) and args.probe_mb > 0):
        raise ValueError(f"--probe-mb must be positive, got {args.probe_mb}")


def run_bench(args: argparse.Namespace) -> int:
    from realloc.spec import load_spec as load_model

    if args.trace is not None and (args.delta or args.weight_format is not None):
        raise ValueError("--trace traces the transitions' moves; it does not go with --delta or --weight-format")
    if args.delta:
        return run_delta_bench(args)
    if args.weight_format is not None:
        return run_format_bench(args)
    spec = load_model(args.model)
    if args.staged_only and args.no_staged:
        raise ValueError("--staged-only and --no-staged exclude each other")
    if args.staged_only and (args.transitions is not None or args.src or args.dst):
        raise ValueError("--staged-only times no transitions: drop --transitions/--src/--dst")
    transitions = [] if args.staged_only else parse_transitions(args.transitions, args.src, args.dst)
    for a, b in transitions:
        a.check(spec)
        b.check(spec)
    staged = None if args.no_staged else parse_staged(args.staged_layouts)
    if staged is not None:
        for t in staged:
            t.check(spec)
        if transitions and sum(t.world_size for t in staged) > transitions[0][0].world_size:
            raise ValueError(
                f"--staged-layouts {staged[0]} -> {staged[1]} needs {sum(t.world_size for t in staged)} actors; "
                f"the bench's transitions run on {transitions[0][0].world_size} (or use --staged-only)"
            )
        if args.staged_calls < 1:
            raise ValueError(f"--staged-calls must be at least 1, got {args.staged_calls}")
    if args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
    check_run_args(args)
    if args.baseline_repeats < 1:
        raise ValueError(f"--baseline-repeats must be at least 1, got {args.baseline_repeats}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - set(BASELINES)
    if unknown:
        raise ValueError(f"--skip: unknown baselines {sorted(unknown)}; known: {', '.join(BASELINES)}")
    injected_faults()  # a malformed test hook is a usage error before Ray starts
    if args.trace is not None:
        if args.staged_only:
            raise ValueError("--trace traces the moves of ours; --staged-only runs none")
        check_trace_path(args.trace)
    traces = [] if args.trace is not None else None
    # With --json, stdout is the report alone: what Ray prints there meanwhile (e.g. "(raylet) A
    # worker died or was killed ..." when its memory monitor kills one) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        report = bench(
            spec,
            transitions,
            address=args.address,
            nodes=args.nodes,
            bucket_bytes=int(args.bucket_mb * MB),
            repeats=args.repeats,
            baseline_repeats=args.baseline_repeats,
            baselines=[b for b in BASELINES if b not in skip],
            verify=args.verify,
            probe_bytes=int(args.probe_mb * MB),
            seed=args.seed,
            resident=not args.no_resident,
            memory_check=not args.no_memory_check,
            staged=staged,
            staged_calls=args.staged_calls,
            traces=traces,
        )
    if traces:
        write_chrome_trace(args.trace, traces)
        _log(f"trace of {len(traces)} moves written to {args.trace}")
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return exit_status(report, args.strict)


def run_delta_bench(args: argparse.Namespace) -> int:
    """``--delta``: the per-step table of delta copies beside full ones; exit 1 unless every
    generator ended bit-exact."""
    from realloc.spec import load_spec as load_model
    from realloc_tools.cluster import ray_for_command
    from realloc_tools.delta_bench import format_rows, measure

    specs = [load_model(m.strip()) for m in args.delta_models.split(",") if m.strip()]
    try:
        lrs = [float(x) for x in args.delta_lrs.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--delta-lrs must be comma-separated numbers, got {args.delta_lrs!r}") from None
    if not specs or not lrs or any(not (0 < lr < 1) for lr in lrs):
        raise ValueError(
            f"--delta-models and --delta-lrs need at least one model and learning rates in (0, 1), got {args.delta_models!r}, {args.delta_lrs!r}"
        )
    if args.delta_steps < 1:
        raise ValueError(f"--delta-steps must be at least 1, got {args.delta_steps}")
    rows = []
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        with ray_for_command(args.address, 2, 4) as where:
            _log(f"delta bench on {where}")
            for spec in specs:
                rows += measure(spec, lrs, args.delta_steps, int(args.bucket_mb * MB), log=_log)
    if args.json:
        print(json.dumps({"delta": rows}))
    else:
        print(format_rows(rows))
    return 0 if all(r["exact"] for r in rows) else 1


def run_format_bench(args: argparse.Namespace) -> int:
    """``--weight-format``: the trainer copied into a generator of its own format and of the given
    one, wire bytes and seconds side by side; exit 1 unless every generator shard verified."""
    from realloc.layout import Layout
    from realloc.spec import load_spec as load_model
    from realloc.spec.formats import check_weight_format
    from realloc_tools.cluster import ray_for_command
    from realloc_tools.format_bench import format_rows, measure

    check_weight_format(args.weight_format)
    spec = load_model(args.model)
    ((src, dst),) = parse_transitions(None, args.src or DEFAULT_SRC, args.dst or DEFAULT_DST)
    Layout(spec, src)
    Layout(spec, dst, weight_format=args.weight_format)  # the engine's block rule, before Ray starts
    if args.repeats < 1 or args.nodes < 1:
        raise ValueError(f"--repeats and --nodes must be at least 1, got {args.repeats}, {args.nodes}")
    cpus = -(-(src.world_size + dst.world_size) // args.nodes)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        with ray_for_command(args.address, args.nodes, cpus) as where:
            _log(f"weight-format bench on {where}")
            rows = measure(spec, src, dst, args.weight_format, args.repeats, int(args.bucket_mb * MB), args.seed, _log)
    if args.json:
        print(json.dumps({"weight_format": rows}))
    else:
        print(format_rows(rows))
    return 0 if all(r["verified"] for r in rows) else 1


def exit_status(report: dict, strict: bool = False) -> int:
    """1 when a method's destination shards were wrong or ours did not finish (``verified``);
    with ``strict`` also when a baseline failed or was skipped or cut short for memory in some
    direction, or the staged measurement was skipped for memory; else 0. Without ``strict`` such a baseline is in the report (``baseline_failures``,
    ``baseline_skips``) but the run, whose own figures are complete, succeeds."""
    if not all(report["verified"].values()):
        return 1
    incomplete = not report.get("baselines_complete", True) or "skipped" in report.get("staged", {})
    return 1 if strict and incomplete else 0


_T0 = time.perf_counter()


log = logging.getLogger(__name__)


def _log(msg: str) -> None:
    write(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}")  # above the progress bar, if one is shown


# -- the run ------------------------------------------------------------------------------------


class _Layouts:
    """CRC32s of every slot of every layout the group has held, each layout verified once.

    The first time the group reaches a layout by a reallocation, its shards are checked against
    ``synthetic_box`` (dp replica 0, the other replicas byte-identical to it; every rank with
    ``exact``) and their CRC32s recorded; every later arrival must reproduce them. The initial
    layout (written by ``init_synthetic``) is recorded as it is.
    """

    def __init__(self, group, verify: str, seed: int, batch: int):
        self.group, self.verify, self.seed, self.batch = group, verify, seed, batch
        self.digests: dict[Layout, list[dict[str, int]]] = {}
        self.failures: list[str] = []

    def record(self) -> None:
        self.digests[self.group.layout] = _digests_of_group(self.group)

    def check(self) -> bool:
        """Whether the group's shards are right; logs and remembers what is not."""
        group, layout = self.group, self.group.layout
        digests = _digests_of_group(group)
        if layout in self.digests:
            if digests != self.digests[layout]:
                self.failures.append(f"{layout}: shards differ from the first arrival")
                return False
            return True
        t = time.perf_counter()
        topo, workers = layout.topology, group.num_workers
        ranks = range(workers) if self.verify == "exact" else [r for r in range(workers) if topo.coords(r)[0] == 0]
        bad = {
            r: b for r, b in zip(ranks, _batched(group, ranks, "verify_synthetic", self.seed, batch=self.batch)) if b
        }
        for r in range(workers):  # other dp replicas: byte-identical to their verified replica-0 twin
            _, fsdp_rank, tp_rank, pp_rank = topo.coords4(r)
            if digests[r] != digests[topo.rank(0, tp_rank, pp_rank, fsdp_rank)]:
                bad.setdefault(r, ["<differs from its dp replica 0>"])
        _log(f"{layout.topology} verified in {time.perf_counter() - t:.1f}s: {'ok' if not bad else bad}")
        if bad:
            self.failures.append(f"{layout}: {sorted(bad.items())[:3]}")
            return False
        self.digests[layout] = digests
        return True


def bench(
    spec,
    transitions: list[tuple[Topology, Topology]],
    *,
    address: str | None = None,
    nodes: int = 2,
    bucket_bytes: int = 64 * MB,
    repeats: int = 3,
    baseline_repeats: int = 3,
    baselines: Sequence[str] = BASELINES,
    verify: str = "digest",
    probe_bytes: int = 256 * MB,
    seed: int = 0,
    resident: bool = True,
    memory_check: bool = True,
    staged: tuple[Topology, Topology] | None = None,
    staged_calls: int = STAGED_IDLE_CALLS,
    traces: list | None = None,
) -> dict:
    """Run the whole benchmark (both directions of every transition, one set of actors; then,
    with ``staged`` (trainer and generator topologies), the staged-update measurement on two
    groups of their own); returns the report (see ``docs/benchmarks.md``). ``memory_check``:
    skip a baseline (or the staged measurement) whose estimated peak the node cannot take (on a
    local Ray only: a cluster's nodes are not this machine). No ``transitions``: the staged
    measurement alone. ``traces``: a list to append the trace of every timed move of ours to
    (``ModelGroup.last_trace``, gathered after the move's timing)."""
    started = time.perf_counter()
    if not transitions and staged is None:
        raise ValueError("nothing to run: no transitions and no staged measurement")
    staged_workers = sum(t.world_size for t in staged) if staged is not None else 0
    workers = transitions[0][0].world_size if transitions else staged_workers
    per_node = -(-workers // nodes)
    store_bytes = max(512 * MB, 3 * spec.total_bytes() + 256 * MB)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    report: dict[str, Any] = {
        "model": spec.name,
        "model_bytes": spec.total_bytes(),
        "workers": workers,
        "transitions": [f"{a} -> {b}" for a, b in transitions],
        "staged_only": not transitions,
        "bucket_bytes": bucket_bytes,
        "repeats": repeats,
        "baseline_repeats": baseline_repeats,
        "verify_mode": verify,
    }
    with ray_for_command(address, nodes, per_node, store_bytes) as where:
        _log(
            f"{spec.name} ({spec.total_bytes() / 1e9:.2f} GB), {len(transitions)} transitions on {workers} actors"
            f"{', then the staged measurement' if staged is not None else ''}; {where}"
        )
        report["machine"] = {
            "cores": cores,
            "cpu": _cpu_model(),
            "ram_bytes": _ram_bytes(),
            "load_average_at_start": _loadavg(),
            "torch": torch.__version__,
            "ray": __import__("ray").__version__,
            "where": where,
        }
        if transitions:
            _bench_moves(
                report,
                spec,
                transitions,
                address=address,
                bucket_bytes=bucket_bytes,
                repeats=repeats,
                baseline_repeats=baseline_repeats,
                baselines=baselines,
                verify=verify,
                probe_bytes=probe_bytes,
                seed=seed,
                resident=resident,
                memory_check=memory_check,
                cores=cores,
                traces=traces,
            )
        if staged is not None:
            report["staged"] = _run_staged(
                spec,
                *staged,
                bucket_bytes=bucket_bytes,
                repeats=repeats,
                calls=staged_calls,
                seed=seed,
                memory_check=memory_check and address is None,
                local=address is None,
            )
            report.setdefault("verified", {})["staged"] = report["staged"].get("verified", True)
            if transitions:
                report["goals"]["staged_pause_at_commit_10ms"] = report["staged"].get("goal", {}).get("met")
    report["total_seconds"] = time.perf_counter() - started
    if "machine" in report:
        report["machine"]["load_average_at_end"] = _loadavg()
    return report


def _bench_moves(
    report: dict,
    spec,
    transitions: list[tuple[Topology, Topology]],
    *,
    address: str | None,
    bucket_bytes: int,
    repeats: int,
    baseline_repeats: int,
    baselines: Sequence[str],
    verify: str,
    probe_bytes: int,
    seed: int,
    resident: bool,
    memory_check: bool,
    cores: int,
    traces: list | None = None,
) -> None:
    """The moves (every transition both ways, the baselines, the probes, the resident loop) on
    one group of the transitions' actors, into ``report``; the group is shut down after."""
    from actors.driver.group import ModelGroup

    workers = transitions[0][0].world_size
    group = ModelGroup.create(spec, transitions[0][0], name="bench", bucket_bytes=bucket_bytes, timeout_s=900)
    _log("actors started")
    try:
        report["nodes"] = group.placement.num_nodes
        batch = max(1, min(cores, workers))  # synthetic_box needs ~3x a slot in temporaries
        t = time.perf_counter()
        group.init_synthetic(seed)
        _log(f"synthetic weights written in {time.perf_counter() - t:.1f}s")
        layouts = _Layouts(group, verify, seed, batch)
        layouts.record()

        # One warm-up round trip (forms the process group; verified) before the probes.
        src, dst = transitions[0]
        t = time.perf_counter()
        group.reallocate(dst)
        report["first_seconds_with_world_setup"] = time.perf_counter() - t
        ours_ok = layouts.check()
        group.reallocate(src)
        ours_ok &= layouts.check()
        group.run(_warm_imports, writes=False)  # the baselines' imports (DCP: seconds per actor) are not their cost
        open_default_group(group)  # the baselines run on the trainer's own default group, as users' do
        report["transport"] = measure_transport(group, probe_bytes, cores)
        _log(
            "transport: "
            + ", ".join(f"{k} {v:.3f}" for k, v in report["transport"].items() if k.endswith("gbps"))
            + " GB/s"
        )

        directions: list[dict] = []
        sampler = _MemorySampler([info["pid"] for info in group.infos] if address is None else None)
        memory = _MemoryGuard(sampler, memory_check and address is None, injected_faults())
        report["memory"] = memory.describe()
        rounds = Progress(
            log,
            f"bench: {len(transitions)} transitions, {repeats} timed round trips each",
            len(transitions) * repeats,
            "round trip",
        )
        try:
            with sampler, rounds:
                for i, (src, dst) in enumerate(transitions):
                    ours_ok &= _bench_transition(
                        group,
                        layouts,
                        i,
                        src,
                        dst,
                        repeats,
                        baseline_repeats,
                        baselines,
                        verify,
                        seed,
                        report["transport"],
                        cores,
                        directions,
                        memory,
                        traces,
                        rounds,
                    )
        except Exception as err:  # noqa: BLE001 - e.g. Ray's memory monitor killed an actor: keep what finished
            report["error"] = f"{type(err).__name__}: {err}"[:2000]
            layouts.failures.append(f"stopped after {len(directions)} directions: {report['error'][:200]}")
            _log(f"stopped: {report['error'][:300]}")
            if not directions:
                raise
        report["directions"] = directions
        if resident and directions and "error" not in report:
            try:
                group.trim_memory()
                report["resident"], ok = _bench_resident(group, layouts, *transitions[0], repeats, directions[:2])
                ours_ok &= ok
            except Exception as err:  # noqa: BLE001 - the directions' figures stand without it
                report["resident_error"] = f"{type(err).__name__}: {err}"[:2000]
                layouts.failures.append(f"resident loop: {report['resident_error'][:200]}")
                _log(f"resident loop failed: {report['resident_error'][:300]}")
                with contextlib.suppress(Exception):
                    group.release_resident()
                try:
                    recover_group(group, layouts, seed)
                except Exception as err2:  # noqa: BLE001
                    report["error"] = f"after the resident loop failed: {type(err2).__name__}: {err2}"[:2000]
        deferred = [n for n in baselines if n in DEFERRED_BASELINES]
        if deferred and directions and "error" not in report:
            try:
                with sampler:
                    ours_ok &= _run_deferred(
                        group, layouts, transitions, directions, deferred, baseline_repeats, verify, seed, memory
                    )
            except Exception as err:  # noqa: BLE001 - keep what finished
                report["error"] = f"{type(err).__name__}: {err}"[:2000]
                layouts.failures.append(f"stopped in the deferred baselines: {report['error'][:200]}")
                _log(f"stopped: {report['error'][:300]}")
        for d in directions:  # a deferred baseline the run never reached
            for n in deferred:
                if not any(n in d.get(k, {}) for k in ("baselines", "baselines_skipped", "baselines_failed")):
                    d.setdefault("baselines_skipped", {})[n] = "not run: the bench stopped before it"
        report["memory"]["peak_used_bytes"] = sampler.peak_used  # while baselines and ours' directions ran
        _summarise(report, directions, ours_ok, layouts.failures)
    finally:
        group.shutdown()


#: Untimed round trips of ours before a transition's timed ones. The first moves of a new layout
#: pair free the buffers of the pair before (peers drop their mappings of them two operations
#: later, actors/worker.py ``MAPPINGS_KEPT_OPS``): with one warm-up round trip the first timed
#: move still paid that (``dp=2,tp=2,pp=2 -> tp=2,pp=4`` on bench-1gb, 2026-11-24: prepare 136 ms
#: on the slowest worker, wall 156 ms for 57 ms of execute; 0 ms and 52 ms from the next move on).
#: An RL loop pays it once per pair, not per iteration.
WARM_UP_ROUND_TRIPS = 2


def _bench_transition(
    group,
    layouts: _Layouts,
    index: int,
    src: Topology,
    dst: Topology,
    repeats: int,
    baseline_repeats: int,
    baselines: list[str],
    verify: str,
    seed: int,
    transport: dict,
    cores: int,
    out: list[dict],
    memory: _MemoryGuard,
    traces: list | None = None,
    rounds: Progress | None = None,
) -> bool:
    """Both directions of ``src -> dst``: ours (``WARM_UP_ROUND_TRIPS`` untimed round trips, then
    ``repeats`` timed ones, each counted on ``rounds``), then every baseline ``baseline_repeats``
    times from ``src``, then from ``dst``. Each direction is appended to ``out`` when it is
    finished (a run stopped in the way back keeps the way there); returns whether ours verified.
    ``traces``: gets the trace of every timed move of ours (gathered after its timing)."""
    ok = True
    if group.topology != src:
        group.reallocate(src)
        ok &= layouts.check()
    for _ in range(WARM_UP_ROUND_TRIPS):  # this pair's plans, communicators and reused pages
        group.reallocate(dst)
        ok &= layouts.check()
        group.reallocate(src)
        ok &= layouts.check()
    plans = {"forward": group.plan_to(dst)}
    times: dict[str, list] = {"forward": [], "back": []}
    last: dict[str, Any] = {}
    for i in range(repeats):
        for way, target in (("forward", dst), ("back", src)):
            t = time.perf_counter()
            stats = group.reallocate(target)
            times[way].append((time.perf_counter() - t, stats.seconds))
            last[way] = stats
            if traces is not None:
                traces.append(group.last_trace())
            if i == repeats - 1:
                ok &= layouts.check()
        _log(
            f"ours {src} <-> {dst} round trip {i + 1}/{repeats}: "
            f"{times['forward'][-1][0]:.3f}s there (execute {times['forward'][-1][1]:.3f}s), "
            f"{times['back'][-1][0]:.3f}s back (execute {times['back'][-1][1]:.3f}s)"
        )
        if rounds is not None:
            rounds.advance()
    for way, a, b in (("forward", src, dst), ("back", dst, src)):
        if way == "back":
            group.reallocate(dst)  # untimed: the baselines of the way back start from dst
            ok &= layouts.check()
            plans["back"] = group.plan_to(src)
        d = _direction(
            group,
            layouts,
            index,
            way,
            a,
            b,
            times[way],
            last[way],
            plans[way],
            baselines,
            baseline_repeats,
            verify,
            seed,
            transport,
            cores,
            memory,
        )
        d["verified"]["ours"] = ok
        out.append(d)
        if "group_broken" in d:
            raise RuntimeError(f"a baseline failed and the group could not be restored: {d['group_broken']}")
    return ok


def _bench_resident(
    group, layouts: _Layouts, src: Topology, dst: Topology, repeats: int, without: list[dict]
) -> tuple[dict, bool]:
    """The RL loop with kept layouts (``reallocate(..., keep=)``, actors/resident.py): per
    iteration a 'training step' that counts as a change of the weights (it writes nothing, so the
    digests still verify), the move to ``dst``, the move back. ``in_place``: both layouts kept
    on the device, so the move there refreshes the kept ``dst`` buffers and the move back adopts
    ``src`` (nothing travels). ``host``: the trainer's layout offloaded during generation
    (``keep="host"`` there, nothing kept back), so the move back is one host-to-device copy.
    ``without``: the two directions of the same transition without ``keep``."""
    ok, out = True, {}  # (the digest checks are group.run(..., writes=False): they leave the version alone)
    for mode, back_keep, there_use in (("in_place", "in_place", "refreshed"), ("host", None, None)):
        if group.topology != src:
            group.reallocate(src)
        group.reallocate(dst, keep=mode)  # warm-up (and in place: both layouts kept from here on)
        group.reallocate(src, keep=back_keep)
        there, back = [], []
        for i in range(repeats):
            group.run(_training_step)  # a change of the weights as far as the driver knows
            t = time.perf_counter()
            s1 = group.reallocate(dst, keep=mode)
            there.append(time.perf_counter() - t)
            if i == repeats - 1:
                ok &= layouts.check()
            t = time.perf_counter()
            s2 = group.reallocate(src, keep=back_keep)
            back.append(time.perf_counter() - t)
            if i == repeats - 1:
                ok &= layouts.check()
        ok &= s1.resident_use == there_use and s2.resident_use == "adopted"
        kept = max(
            s1.resident_in_place_bytes_per_actor + s1.resident_host_bytes_per_actor,
            s2.resident_in_place_bytes_per_actor + s2.resident_host_bytes_per_actor,
        )
        out[mode] = {
            "there_median_seconds": statistics.median(there),
            "back_median_seconds": statistics.median(back),
            "round_trip_median_seconds": statistics.median(there) + statistics.median(back),
            "there_seconds": there,
            "back_seconds": back,
            "there": s1.as_dict(),
            "back": s2.as_dict(),
            "kept_bytes_per_actor": kept,
        }
        _log(
            f"resident ({mode}) {src} <-> {dst}: there {out[mode]['there_median_seconds']:.3f}s, "
            f"back {out[mode]['back_median_seconds']:.3f}s (adopted); kept {kept / 1e6:.1f} MB per actor"
        )
        group.release_resident()
    out["without_keep_round_trip_median_seconds"] = sum(d["ours_seconds"] for d in without)
    return out, ok


def _training_step(ctx) -> None:
    """Stands for an optimizer step in the bench's resident loop (``group.run`` counts it as a
    change of the weights); it writes nothing, so the verified digests still hold."""


# -- staged updates: a generator serving while the trainer's weights arrive -----------------------


def staged_memory_estimate(spec, trainer: Topology, generator: Topology, bucket_bytes: int) -> dict:
    """Node memory the staged measurement takes at its peak (its own two groups; the moves'
    group is gone by then): ``{"bytes", "terms"}``. The trainer's layout; four sets of the
    generator's (serving, the shadow set kept between updates, the stop-the-world copy's fresh
    destination, and the set it replaces, kept as its rollback or spare); the trainer's move into
    the generator's layout for the final check; two buckets of staging per worker. (bench-1gb,
    2026-11-24: 8.20 GB; the node's used memory rose by 7.64 and 7.30 GB at its peak in two runs,
    the first above the estimate of that run, which counted three generator sets: 7.18.)"""
    t, g = Layout(spec, trainer), Layout(spec, generator)
    gen_bytes = sum(g.rank_bytes(r) for r in range(generator.world_size))
    terms = {
        "trainer_bytes": sum(t.rank_bytes(r) for r in range(trainer.world_size)),
        "generator_sets_bytes": 4 * gen_bytes,
        "trainer_check_bytes": gen_bytes,
        "staging_bytes": 2 * bucket_bytes * (trainer.world_size + generator.world_size),
    }
    return {"bytes": sum(terms.values()), "terms": terms}


def latency_summary(seconds: Sequence[float]) -> dict:
    """``calls``, ``median_seconds``, ``p99_seconds`` (nearest rank: below 100 calls, the slowest)
    and ``max_seconds`` of call latencies (``None`` without calls)."""
    s = sorted(seconds)
    if not s:
        return {"calls": 0, "median_seconds": None, "p99_seconds": None, "max_seconds": None}
    return {
        "calls": len(s),
        "median_seconds": statistics.median(s),
        "p99_seconds": s[max(0, math.ceil(0.99 * len(s)) - 1)],
        "max_seconds": s[-1],
    }


@functools.lru_cache(maxsize=1)
def _generator_cls() -> type:
    """The staged measurement's generator worker class (defined on first use: ``actors`` imports
    Ray; Ray ships the class to the workers by value)."""
    from actors.worker import ShardWorker

    class BenchGenerator(ShardWorker):
        """One cheap read-only method, and no ``on_shards_changed`` hook: a commit's pause has no
        hook time in it."""

        def probe(self) -> tuple[int, int]:
            """``(weight version served, CRC32 of this rank's smallest non-empty slot)``: what a
            generation call reads, for a few microseconds of work (the latency is the call path's)."""
            ctx = self.context()
            slot = min((s for s, t in ctx.tensors.items() if t.numel()), key=lambda s: (ctx.tensors[s].numel(), s))
            return ctx.version, _crc(ctx.tensors[slot])

    return BenchGenerator


def _bump_weights(ctx) -> None:
    """The staged measurement's training step: every real element of the trainer's shards + 1
    (padding stays zero; every dp replica does the same), so each update brings other bytes."""
    for view in ctx.views().values():
        view.add_(1)


class _Caller:
    """A driver thread calling the generator's ``probe`` back to back with ``writes=False`` (as
    a generation server would): each call's ``(start, end, result)`` on the driver's clock."""

    def __init__(self, gen):
        import threading

        self.gen, self.calls, self.error = gen, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-caller", daemon=True)

    def __enter__(self) -> _Caller:  # noqa: PYI034
        self._thread.start()
        self.wait_calls(1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"generator call failed: {type(self.error).__name__}: {self.error}") from self.error

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                t = time.perf_counter()
                out = self.gen.call("probe", writes=False)
                self.calls.append((t, time.perf_counter(), out))
        except Exception as err:  # noqa: BLE001 - raised on the driver's thread by __exit__
            self.error = err

    def wait_calls(self, n: int, after: float = -math.inf, timeout_s: float = 300.0) -> None:
        """Until ``n`` calls that started at or after ``after`` have returned."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for s, _, _ in list(self.calls) if s >= after) < n:
            if self.error is not None:
                raise RuntimeError(f"generator call failed: {type(self.error).__name__}: {self.error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the generator answered fewer than {n} calls in {timeout_s:.0f}s")
            time.sleep(0.002)


def _check_served(calls: list, begin: float, end: float, before, after, what: str, failures: list[str]) -> None:
    """Calls that ended before ``begin`` served ``before``, calls that started after ``end``
    served ``after``, and calls overlapping ``[begin, end]`` one of the two on every rank alike
    (never a mix of versions across the generator's workers)."""
    for s, e, out in calls:
        want = [before] if e <= begin else [after] if s >= end else [before, after]
        if out not in want:
            failures.append(f"{what}: a call from {s - begin:+.3f}s to {e - begin:+.3f}s served {out}, not {want}")
            return


def _staged_round(trainer, gen, before_digests: list, failures: list[str], label: str) -> tuple[dict, list, list]:
    """One training step, one staged update committed while the caller runs, then one
    stop-the-world ``copy_to`` while the caller runs: the round's figures, the latencies of the
    calls that ran during the staging, and the generator's digests at the end."""
    trainer.run(_bump_weights)  # a training step: every weight changes (the trainer's version too)
    served_before = gen.call("probe", writes=False)
    with _Caller(gen) as caller:
        t0 = time.perf_counter()
        update = trainer.copy_to(gen, stage=True)
        stats = update.wait()
        t1 = time.perf_counter()
        update.commit()
        t2 = time.perf_counter()
        caller.wait_calls(STAGED_CALLS_AFTER, after=t2)
    staged_calls = caller.calls
    generator_version = gen.version
    served_after = gen.call("probe", writes=False)
    staged_digests = _digests_of_group(gen)
    with _Caller(gen) as caller:
        t3 = time.perf_counter()
        stw = trainer.copy_to(gen)
        t4 = time.perf_counter()
        caller.wait_calls(STAGED_CALLS_AFTER, after=t4)
    stw_calls = caller.calls
    served_stw = gen.call("probe", writes=False)
    stw_digests = _digests_of_group(gen)

    n = len(failures)
    _check_served(staged_calls, t1, t2, served_before, served_after, f"{label} staged update", failures)
    _check_served(stw_calls, t3, t4, served_after, served_stw, f"{label} stop-the-world copy", failures)
    if any(v != update.version for v, _ in served_after):
        failures.append(f"{label}: after the commit the generator served versions {served_after}, not {update.version}")
    if any(a[1] == b[1] for a, b in zip(served_before, served_after)):
        failures.append(f"{label}: a generator worker served the same bytes before and after the commit")
    if [c for _, c in served_stw] != [c for _, c in served_after] or any(v != stw.version for v, _ in served_stw):
        failures.append(f"{label}: after the stop-the-world copy the generator served {served_stw}")
    if any(a == b for a, b in zip(before_digests, staged_digests)):
        failures.append(f"{label}: a generator worker's shards did not change with the staged update")
    if staged_digests != stw_digests:
        failures.append(f"{label}: the staged update and the stop-the-world copy left different shards")

    during = [e - s for s, e, _ in staged_calls if s >= t0 and e <= t1]
    commit = [e - s for s, e, _ in staged_calls if s < t2 and e > t1]
    # How long the commit kept calls out: from the end of the call it waited for (one in flight
    # when it began, served before it; none: from its start) to its return.
    waited_for = [e for s, e, _ in staged_calls if s < t1 < e <= t2]
    blocking = t2 - max([t1, *waited_for])
    blocked = [e - s for s, e, _ in stw_calls if s < t4 and e > t3]
    out = {
        "staging_wall_seconds": t1 - t0,
        "transfer_seconds": stats.seconds,
        "transfer_gbps": stats.gbps,
        "calls_during_staging": latency_summary(during),
        "pause_seconds": update.pause_seconds,
        "commit_wall_seconds": t2 - t1,
        "commit_blocking_seconds": blocking,
        "calls_overlapping_commit": len(commit),
        "overlapping_commit_call_max_seconds": max(commit, default=None),
        "stop_the_world_seconds": t4 - t3,
        "calls_overlapping_stop_the_world": len(blocked),
        "overlapping_stop_the_world_call_max_seconds": max(blocked, default=None),
        "shadow_bytes_per_actor": stats.shadow_bytes_per_actor,
        "version": {
            "trainer": trainer.version,
            "update": update.version,
            "stats": stats.version,
            "generator_after_commit": generator_version,
            "served_before": sorted({v for v, _ in served_before}),
            "served_after_commit": sorted({v for v, _ in served_after}),
            "after_stop_the_world": stw.version,
        },
        "staged_stats": stats.as_dict(),
        "stop_the_world_stats": stw.as_dict(),
        "verified": len(failures) == n,
    }
    _log(
        f"staged {label}: staging {t1 - t0:.3f}s ({stats.seconds:.3f}s transfer, {stats.gbps:.2f} GB/s, "
        f"{len(during)} calls served, median {_ms(out['calls_during_staging']['median_seconds'])}); commit "
        f"pause {update.pause_seconds * 1e3:.2f} ms (calls kept out {blocking * 1e3:.2f} ms, wall "
        f"{(t2 - t1) * 1e3:.2f} ms, calls overlapping it "
        f"max {_ms(out['overlapping_commit_call_max_seconds'])}); stop-the-world copy {t4 - t3:.3f}s; "
        f"{'ok' if out['verified'] else failures[n:]}"
    )
    return out, during, stw_digests


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _bench_staged(
    spec,
    trainer_topo: Topology,
    gen_topo: Topology,
    *,
    bucket_bytes: int,
    repeats: int,
    calls: int,
    seed: int,
    memory_check: bool,
    local: bool,
) -> dict:
    """The staged-update measurement (docs/benchmarks.md, "Staged updates"): a trainer group and
    a generator group on actors of their own; ``calls`` generator calls while idle; one untimed
    round (forms the staged world and the copies' world, touches the shadow set's pages), then
    ``repeats`` rounds of :func:`_staged_round`; finally the trainer moves into the generator's
    layout and its digests must equal the generator's."""
    import psutil

    from actors.driver.group import ModelGroup

    started = time.perf_counter()
    out: dict[str, Any] = {
        "trainer": str(trainer_topo),
        "generator": str(gen_topo),
        "trainer_actors": trainer_topo.world_size,
        "generator_actors": gen_topo.world_size,
        "repeats": repeats,
        "idle_calls": calls,
        "generator_call": "ModelGroup.call('probe', writes=False) from a driver thread, back to back: the "
        "weight version served and the CRC32 of each worker's smallest slot",
        "hook": None,
        "pause_target_seconds": STAGED_PAUSE_TARGET_SECONDS,
    }
    estimate = staged_memory_estimate(spec, trainer_topo, gen_topo, bucket_bytes)
    out["memory"] = {"checked": memory_check, "estimate_bytes": estimate["bytes"], "estimate_terms": estimate["terms"]}
    if memory_check:
        vm = psutil.virtual_memory()
        fits, budget, why = memory_fit(estimate["bytes"], vm.available, vm.total)
        out["memory"]["budget_bytes"] = budget
        if not fits:
            out["skipped"] = f"skipped: {why}"
            _log(f"staged measurement {out['skipped']}")
            return out
    trainer = ModelGroup.create(spec, trainer_topo, name="bench-trainer", bucket_bytes=bucket_bytes, timeout_s=900)
    gen = None
    try:
        gen = ModelGroup.create(
            spec,
            gen_topo,
            name="bench-generator",
            worker_cls=_generator_cls(),
            bucket_bytes=bucket_bytes,
            timeout_s=900,
        )
        tn, gn = set(trainer.placement.nodes), set(gen.placement.nodes)
        out.update(nodes=len(tn | gn), trainer_nodes=len(tn), generator_nodes=len(gn), shared_nodes=len(tn & gn))
        out["generator_bytes_per_actor"] = max(gen.layout.rank_bytes(r) for r in range(gen.num_workers))
        sampler = _MemorySampler([i["pid"] for i in trainer.infos + gen.infos] if local else None)
        failures: list[str] = []
        with sampler, sampler.window() as window:
            t = time.perf_counter()
            trainer.init_synthetic(seed + 1)  # other weights than the generator's from the start
            gen.init_synthetic(seed)
            digests = _digests_of_group(gen)
            _log(f"staged: {trainer_topo} -> {gen_topo}, synthetic weights written in {time.perf_counter() - t:.1f}s")
            warm, _, digests = _staged_round(trainer, gen, digests, failures, "warm-up")
            for _ in range(3):  # untimed: the path's own first calls
                gen.call("probe", writes=False)
            idle = []
            for _ in range(calls):
                t = time.perf_counter()
                gen.call("probe", writes=False)
                idle.append(time.perf_counter() - t)
            out["idle"] = latency_summary(idle)
            _log(f"staged: {calls} idle calls, median {_ms(out['idle']['median_seconds'])}")
            rounds, during = [], []
            for i in range(repeats):
                r, lat, digests = _staged_round(trainer, gen, digests, failures, f"{i + 1}/{repeats}")
                rounds.append(r)
                during += lat
            trainer.reallocate(gen.layout)  # the check: the trainer's weights in the generator's layout
            if _digests_of_group(trainer) != digests:
                failures.append("the generator's shards differ from the trainer's in the generator's layout")
        out["memory"].update(_window_json(window))
    finally:
        if gen is not None:
            gen.shutdown()
        trainer.shutdown()
    pauses = [r["pause_seconds"] for r in rounds]
    out["warm_up"] = {
        k: warm[k]
        for k in (
            "staging_wall_seconds",
            "transfer_seconds",
            "pause_seconds",
            "commit_wall_seconds",
            "stop_the_world_seconds",
        )
    }
    out["during_staging"] = {
        **latency_summary(during),
        "calls_per_update": [r["calls_during_staging"]["calls"] for r in rounds],
        "staging_wall_median_seconds": statistics.median(r["staging_wall_seconds"] for r in rounds),
        "transfer_median_seconds": statistics.median(r["transfer_seconds"] for r in rounds),
        "transfer_gbps_median": statistics.median(r["transfer_gbps"] for r in rounds),
        "bytes_inter_node": rounds[-1]["staged_stats"]["bytes_inter_node"],
        "bytes_intra_node": rounds[-1]["staged_stats"]["bytes_intra_node"],
        "bytes_local": rounds[-1]["staged_stats"]["bytes_local"],
    }
    out["commit"] = {
        "pause_seconds": pauses,
        "pause_median_seconds": statistics.median(pauses),
        "pause_max_seconds": max(pauses),
        "commit_wall_seconds": [r["commit_wall_seconds"] for r in rounds],
        "blocking_seconds": [r["commit_blocking_seconds"] for r in rounds],
        "blocking_median_seconds": statistics.median(r["commit_blocking_seconds"] for r in rounds),
        "calls_overlapping": [r["calls_overlapping_commit"] for r in rounds],
        "overlapping_call_max_seconds": max(
            (r["overlapping_commit_call_max_seconds"] for r in rounds if r["calls_overlapping_commit"]), default=None
        ),
    }
    walls = [r["stop_the_world_seconds"] for r in rounds]
    out["stop_the_world"] = {
        "seconds": walls,
        "median_seconds": statistics.median(walls),
        "transfer_median_seconds": statistics.median(r["stop_the_world_stats"]["seconds"] for r in rounds),
        "overlapping_call_max_seconds": max(
            (r["overlapping_stop_the_world_call_max_seconds"] for r in rounds if r["calls_overlapping_stop_the_world"]),
            default=None,
        ),
    }
    out["shadow_bytes_per_actor"] = max(r["shadow_bytes_per_actor"] for r in rounds)
    out["version"] = rounds[-1]["version"]
    out["goal"] = {
        "target_seconds": STAGED_PAUSE_TARGET_SECONDS,
        "hook_seconds": None,  # no on_shards_changed hook in the bench's generator worker class
        "met": max(pauses) <= STAGED_PAUSE_TARGET_SECONDS,
        "met_by_median": statistics.median(pauses) <= STAGED_PAUSE_TARGET_SECONDS,
    }
    out["runs"] = rounds
    out["failures"] = failures
    out["verified"] = not failures
    out["seconds"] = time.perf_counter() - started
    return out


def _run_staged(spec, trainer: Topology, generator: Topology, **kwargs: Any) -> dict:
    """:func:`_bench_staged`, its failure recorded (``error``, ``verified`` false) rather than raised."""
    try:
        return _bench_staged(spec, trainer, generator, **kwargs)
    except Exception as err:  # noqa: BLE001 - the moves' figures stand without it
        text = f"{type(err).__name__}: {err}"[:2000]
        _log(f"staged measurement failed: {text[:300]}")
        return {"trainer": str(trainer), "generator": str(generator), "error": text, "verified": False}


def format_staged(s: dict) -> list[str]:
    """The staged measurement's lines of :func:`format_report`."""
    head = f"staged update, trainer {s['trainer']} -> generator {s['generator']}"
    if "skipped" in s:
        return [f"{head}: {s['skipped']}"]
    if "error" in s:
        return [f"{head}: FAILED: {s['error'][:300]}"]
    idle, during, commit, stw, goal = s["idle"], s["during_staging"], s["commit"], s["stop_the_world"], s["goal"]

    def lat(x: dict) -> str:
        return f"median {_ms(x['median_seconds'])}, p99 {_ms(x['p99_seconds'])}, max {_ms(x['max_seconds'])}"

    where = "on nodes of their own" if not s["shared_nodes"] else f"sharing {s['shared_nodes']} node(s)"
    lines = [
        f"{head} ({s['trainer_actors']} + {s['generator_actors']} actors {where}; {s['repeats']} updates after a "
        f"warm-up; generator call 'probe' with writes=False, no hook)",
        f"  calls idle: {lat(idle)} ({idle['calls']} calls)",
        f"  calls during staging: {lat(during)} ({during['calls']} calls over {s['repeats']} updates); transfer "
        f"{during['transfer_median_seconds']:.3f}s ({during['transfer_gbps_median']:.2f} GB/s), staging wall "
        f"{during['staging_wall_median_seconds']:.3f}s; shadow set {s['shadow_bytes_per_actor'] / 1e6:.1f} MB per "
        f"actor; version {s['version']['update']}",
        f"  pause at commit: median {_ms(commit['pause_median_seconds'])}, max {_ms(commit['pause_max_seconds'])}; "
        f"calls kept out median {_ms(commit['blocking_median_seconds'])}; calls overlapping the commit: max "
        f"{_ms(commit['overlapping_call_max_seconds'])}; target "
        f"<= {goal['target_seconds'] * 1e3:g} ms (no hook) {'met' if goal['met'] else 'NOT met'}"
        + (
            ""
            if goal["met"] == goal["met_by_median"]
            else f" (by the median: {'met' if goal['met_by_median'] else 'not met'})"
        ),
        f"  stop-the-world copy_to: median {stw['median_seconds']:.3f}s without a call served (calls overlapping "
        f"it: max {_ms(stw['overlapping_call_max_seconds'])})",
        f"  verified: {'yes' if s['verified'] else 'NO: ' + '; '.join(s['failures'])[:300]}",
    ]
    return lines


def _direction(
    group,
    layouts: _Layouts,
    index: int,
    way: str,
    src: Topology,
    dst: Topology,
    times: list,
    last,
    plan,
    baselines: list[str],
    baseline_repeats: int,
    verify: str,
    seed: int,
    transport: dict,
    cores: int,
    memory: _MemoryGuard,
) -> dict:
    """One direction's figures; runs its baselines but ``DEFERRED_BASELINES`` (the group holds
    ``src``; :func:`_run_baselines`)."""
    walls = [w for w, _ in times]
    ours = {
        "seconds": walls,
        "best_seconds": min(walls),
        "median_seconds": statistics.median(walls),
        "execute_seconds": [e for _, e in times],
        "execute_median_seconds": statistics.median(e for _, e in times),
        "outside_execute_median_seconds": statistics.median(w - e for w, e in times),
        "stats": last.as_dict(),
    }
    d: dict[str, Any] = {
        "transition": index,
        "way": way,
        "src": str(src),
        "dst": str(dst),
        "ours": ours,
        "ours_seconds": ours["median_seconds"],
        "peak_extra_bytes_per_actor": last.peak_extra_bytes_per_actor,
    }
    d["plan"] = {
        k: plan.stats[k]
        for k in (
            "bytes_total",
            "bytes_intra_node",
            "bytes_inter_node",
            "bytes_local_copy",
            "num_steps",
            "num_routes",
            "num_buckets",
            "max_node_egress_bytes",
            "max_node_ingress_bytes",
        )
    }
    d.update(lower_bound(plan, transport, cores, group.num_workers))
    d["ratio_to_lower_bound"] = d["ours_seconds"] / d["lower_bound_seconds"]
    d["ratio_to_linear_copy_bound"] = d["ours_seconds"] / d["lower_bound_linear_copy_seconds"]
    for key in (
        "baselines",
        "baseline_runs",
        "baseline_details",
        "verified",
        "baselines_skipped",
        "baselines_failed",
        "baseline_memory",
    ):
        d[key] = {}
    _run_baselines(
        group,
        layouts,
        d,
        [n for n in baselines if n not in DEFERRED_BASELINES],
        2 * index + (way == "back"),
        dst,
        baseline_repeats,
        verify,
        seed,
        memory,
    )
    _log(
        f"{src} -> {dst}: ours {d['ours_seconds']:.3f}s, bound {d['lower_bound_seconds']:.3f}s "
        f"({d['ratio_to_lower_bound']:.2f}x; {d['ratio_to_linear_copy_bound']:.2f}x the bound with copies "
        f"at cores x one core)"
    )
    return d


#: Baselines that run after every direction's others and the resident loop, each direction from
#: its source layout again: ``driver``, whose first run leaves ~4.6 GB touched for the rest of the
#: run (Ray's stores keep the pages they touched; measured 2026-11-24 on bench-1gb: the node's used
#: memory 10.5 GB before it, 15.0 GB after it, its drop and a trim), so that every other baseline,
#: and ours, has the room it had before it.
DEFERRED_BASELINES = ("driver",)


def _run_baselines(
    group,
    layouts: _Layouts,
    d: dict,
    names: list[str],
    direction: int,
    dst: Topology,
    baseline_repeats: int,
    verify: str,
    seed: int,
    memory: _MemoryGuard,
) -> None:
    """Run ``names`` from the group's layout (``d``'s source) to ``dst``, ``baseline_repeats``
    times each, into ``d`` (``baselines``, ``baseline_runs``, ``baseline_details``,
    ``verified``, ``baselines_skipped``, ``baselines_failed``, ``baseline_memory``,
    ``speedup_vs``).

    Before each run of a baseline its peak is estimated (:func:`baseline_memory_estimate`, or
    what an earlier run of it here took, if more) and compared to what the node can take
    (:func:`decide_run`): a baseline that does not fit is skipped (``baselines_skipped``: the
    reason), or stops after the runs it had (``baseline_memory[name]["shrunk"]``). A run that
    raises (a worker killed by Ray's memory monitor, a bug) is recorded in ``baselines_failed``
    with its error, the group is restored (:func:`recover_group`) and the next baseline runs; if
    the group cannot be restored, ``group_broken`` says why and the remaining baselines are
    skipped. Ours' figures are in the direction either way."""
    src = group.topology
    reference = layouts.digests.get(group.target(dst))
    nodes = group.placement.num_nodes
    for name in names:
        if "group_broken" in d:
            d["baselines_skipped"][name] = f"not run: the group could not be restored ({d['group_broken'][:200]})"
            continue
        runs, bad_any, info = [], [], {}
        mem = d["baseline_memory"][name] = {"runs": []}
        for i in range(baseline_repeats):
            group.trim_memory()  # 8 actors, each with a spare layout and a baseline's copies: 24 GB was not enough
            _malloc_trim()
            estimate = baseline_memory_estimate(name, group.layout, group.target(dst), nodes, memory.store_resident)
            if i == 0:
                mem.update(estimate_bytes=estimate["bytes"], estimate_terms=estimate["terms"])
            if memory.checked:  # what an earlier run took counts, less the store pages it left touched
                taken = [r["peak_extra_bytes"] - r["store_growth_bytes"] for r in mem["runs"]]
                go, budget, reason = memory.decide(estimate["bytes"], taken, baseline_repeats)
                mem["budget_bytes"] = budget
                if not go:
                    _log(f"baseline {name} {src} -> {dst} {reason}")
                    if runs:
                        mem["shrunk"] = reason
                    else:
                        d["baselines_skipped"][name] = reason
                    break
            fault = memory.fault(name, direction) if i == 0 else None
            w = None
            try:
                with memory.sampler.window() as w:
                    if fault:
                        group.run(_fault_fn, fault, writes=False)
                    seconds, info = BASELINE_FNS[name](group, dst)
            except Exception as err:  # noqa: BLE001 - e.g. Ray's memory monitor killed a worker: record it, go on
                text = f"{type(err).__name__}: {err}"[:2000]
                _log(f"baseline {name} {src} -> {dst} FAILED in run {i + 1}: {text[:300]}")
                failed = d["baselines_failed"][name] = {"error": text, "runs_before": runs, "memory": _window_json(w)}
                try:
                    failed["recovery"] = recover_group(group, layouts, seed)
                    if memory.sampler.local:
                        memory.sampler.set_pids([x["pid"] for x in group.infos])
                except Exception as err2:  # noqa: BLE001 - the caller stops after keeping this direction
                    d["group_broken"] = failed["recovery_error"] = f"{type(err2).__name__}: {err2}"[:2000]
                    _log(f"group could not be restored: {d['group_broken'][:300]}")
                break
            mem["runs"].append(
                {**_window_json(w), "store_growth_bytes": estimate["terms"].get("object_store_bytes", 0)}
            )
            if name == "driver":
                memory.store_resident = max(memory.store_resident, driver_store_bytes(group.spec.total_bytes(), nodes))
            bad = (
                _verify_baseline(group, verify, seed, reference)
                if reference is not None or verify == "exact"
                else ["<no verified reference digests>"]
            )
            group.run(_drop_state, writes=False)
            _malloc_trim()  # the driver baseline's full tensors
            runs.append(seconds)
            bad_any += bad
        if mem["runs"]:
            mem["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in mem["runs"])
            mem["peak_used_bytes"] = max(r["peak_used_bytes"] for r in mem["runs"])
            mem["workers_private_peak_bytes"] = max(r["workers_private_peak_bytes"] for r in mem["runs"])
            mem["worker_rss_max_bytes"] = max(r["worker_rss_max_bytes"] for r in mem["runs"])
        if name in d["baselines_failed"] or name in d["baselines_skipped"]:
            continue
        info.update(verified=not bad_any, mismatches=bad_any[:5])
        d["baseline_details"][name], d["verified"][name] = info, not bad_any
        d["baselines"][name] = statistics.median(runs)
        d["baseline_runs"][name] = runs
        _log(
            f"baseline {name} {src} -> {dst}: median {d['baselines'][name]:.2f}s of "
            f"{', '.join(f'{s:.2f}' for s in runs)}; verified {'ok' if not bad_any else bad_any[:3]}; "
            f"peak +{mem['peak_extra_bytes'] / 1e9:.2f} GB (node {mem['peak_used_bytes'] / 1e9:.1f} GB; "
            f"estimated +{mem['estimate_bytes'] / 1e9:.2f})"
        )
    d["speedup_vs"] = {k: v / d["ours_seconds"] for k, v in d["baselines"].items()}


def _run_deferred(
    group,
    layouts: _Layouts,
    transitions: list[tuple[Topology, Topology]],
    directions: list[dict],
    names: list[str],
    baseline_repeats: int,
    verify: str,
    seed: int,
    memory: _MemoryGuard,
) -> bool:
    """``DEFERRED_BASELINES`` of every direction, in order, each from its source layout again
    (an untimed, verified move there); returns whether ours verified on those moves."""
    ok = True
    for i, d in enumerate(directions):
        if "group_broken" in d:
            break
        a, b = transitions[d["transition"]]
        src, dst = (a, b) if d["way"] == "forward" else (b, a)
        if group.topology != src:
            group.reallocate(src)
            ok &= layouts.check()
        _run_baselines(group, layouts, d, names, i, dst, baseline_repeats, verify, seed, memory)
        if "group_broken" in d:
            raise RuntimeError(f"a baseline failed and the group could not be restored: {d['group_broken']}")
    return ok


def _summarise(report: dict, directions: list[dict], ours_ok: bool, failures: list[str]) -> None:
    """Top-level figures: the worst direction's, and the goals over every direction."""
    worst = max(range(len(directions)), key=lambda i: directions[i]["ratio_to_lower_bound"])
    w = directions[worst]
    report["worst_direction"] = worst
    for key in (
        "ours_seconds",
        "ours",
        "lower_bound_seconds",
        "lower_bound_terms",
        "lower_bound_fresh_buffers_seconds",
        "lower_bound_formula",
        "plan",
        "baselines",
    ):
        report[key] = w[key]
    report["ratio_to_lower_bound"] = w["ratio_to_lower_bound"]
    report["ratio_to_linear_copy_bound"] = max(d["ratio_to_linear_copy_bound"] for d in directions)
    # a baseline skipped (memory) or failed in a direction has no figures there; it counts where it ran
    names = [n for n in BASELINES if any(n in d["baselines"] for d in directions)]
    ran = {n: [i for i, d in enumerate(directions) if n in d["baselines"]] for n in names}
    # speedup_vs: the smallest over every direction (what "N x faster in every direction" means)
    report["speedup_vs"] = {n: min(directions[i]["speedup_vs"][n] for i in ran[n]) for n in names}
    report["speedup_vs_direction"] = {n: min(ran[n], key=lambda i: directions[i]["speedup_vs"][n]) for n in names}
    report["peak_extra_bytes_per_actor"] = max(d["peak_extra_bytes_per_actor"] for d in directions)
    report["verified"] = {
        "ours": ours_ok and not failures,
        **{n: all(directions[i]["verified"][n] for i in ran[n]) for n in names},
    }
    report["baseline_failures"] = [
        {"direction": i, "baseline": n, "error": f["error"]}
        for i, d in enumerate(directions)
        for n, f in d.get("baselines_failed", {}).items()
    ]
    report["baseline_skips"] = [
        {"direction": i, "baseline": n, "reason": why}
        for i, d in enumerate(directions)
        for n, why in d.get("baselines_skipped", {}).items()
    ]
    report["baseline_skips"] += [
        {"direction": i, "baseline": n, "reason": m["shrunk"]}
        for i, d in enumerate(directions)
        for n, m in d.get("baseline_memory", {}).items()
        if "shrunk" in m
    ]
    report["baselines_complete"] = not report["baseline_failures"] and not report["baseline_skips"]
    peaks: dict[str, dict] = {}
    for d in directions:
        for n, m in d.get("baseline_memory", {}).items():
            p = peaks.setdefault(
                n,
                {
                    "estimate_bytes": 0,
                    "peak_extra_bytes": 0,
                    "peak_used_bytes": 0,
                    "workers_private_peak_bytes": 0,
                    "worker_rss_max_bytes": 0,
                },
            )
            p["estimate_bytes"] = max(p["estimate_bytes"], m.get("estimate_bytes", 0))
            for key in ("peak_extra_bytes", "peak_used_bytes", "workers_private_peak_bytes", "worker_rss_max_bytes"):
                p[key] = max(p[key], m.get(key, 0))
    report.setdefault("memory", {})["baselines"] = peaks  # per baseline, the largest over the directions
    report["verification_failures"] = failures
    report["goals"] = {
        "speedup_5x_vs_every_baseline": all(s >= 5 for s in report["speedup_vs"].values()),
        "within_1_5x_of_lower_bound": report["ratio_to_lower_bound"] <= 1.5,
    }


def lower_bound(plan, transport: dict, cores: int, workers: int) -> dict:
    """The lower bound of a transition on this machine from the plan's bytes and measured rates."""
    gloo = max(transport["gloo_p2p_gbps"], transport["gloo_aggregate_gbps"]) * 1e9
    # The concurrent probes, capped at every core copying at the one-core rate: a lone copier has
    # the memory bus to itself, so no set of copiers beats cores x it; a probe that does measured
    # its barriers' noise (the cap is what the bound then charges, and says so).
    measured = max(transport["memcpy_cores_gbps"], transport["memcpy_aggregate_gbps"]) * 1e9
    ceiling = min(cores, workers) * transport["memcpy_1core_gbps"] * 1e9
    memcpy = min(measured, ceiling)
    # The formula before 2026-11-22 charged copies at cores x the one-core rate, a rate no
    # measurement showed (two cores copying at once moved 1.45-1.75x one core here, not 2x); kept
    # beside the bound so runs before and after compare.
    linear = max(min(cores, workers) * transport["memcpy_1core_gbps"], transport["memcpy_aggregate_gbps"]) * 1e9
    one_core = transport["memcpy_1core_gbps"] * 1e9
    pair = transport["gloo_p2p_gbps"] * 1e9
    s = plan.stats
    copied = s["bytes_intra_node"] + s["bytes_local_copy"]
    aggregate = s["bytes_inter_node"] / gloo + copied / memcpy
    inter: dict[int, int] = {}
    copies: dict[int, int] = {}
    for _, a, b, j in plan.routes():
        n = plan.list_bytes(j)
        if plan.nodes[a] != plan.nodes[b]:
            inter[b] = inter.get(b, 0) + n
        else:
            copies[b] = copies.get(b, 0) + n
    for w, j in plan.local_copies:
        copies[w] = copies.get(w, 0) + plan.list_bytes(j)
    critical = max(
        (inter.get(r, 0) / pair + copies.get(r, 0) / one_core for r in set(inter) | set(copies)), default=0.0
    )
    return {
        "lower_bound_seconds": max(aggregate, critical),
        "lower_bound_formula": LOWER_BOUND_FORMULA,
        "lower_bound_terms": {
            "aggregate_seconds": aggregate,
            "critical_rank_seconds": critical,
            "inter_node_seconds": s["bytes_inter_node"] / gloo,
            "copy_seconds": copied / memcpy,
            "gloo_gbps": gloo / 1e9,
            "memcpy_gbps": memcpy / 1e9,
            "memcpy_capped": measured > ceiling,
            "cores": cores,
        },
        "lower_bound_linear_copy_seconds": max(s["bytes_inter_node"] / gloo + copied / linear, critical),
        # The same bound for an implementation that writes into freshly allocated /dev/shm
        # destination buffers (as ours and every baseline do): copies at the first-touch rate.
        "lower_bound_fresh_buffers_seconds": s["bytes_inter_node"] / gloo
        + copied / (min(cores, workers) * transport["memcpy_shm_cold_gbps"] * 1e9),
    }


def format_report(r: dict) -> str:
    if r.get("staged_only"):
        s = r.get("staged", {})
        return "\n".join(
            [
                f"{r['model']} ({r['model_bytes'] / 1e9:.2f} GB), staged update only, {r['workers']} actors on "
                f"{s.get('nodes', '?')} nodes, {r['machine']['cores']} cores; total {r['total_seconds']:.1f}s",
                *format_staged(s),
            ]
        )
    names = list(r["baselines"])
    lines = [
        f"{r['model']} ({r['model_bytes'] / 1e9:.2f} GB) on {r['workers']} actors, {r['nodes']} nodes, "
        f"{r['machine']['cores']} cores; medians of {r['repeats']} (ours) and {r['baseline_repeats']} "
        "(baselines) runs, seconds",
        f"{'direction':<44}{'ours':>8}{'bound':>8}{'ratio':>9}" + "".join(f"{n:>17}" for n in names),
    ]
    for d in r["directions"]:
        ok = all(d["verified"].values())
        lines.append(
            f"{d['src'] + ' -> ' + d['dst']:<44}{d['ours_seconds']:>8.3f}{d['lower_bound_seconds']:>8.3f}"
            f"{d['ratio_to_lower_bound']:>8.2f}x"
            + "".join(
                f"{d['baselines'][n]:>9.2f} ({d['speedup_vs'][n]:>4.1f}x)"
                if n in d["baselines"]
                else f"{'failed' if n in d.get('baselines_failed', {}) else 'skipped':>17}"
                for n in names
            )
            + ("" if ok else "  NOT VERIFIED")
        )
    t = r["transport"]
    lines.append(
        f"transport: gloo p2p {t['gloo_p2p_gbps']:.2f} GB/s, aggregate {t['gloo_aggregate_gbps']:.2f} GB/s; "
        f"memcpy 1 core {t['memcpy_1core_gbps']:.2f} GB/s, {t['memcpy_copiers']} at once "
        f"{t['memcpy_cores_gbps']:.2f} GB/s, all actors {t['memcpy_aggregate_gbps']:.2f} GB/s, "
        f"first touch {t['memcpy_shm_cold_gbps']:.2f} GB/s"
    )
    g = r["goals"]
    w = r["directions"][r["worst_direction"]]
    lines.append(
        f"worst direction {w['src']} -> {w['dst']}: {r['ratio_to_lower_bound']:.2f}x its lower bound; "
        f"goals: 5x faster than every baseline in every direction "
        f"{'met' if g['speedup_5x_vs_every_baseline'] else 'NOT met'}"
        + (f" (least: {min(r['speedup_vs'].values()):.1f}x)" if r["speedup_vs"] else "")
        + f"; within 1.5x of the lower bound {'met' if g['within_1_5x_of_lower_bound'] else 'NOT met'}"
    )
    verified = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["verified"].items())
    lines.append(
        f"verified: {verified}; "
        f"peak extra bytes per actor {r['peak_extra_bytes_per_actor'] / 1e6:.1f} MB; "
        f"bucket {r['bucket_bytes'] / MB:g} MiB; total {r['total_seconds']:.1f}s"
    )
    if r.get("resident"):
        res = r["resident"]
        lines.append(
            f"resident layouts (keep=, RL loop on the first transition): round trip "
            f"{res['without_keep_round_trip_median_seconds']:.3f}s without keep; "
            + "; ".join(
                f"{m} {res[m]['round_trip_median_seconds']:.3f}s (there {res[m]['there_median_seconds']:.3f}"
                f", back {res[m]['back_median_seconds']:.3f}), kept "
                f"{res[m]['kept_bytes_per_actor'] / 1e6:.1f} MB/actor"
                for m in ("in_place", "host")
            )
        )
    mem = r.get("memory", {})
    if mem.get("baselines"):
        lines.append(
            "baseline memory added to the node at its peak (largest over the directions; the largest "
            "estimate in parentheses): "
            + ", ".join(
                f"{n} +{m['peak_extra_bytes'] / 1e9:.2f} GB (+{m['estimate_bytes'] / 1e9:.2f})"
                for n, m in mem["baselines"].items()
            )
            + (
                f"; node peak {mem['peak_used_bytes'] / 1e9:.1f} of {mem['total_bytes'] / 1e9:.1f} GB"
                if "peak_used_bytes" in mem
                else ""
            )
        )
    for f in r.get("baseline_failures", []):
        d = r["directions"][f["direction"]]
        lines.append(f"baseline {f['baseline']} FAILED on {d['src']} -> {d['dst']}: {f['error'][:300]}")
    for k in r.get("baseline_skips", []):
        d = r["directions"][k["direction"]]
        lines.append(f"baseline {k['baseline']} on {d['src']} -> {d['dst']} {k['reason']}")
    if r.get("error"):
        lines.append(f"STOPPED EARLY after {len(r['directions'])} directions: {r['error'][:300]}")
    if "staged" in r:
        lines += format_staged(r["staged"])
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _loadavg() -> list[float]:
    """Other processes on the machine skew every number here; the report says how busy it was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


# -- verification -------------------------------------------------------------------------------


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()))


def _ctx_digests(ctx) -> dict[str, int]:
    return {slot: _crc(t) for slot, t in ctx.tensors.items()}


def _batched(group, ranks, method: str, *args, batch: int) -> list:
    """``method`` on the actors of ``ranks``, ``batch`` at a time (the same calls as the group's
    all-at-once helpers, with a bounded number of concurrent synthetic_box temporaries)."""
    import ray

    ranks, out = list(ranks), []
    for i in range(0, len(ranks), batch):
        out += ray.get([getattr(group.actors[r], method).remote(*args) for r in ranks[i : i + batch]])
    return out


def _digests_of_group(group) -> list[dict[str, int]]:
    return group.run(_ctx_digests, writes=False)


def _verify_baseline(group, how: str, seed: int, reference: list[dict[str, int]]) -> list[str]:
    return [
        f"rank {r} {slot}"
        for r, bad in enumerate(group.run(_verify_state, how, seed, reference, writes=False))
        for slot in bad
    ]


def _verify_state(ctx, how: str, seed: int, reference: list[dict[str, int]]) -> list[str]:
    state = _STATE.get("dst")
    if state is None:
        return ["<no destination buffers>"]
    store: ShardStore = state
    tensors = store.shard_tensors()
    if how == "digest":
        mine = {slot: _crc(t) for slot, t in tensors.items()}
        want = reference[ctx.rank]
        return sorted(s for s in set(mine) | set(want) if mine.get(s) != want.get(s))
    from realloc.shards.synthetic import synthetic_box

    spec = _STATE["spec"]
    bad = []
    for shard, local in (x for entries in store.by_param.values() for x in entries):
        ok = True
        for d, (n, m) in enumerate(zip(shard.sizes, shard.local_shape)):  # padding must be zero
            if m > n and local.narrow(d, n, m - n).count_nonzero().item():
                ok = False
        rows = shard.sizes[0]
        row = math.prod(shard.sizes[1:])
        step = max(1, (4 << 20) // max(1, row))
        for r0 in range(0, rows if shard.numel else 0, step):
            n = min(step, rows - r0)
            off = (shard.offsets[0] + r0,) + tuple(shard.offsets[1:])
            sizes = (n,) + tuple(shard.sizes[1:])
            want = synthetic_box(shard.param, spec.param(shard.param).shape, off, sizes, shard.dtype, seed)
            got = local[(slice(r0, r0 + n),) + tuple(slice(0, k) for k in shard.sizes[1:])]
            if not torch.equal(got, want):
                ok = False
                break
        if not ok:
            bad.append(shard.slot)
    return bad


def _drop_state(ctx) -> None:
    _STATE.clear()
    gc.collect()
    _malloc_trim()


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS: glibc keeps them, and a baseline's temporaries (full
    tensors, all-gather parts) piled up over 8 actors until Ray's memory monitor killed one.
    Between runs, outside every timing; a no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _new_dst_store(spec, dst: Topology, rank: int, vocab_pad_multiple: int) -> ShardStore:
    layout = Layout(spec, dst, vocab_pad_multiple)
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    _STATE.update(dst=store, spec=spec)
    return store


def _local_view(ctx, param: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
    for s in ctx.shards:
        if s.param == param and all(
            so <= o and o + n <= so + sn for o, n, so, sn in zip(offsets, sizes, s.offsets, s.sizes)
        ):
            local = ctx.tensors[s.slot]
            return local[tuple(slice(o - so, o - so + n) for o, so, n in zip(offsets, s.offsets, sizes))]
    raise KeyError(f"rank {ctx.rank} holds no box {offsets}+{sizes} of {param}")


def source_owners(layout: Layout) -> dict[str, list[tuple[int, tuple, tuple]]]:
    """Per parameter, its distinct source boxes and the lowest rank holding each (dp replica 0).

    Replicas (dp, replicated kv heads, a tied head's copy) are left out: each box is read once.
    """
    owners: dict[str, list[tuple[int, tuple, tuple]]] = {}
    seen = set()
    for rank in range(layout.topology.world_size):
        for s in layout.shards(rank):
            if s.numel and (s.param, s.offsets, s.sizes) not in seen:
                seen.add((s.param, s.offsets, s.sizes))
                owners.setdefault(s.param, []).append((rank, s.offsets, s.sizes))
    return owners


# -- memory: each baseline's peak, estimated before it runs and measured while it runs -------------

#: Ray's memory monitor kills a worker once the node's used memory (total - available) passes
#: this fraction of its total (``RAY_memory_usage_threshold``, Ray's default 0.95).
RAY_MEMORY_THRESHOLD_DEFAULT = 0.95
#: Kept free below the monitor's threshold when deciding whether a baseline fits: other processes
#: on the machine move while it runs, and the estimates are estimates.
MEMORY_MARGIN_BYTES = 1 << 30
#: How often the driver samples the node's memory (and, on a local Ray, each worker's RSS).
MEMORY_SAMPLE_SECONDS = 0.05


def ray_memory_threshold() -> float:
    """The fraction of the node's memory past which Ray's memory monitor kills workers."""
    try:
        value = float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD_DEFAULT))
    except ValueError:
        return RAY_MEMORY_THRESHOLD_DEFAULT
    return value if 0 < value <= 1 else RAY_MEMORY_THRESHOLD_DEFAULT


#: What the gather baseline's temporaries took beyond the model below (glibc keeps freed chunks
#: under its mmap threshold; gloo's buffers): on bench-1gb, 2026-11-24, 0-6% with 2 or 4 ranks
#: per replica, 18% with 8 (``dp=1,tp=2,pp=4 -> dp=2,tp=2,pp=2``: +12.58 GB, the node at 23.2 of
#: 25.3 GB, 0.8 GB short of Ray's memory monitor).
GATHER_HEAP_SLACK = 0.25


def baseline_memory_estimate(name: str, src: Layout, dst: Layout, nodes: int, store_resident: int = 0) -> dict:
    """The node memory ``name`` adds at its peak, moving ``src -> dst``, over what the node holds
    before it starts (the group's shards, Ray, the actors' own processes): ``{"bytes", "terms"}``.

    Every baseline writes a fresh set of destination buffers (``dst_bytes``, every rank's); on top
    (M = the model's bytes, P = the largest parameter's, W = the workers, all at once):

    * ``gather``: per parameter, each rank's padded send box, one part per rank of its replica,
      gloo's flat copy of those parts during the all-gather, then the full tensor beside the
      parts: the largest parameter's peak per rank, summed over the ranks, plus
      ``GATHER_HEAP_SLACK`` (``gather_temporaries_bytes``). On bench-1gb this is 4.7 GB before the
      slack from a ``dp=2,tp=2,pp=2`` source and 8.9 GB from ``dp=1,tp=2,pp=4`` (8 parts of 65 MB,
      twice, on each of 8 ranks).
    * ``broadcast``: every rank holds one full parameter at a time, the root a receive buffer and
      the owners a contiguous copy of their boxes beside it: 2 P W.
    * ``dcp``: the checkpoint in ``/dev/shm`` (each box once: M) and per rank one item read or
      cloned at a time (P W).
    * ``driver``: the full tensors assembled on the driver (M), and the object stores' pages:
      the fetched boxes in the sources' stores and in the driver's, the re-sliced objects in the
      driver's store and in each node's store the actors read them from, (2 + nodes) M. Ray's
      stores keep the pages they touched for the rest of the run, so only what exceeds
      ``store_resident`` (what earlier driver runs already touched) is new.
    """
    spec = src.spec
    workers = src.topology.world_size
    model = spec.total_bytes()
    largest = max(p.numel * TORCH_DTYPES[p.dtype].itemsize for p in spec.params)
    terms = {"dst_bytes": sum(dst.rank_bytes(r) for r in range(workers))}
    if name == "gather":
        peak = sum(_gather_temporaries(src, r) for r in range(workers))
        terms["gather_temporaries_bytes"] = int(peak * (1 + GATHER_HEAP_SLACK))
    elif name == "broadcast":
        terms["full_parameter_bytes"] = 2 * largest * workers
    elif name == "dcp":
        terms["checkpoint_bytes"] = model
        terms["items_bytes"] = largest * workers
    elif name == "driver":
        terms["driver_full_tensors_bytes"] = model
        terms["object_store_bytes"] = max(0, driver_store_bytes(model, nodes) - store_resident)
    else:
        raise ValueError(f"no memory model for baseline {name!r}")
    return {"bytes": sum(terms.values()), "terms": terms}


def driver_store_bytes(model_bytes: int, nodes: int) -> int:
    """The object-store pages the driver baseline touches (:func:`baseline_memory_estimate`)."""
    return (2 + nodes) * model_bytes


def _gather_temporaries(src: Layout, rank: int) -> int:
    """Bytes ``_gather_fn`` holds at once on ``rank`` for its largest parameter: the send box
    and the parts with gloo's flat output of the all-gather (``ProcessGroupGloo`` gathers into
    one flat tensor, then copies it into the parts), or the parts and the full tensor after it."""
    t = src.topology
    dp_rank = t.coords(rank)[0]
    replica = [r for r in range(t.world_size) if t.coords(r)[0] == dp_rank]
    boxes = [{s.param: s.numel for s in src.shards(r) if s.numel} for r in replica]
    worst = 0
    for p in src.spec.params:
        width = max(b.get(p.name, 0) for b in boxes)
        parts = width * len(replica)
        worst = max(worst, (width + parts + max(parts, p.numel)) * TORCH_DTYPES[p.dtype].itemsize)
    return worst


def memory_fit(
    estimate: int, available: int, total: int, threshold: float | None = None, margin: int = MEMORY_MARGIN_BYTES
) -> tuple[bool, int, str]:
    """Whether a baseline needing ``estimate`` more bytes fits: ``(fits, budget, reason)``.

    The budget is what the node can still take before Ray's memory monitor kills a worker (used
    memory past ``threshold`` of ``total``), less ``margin``: ``available - (1 - threshold) *
    total - margin``, with ``available`` as ``psutil.virtual_memory().available`` reports it (the
    monitor's own figure: used = total - available).
    """
    threshold = ray_memory_threshold() if threshold is None else threshold
    budget = int(available - (1 - threshold) * total - margin)
    if estimate <= budget:
        return True, budget, ""
    return (
        False,
        budget,
        (
            f"needs ~{estimate / 1e9:.1f} GB more at its peak, the node can take "
            f"{max(budget, 0) / 1e9:.1f} GB ({available / 1e9:.1f} GB available of "
            f"{total / 1e9:.1f}; Ray's memory monitor kills at {threshold:.0%} used; "
            f"{margin / 1e9:.1f} GB margin)"
        ),
    )


def decide_run(
    estimate: int,
    measured: list[int],
    repeats: int,
    available: int,
    total: int,
    threshold: float | None = None,
    margin: int = MEMORY_MARGIN_BYTES,
) -> tuple[bool, int, str]:
    """Whether the next run of a baseline goes ahead: ``(run, budget, reason)``.

    It needs ``estimate`` (:func:`baseline_memory_estimate`) or what its earlier runs in this
    direction took (``measured``, peak extra bytes each), whichever is more. When that does not
    fit (:func:`memory_fit`) the reason says ``skipped`` (no run yet) or ``stopped after k of
    repeats runs`` (the runs it had are its figures), and why.
    """
    fits, budget, why = memory_fit(max([estimate, *measured]), available, total, threshold, margin)
    if fits:
        return True, budget, ""
    done = f"stopped after {len(measured)} of {repeats} runs" if measured else "skipped"
    return False, budget, f"{done}: {why}"


class _MemorySampler:
    """A driver thread sampling the node's used memory (``total - available``, what Ray's memory
    monitor reads) every ``MEMORY_SAMPLE_SECONDS``, and each worker's RSS where the workers are
    local processes: the whole run's peak, and the peak of the current window (:meth:`window`)."""

    def __init__(self, pids: list[int] | None = None):
        import threading

        import psutil

        self._psutil, self._lock = psutil, threading.Lock()
        self._procs = []
        for pid in pids or ():
            with contextlib.suppress(psutil.Error):
                self._procs.append(psutil.Process(pid))
        self.local = pids is not None
        self.total = psutil.virtual_memory().total
        self.peak_used = 0
        self._window: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _MemorySampler:  # noqa: PYI034
        import threading

        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bench-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def used(self) -> int:
        return self.total - self._psutil.virtual_memory().available

    def set_pids(self, pids: list[int]) -> None:
        """The workers' processes to sample (after replacements)."""
        procs = []
        for pid in pids:
            with contextlib.suppress(self._psutil.Error):
                procs.append(self._psutil.Process(pid))
        with self._lock:
            self._procs = procs

    def _sample(self) -> None:
        used = self.used()
        private, largest = 0, 0
        for p in self._procs:
            with contextlib.suppress(self._psutil.Error):
                m = p.memory_info()
                private += m.rss - m.shared  # anonymous pages: /dev/shm mappings (shared) are in `used` once
                largest = max(largest, m.rss)
        with self._lock:
            self.peak_used = max(self.peak_used, used)
            w = self._window
            if w is not None:
                w["peak_used"] = max(w["peak_used"], used)
                w["workers_private_peak"] = max(w["workers_private_peak"], private)
                w["worker_rss_max"] = max(w["worker_rss_max"], largest)

    def _loop(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_SECONDS):
            with contextlib.suppress(Exception):  # a sample lost is not worth the run
                self._sample()

    @contextlib.contextmanager
    def window(self):
        """Yields a dict that, after the block, holds ``before_used``, ``peak_used``,
        ``peak_extra`` (peak - before), ``workers_private_peak`` (the workers' anonymous memory,
        summed over them, at its largest) and ``worker_rss_max`` (the largest worker's RSS, its
        /dev/shm mappings included); the last two are 0 without local workers."""
        w = {"before_used": self.used(), "workers_private_peak": 0, "worker_rss_max": 0}
        w["peak_used"] = w["before_used"]
        with self._lock:
            self._window = w
        try:
            yield w
        finally:
            self._sample()
            with self._lock:
                self._window = None
            w["peak_extra"] = w["peak_used"] - w["before_used"]


class _MemoryGuard:
    """What ``_direction`` needs to decide whether a baseline fits and to measure it: the
    sampler, whether the check applies (a local Ray: the node is this machine; ``check`` off or
    a cluster at ``--address``: every baseline runs), and the injected faults (``FAULT_ENV``)."""

    def __init__(
        self,
        sampler: _MemorySampler,
        checked: bool,
        faults: dict | None = None,
        threshold: float | None = None,
        margin: int = MEMORY_MARGIN_BYTES,
    ):
        self.sampler, self.checked, self.faults = sampler, checked, faults or {}
        self.store_resident = 0  # object-store pages the driver baseline has touched so far
        self.threshold = ray_memory_threshold() if threshold is None else threshold
        self.margin = margin

    def decide(self, estimate: int, measured: list[int], repeats: int) -> tuple[bool, int, str]:
        """:func:`decide_run` against the node's memory now."""
        import psutil

        vm = psutil.virtual_memory()
        return decide_run(estimate, measured, repeats, vm.available, vm.total, self.threshold, self.margin)

    def fault(self, name: str, direction: int) -> str | None:
        return self.faults.get((name, direction), self.faults.get((name, None)))

    def describe(self) -> dict:
        return {
            "checked": self.checked,
            "total_bytes": self.sampler.total,
            "ray_memory_usage_threshold": self.threshold,
            "margin_bytes": self.margin,
            "sample_seconds": MEMORY_SAMPLE_SECONDS,
        }


def _window_json(w: dict | None) -> dict:
    if not w or "peak_extra" not in w:
        return {}
    return {
        "before_used_bytes": w["before_used"],
        "peak_used_bytes": w["peak_used"],
        "peak_extra_bytes": w["peak_extra"],
        "workers_private_peak_bytes": w["workers_private_peak"],
        "worker_rss_max_bytes": w["worker_rss_max"],
    }


# -- a failing baseline: recorded, the group restored, the bench goes on ---------------------------

#: After a baseline failed, how long every worker gets to finish what it was running (a worker
#: still in a collective with a dead peer never does) before it is killed and replaced.
RECOVERY_GRACE_SECONDS = 30.0

#: Test hook: ``REALLOC_BENCH_FAULT="<baseline>:<raise|kill>[@<direction>],..."`` makes the first
#: run of that baseline (in that direction, by index in ``directions``; in every one without
#: ``@``) fail instead of running: ``raise`` raises in every worker, ``kill`` ends worker 1's
#: process (as Ray's memory monitor does). For the bench's tests; never set in a real run.
FAULT_ENV = "REALLOC_BENCH_FAULT"


def injected_faults(text: str | None = None) -> dict[tuple[str, int | None], str]:
    """``FAULT_ENV`` parsed: ``{(baseline, direction or None): kind}``."""
    text = os.environ.get(FAULT_ENV, "") if text is None else text
    out: dict[tuple[str, int | None], str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, what = part.partition(":")
        kind, at, index = what.partition("@")
        if name not in BASELINES or kind not in ("raise", "kill") or (at and not index.isdigit()):
            raise ValueError(f"{FAULT_ENV}: {part!r} is not '<baseline>:<raise|kill>[@<direction>]'")
        out[name, int(index) if at else None] = kind
    return out


def _fault_fn(ctx, kind: str) -> None:
    if kind == "kill" and ctx.rank == 1:
        os._exit(1)
    if kind == "raise":
        raise RuntimeError(f"injected fault ({FAULT_ENV}) on rank {ctx.rank}")


def _reset_default_group(ctx) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def recover_group(group, layouts: _Layouts, seed: int) -> dict:
    """After a baseline failed: every worker answers again (a dead one, or one still stuck after
    ``RECOVERY_GRACE_SECONDS``, e.g. in a collective with a dead peer, is killed and replaced),
    holds its shards of the group's layout (rewritten with the synthetic weights where replaced,
    then checked against the layout's recorded CRC32s), and the baselines' default process group
    is formed afresh. Raises when the group cannot be restored."""
    import ray

    t = time.perf_counter()
    refs = [a.run.remote(_drop_state, (), {}) for a in group.actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RECOVERY_GRACE_SECONDS)
    lost = []
    for r, ref in enumerate(refs):
        try:
            if ref not in ready:
                raise TimeoutError
            ray.get(ref)
        except (TimeoutError, ray.exceptions.RayError):
            lost.append(r)
    for r in lost:
        ray.kill(group.actors[r])
    # Wait until each lost worker fails a ping with a Ray error (an actor Ray's memory monitor
    # killed answers OutOfMemoryError, which actors.remote.DEATHS counts as dead), then have the
    # group replace the dead ranks.
    deadline = time.monotonic() + 60
    for r in lost:
        while True:
            try:
                ray.get(group.actors[r].ping.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayError:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {r} was killed but still answers after 60s")
            time.sleep(0.5)
    replaced = group.replace_dead_workers() if lost else []
    if replaced:
        group.init_synthetic(seed)
        if not layouts.check():
            raise RuntimeError(f"after replacing workers {replaced}: {layouts.failures[-1]}")
        group.run(_warm_imports, writes=False)
    group.run(_reset_default_group, writes=False)
    open_default_group(group)
    out = {"replaced_workers": replaced, "seconds": time.perf_counter() - t}
    _log(f"group restored in {out['seconds']:.1f}s (replaced workers: {replaced or 'none'})")
    return out


# -- the baselines' process group ---------------------------------------------------------------


def open_default_group(group) -> None:
    """torch's default process group in every worker, as a training framework creates it (the
    baselines and the probes use it; our transport never does: it has its own private group)."""
    addr, port = group.run(_free_address, writes=False)[0]
    group.run(_init_default_group, addr, port, group.num_workers, writes=False)


def _free_address(ctx) -> tuple[str, int]:
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def _init_default_group(ctx, addr: str, port: int, world_size: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if ctx.device.type == "cuda" else "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=ctx.rank,
            world_size=world_size,
        )


# -- transport and memcpy probes ----------------------------------------------------------------


def measure_transport(group, nbytes: int, cores: int, reps: int = 3) -> dict:
    """gloo p2p between ranks on different nodes, gloo all pairs across nodes, memcpy (one actor,
    ``cores`` actors at once, every actor at once)."""
    nodes = group.placement.nodes
    first = [r for r in range(len(nodes)) if nodes[r] == nodes[0]]
    other = [r for r in range(len(nodes)) if nodes[r] != nodes[0]]
    peer = other[0] if other else (first[1] if len(first) > 1 else None)
    pairs = list(zip(first, other)) if other else list(zip(first[::2], first[1::2]))
    copiers = list(range(max(1, min(cores, len(nodes)))))
    results = group.run(_probe, peer, pairs, copiers, nbytes, reps, writes=False)
    r0 = results[0]
    hosts = [info["ip"] for info in group.infos]
    p2p = results[peer]["gloo_p2p_seconds"] if peer is not None else None
    partners = sorted({r for pair in pairs for r in pair})
    return {
        "gloo_p2p_pair": [0, peer],
        "gloo_p2p_cross_node": bool(other),
        "probe_bytes": nbytes,
        "gloo_p2p_gbps": nbytes / p2p / 1e9 if p2p else 0.0,
        "gloo_aggregate_pairs": len(pairs),
        "gloo_aggregate_gbps": span_rate(results, hosts, "gloo_aggregate", partners) / 1e9,
        "memcpy_1core_gbps": nbytes / r0["memcpy_warm_seconds"] / 1e9,
        "memcpy_cold_gbps": nbytes / r0["memcpy_cold_seconds"] / 1e9,
        "memcpy_shm_cold_gbps": nbytes / r0["memcpy_shm_cold_seconds"] / 1e9,
        "memcpy_copiers": len(copiers),
        "memcpy_cores_gbps": span_rate(results, hosts, "memcpy_cores", copiers) / 1e9,
        "memcpy_aggregate_gbps": span_rate(results, hosts, "memcpy_aggregate", list(range(len(results)))) / 1e9,
        "barrier_seconds": r0["barrier_seconds"],
    }


def span_rate(results: list[dict], hosts: list[str], probe: str, ranks: list[int]) -> float:
    """Bytes per second of a probe several ranks ran at once: per repetition, each host's bytes
    over its span, from the first of its ranks starting to the last one finishing (ranks of one
    host read one clock; a rank descheduled before or during its part lengthens the span, as it
    lengthened the machine's work), summed over hosts; the best repetition.

    (Until this change each rank timed barrier -> work -> barrier less an empty barrier's time:
    on 8 processes sharing 2 cores a barrier's own time varies by milliseconds, and runs
    "measured" 68 and 87 GB/s of memcpy from two cores of 20.)"""
    reps = len(results[ranks[0]][f"{probe}_spans"])
    best = 0.0
    for k in range(reps):
        by_host: dict[str, list[tuple[float, float, int]]] = {}
        for r in ranks:
            start, end = results[r][f"{probe}_spans"][k]
            by_host.setdefault(hosts[r], []).append((start, end, results[r][f"{probe}_bytes"]))
        rate = sum(
            sum(n for _, _, n in spans) / max(max(e for _, e, _ in spans) - min(s for s, _, _ in spans), 1e-9)
            for spans in by_host.values()
        )
        best = max(best, rate)
    return best


def _probe(ctx, peer: int | None, pairs: list[tuple[int, int]], copiers: list[int], nbytes: int, reps: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    assert rank == ctx.rank, f"world rank {rank} != group rank {ctx.rank}"
    out: dict[str, Any] = {"gloo_p2p_seconds": None}
    # gloo p2p, rank 0 -> peer (receiver's clock), best of reps after a warm-up
    if rank in (0, peer):
        buf = torch.ones(nbytes, dtype=torch.uint8)
    best = math.inf
    for i in range(reps + 1 if peer is not None else 0):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf[: (nbytes if i else MB)], peer)
        elif rank == peer:
            dist.recv(buf[: (nbytes if i else MB)], 0)
        if i and rank == peer:
            best = min(best, time.perf_counter() - t)
    if rank == peer:
        out["gloo_p2p_seconds"] = best
    buf = None
    out["barrier_seconds"] = _barrier_seconds(reps)
    # gloo, every cross-node pair exchanging at once (both directions), as a reallocation does
    partner = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    chunk = max(MB, nbytes // 4)  # per actor, in every probe of several actors at once
    send = recv = None
    if rank in partner:
        send, recv = torch.ones(chunk, dtype=torch.uint8), torch.empty(chunk, dtype=torch.uint8)
        recv.fill_(0)

    def exchange() -> None:
        if rank in partner:
            for req in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, send, partner[rank]), dist.P2POp(dist.irecv, recv, partner[rank])]
            ):
                req.wait()

    out["gloo_aggregate_spans"] = _spans(exchange, reps)
    out["gloo_aggregate_bytes"] = chunk if rank in partner else 0  # sent (each pair moves 2 x chunk)
    send = recv = None
    # memcpy on one core (rank 0 alone): warm, into fresh anonymous memory, into a fresh /dev/shm file
    dist.barrier()
    if rank == 0:
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.zeros(nbytes, dtype=torch.uint8)
        out["memcpy_warm_seconds"] = min(_timed(lambda: b.copy_(a)) for _ in range(reps))
        b = None
        cold = []
        for _ in range(reps):
            c = torch.empty(nbytes, dtype=torch.uint8)
            cold.append(_timed(lambda: c.copy_(a)))
            c = None
        out["memcpy_cold_seconds"] = min(cold)
        cold = []
        for _ in range(reps):
            path = f"/dev/shm/realloc-bench-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                c = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                cold.append(_timed(lambda: c.copy_(a)))
                c = None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        out["memcpy_shm_cold_seconds"] = min(cold)
        a = None
    # memcpy on ``copiers`` (one actor per core) at once, then on every actor at once: the
    # machine's copy rate with its cores busy (it need not be cores x the one-core rate: they
    # share the memory bus), and with every actor competing for them (as in a reallocation)
    # Each copier of the first probe copies ``nbytes`` (a quarter would take ~3 ms on a core that
    # copies 20 GB/s, the order of a barrier's own noise on 8 processes sharing 2 cores: one run
    # "measured" 68 GB/s from 2 cores of 20 GB/s each).
    a = torch.ones(nbytes, dtype=torch.uint8) if rank in copiers else None
    b = torch.zeros(nbytes, dtype=torch.uint8) if rank in copiers else None
    out["memcpy_cores_bytes"] = nbytes if rank in copiers else 0
    out["memcpy_cores_spans"] = _spans(lambda: b.copy_(a) if rank in copiers else None, reps)
    a = torch.ones(chunk, dtype=torch.uint8)
    b = torch.zeros(chunk, dtype=torch.uint8)
    out["memcpy_aggregate_bytes"] = chunk
    out["memcpy_aggregate_spans"] = _spans(lambda: b.copy_(a), reps)
    dist.barrier()
    return out


def _barrier_seconds(reps: int) -> float:
    """Seconds of one barrier after another, best of ``reps``: what synchronising the actors
    costs on this machine (reported as ``barrier_seconds``)."""
    import torch.distributed as dist

    best = math.inf
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        dist.barrier()
        best = min(best, time.perf_counter() - t)
    return best


def _spans(fn, reps: int) -> list[tuple[float, float]]:
    """``reps`` times: a barrier, then ``fn`` timed on this rank's clock (``time.monotonic``, one
    clock per host); the driver combines the ranks' spans (:func:`span_rate`)."""
    import torch.distributed as dist

    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.monotonic()
        fn()
        out.append((start, time.monotonic()))
    dist.barrier()
    return out


def _warm_imports(ctx) -> None:
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec  # noqa: F401


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# -- baseline (a): through the driver -----------------------------------------------------------


def baseline_driver(group, dst: Topology) -> tuple[float, dict]:
    """Fetch dp replica 0's shards to the driver, assemble, re-slice, push per destination coordinate."""
    import ray

    spec, src = group.spec, group.topology
    vpm = group.vocab_pad_multiple
    dst_layout = Layout(spec, dst, vpm)
    replica0 = [r for r in range(group.num_workers) if src.coords(r)[0] == 0]
    started = time.perf_counter()
    fetched = ray.get([group.actors[r].run.remote(_export_boxes, (), {}) for r in replica0])
    t_fetch = time.perf_counter()
    full = {p.name: torch.empty(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in spec.params}
    for boxes in fetched:
        for param, offsets, sizes, array in boxes:
            full[param][box_index(offsets, sizes)] = _from_numpy(array, spec.param(param).dtype, sizes)
    fetched = None
    t_assemble = time.perf_counter()
    refs = {}
    for fsdp_rank, tp_rank, pp_rank in itertools.product(range(dst.fsdp), range(dst.tp), range(dst.pp)):
        shards = dst_layout.shards_at(tp_rank, pp_rank, fsdp_rank)
        refs[fsdp_rank, tp_rank, pp_rank] = ray.put(
            [
                (s.param, s.offsets, s.sizes, _to_numpy(full[s.param][box_index(s.offsets, s.sizes)]))
                for s in shards
                if s.numel
            ]
        )
    full = None
    t_put = time.perf_counter()
    group.run(_receive_boxes, [refs], spec, dst, vpm)
    done = time.perf_counter()
    refs = None
    return done - started, {
        "phases": {
            "fetch": t_fetch - started,
            "assemble": t_assemble - t_fetch,
            "slice_and_put": t_put - t_assemble,
            "actors_get_and_write": done - t_put,
        },
        "objects_put": dst.fsdp * dst.tp * dst.pp,
    }


def _to_numpy(t: torch.Tensor):
    """Contiguous bytes as a numpy array (Ray ships numpy out of band, zero-copy on read)."""
    return t.contiguous().view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.contiguous().numpy()


def _from_numpy(array, dtype: str, sizes) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # arrays from the object store are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(TORCH_DTYPES[dtype]).view(sizes)


def _export_boxes(ctx) -> list:
    return [
        (s.param, s.offsets, s.sizes, _to_numpy(_local_view(ctx, s.param, s.offsets, s.sizes)))
        for s in ctx.shards
        if s.numel
    ]


def _receive_boxes(ctx, refs: list[dict], spec, dst: Topology, vpm: int) -> None:
    import ray

    store = _new_dst_store(spec, dst, ctx.rank, vpm)
    _, fsdp_rank, tp_rank, pp_rank = dst.coords4(ctx.rank)
    for param, offsets, sizes, array in ray.get(refs[0][fsdp_rank, tp_rank, pp_rank]):
        store.write(param, offsets, sizes, _from_numpy(array, store_dtype(store, param), sizes))


def store_dtype(store: ShardStore, param: str) -> str:
    return store.by_param[param][0][0].dtype


# -- baseline (b): per-parameter gather + broadcast (OpenRLHF style) ----------------------------


def baseline_broadcast(group, dst: Topology) -> tuple[float, dict]:
    owners = source_owners(group.layout)
    started = time.perf_counter()
    group.run(_broadcast_fn, group.spec, owners, dst, group.vocab_pad_multiple)
    return time.perf_counter() - started, {"broadcast_bytes_per_rank": group.spec.total_bytes()}


def _broadcast_fn(ctx, spec, owners: dict, dst: Topology, vpm: int) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    assert rank == ctx.rank, f"world rank {rank} != group rank {ctx.rank}"
    store = _new_dst_store(spec, dst, rank, vpm)
    for p in spec.params:
        boxes = owners[p.name]
        root = boxes[0][0]
        full = torch.empty(p.shape, dtype=TORCH_DTYPES[p.dtype])
        if rank == root:
            requests, pending = [], []
            for r, offsets, sizes in boxes:
                if r == root:
                    full[box_index(offsets, sizes)].copy_(_local_view(ctx, p.name, offsets, sizes))
                    continue
                target = full[box_index(offsets, sizes)]
                into = target if target.is_contiguous() else torch.empty(sizes, dtype=full.dtype)
                requests.append(dist.irecv(into, r))
                if into is not target:
                    pending.append((target, into))
            for req in requests:
                req.wait()
            for target, into in pending:
                target.copy_(into)
        else:
            sends = [
                dist.isend(_local_view(ctx, p.name, offsets, sizes).contiguous(), root)
                for r, offsets, sizes in boxes
                if r == rank
            ]
            for req in sends:
                req.wait()
        dist.broadcast(full, root)
        for shard, _ in store.by_param.get(p.name, ()):
            if shard.numel:
                store.write(p.name, shard.offsets, shard.sizes, full[box_index(shard.offsets, shard.sizes)])


# -- baseline (d): per-parameter all-gather of the full tensor (veRL's FSDP path) ---------------


def baseline_gather(group, dst: Topology) -> tuple[float, dict]:
    """veRL's weight sync from a sharded trainer (``DTensor.full_tensor()`` per parameter):
    every rank all-gathers each full tensor over its replica, then slices its destination boxes."""
    started = time.perf_counter()
    group.run(_gather_fn, group.layout, dst)
    return time.perf_counter() - started, {"gathered_bytes_per_rank": group.spec.total_bytes()}


def _gather_fn(ctx, src: Layout, dst: Topology) -> None:
    import torch.distributed as dist

    spec, t = src.spec, src.topology
    replicas = [[r for r in range(t.world_size) if t.coords(r)[0] == d] for d in range(t.dp)]
    groups = [dist.new_group(ranks) for ranks in replicas] if t.dp > 1 else [None]  # every rank creates every group
    mine = next(i for i, ranks in enumerate(replicas) if ctx.rank in ranks)
    ranks, pg = replicas[mine], groups[mine]
    boxes = {r: {s.param: s for s in src.shards(r) if s.numel} for r in ranks}
    store = _new_dst_store(spec, dst, ctx.rank, src.vocab_pad_multiple)
    for p in spec.params:
        dtype = TORCH_DTYPES[p.dtype]
        width = max((boxes[r][p.name].numel if p.name in boxes[r] else 0) for r in ranks)
        send = torch.zeros(width, dtype=dtype)
        if p.name in boxes[ctx.rank]:
            s = boxes[ctx.rank][p.name]
            send[: s.numel].copy_(_local_view(ctx, p.name, s.offsets, s.sizes).reshape(-1))
        parts = [torch.empty(width, dtype=dtype) for _ in ranks]
        dist.all_gather(parts, send, group=pg)
        full = torch.empty(p.shape, dtype=dtype)
        for r, part in zip(ranks, parts):
            if p.name in boxes[r]:
                s = boxes[r][p.name]
                full[box_index(s.offsets, s.sizes)] = part[: s.numel].view(s.sizes)
        for shard, _ in store.by_param.get(p.name, ()):
            if shard.numel:
                store.write(p.name, shard.offsets, shard.sizes, full[box_index(shard.offsets, shard.sizes)])


# -- baseline (c): torch.distributed.checkpoint through /dev/shm --------------------------------


def baseline_dcp(group, dst: Topology) -> tuple[float, dict]:
    owners = source_owners(group.layout)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    path = os.path.join(base, f"realloc-bench-dcp-{uuid.uuid4().hex[:12]}")
    started = time.perf_counter()
    try:
        phases = group.run(
            _dcp_fn,
            group.spec,
            owners,
            source_owners(Layout(group.spec, dst, group.vocab_pad_multiple)),
            dst,
            group.vocab_pad_multiple,
            path,
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)  # the timed run removes it; this is for failures
    return time.perf_counter() - started, {"checkpoint_dir": base, "phases": phases[0]}


def _sharded(local: list[torch.Tensor], boxes: list[tuple[int, tuple, tuple]], shape, dtype, rank: int):
    """A ShardedTensor over ``boxes`` (``(rank, offsets, sizes)``, tiling the tensor exactly once)
    whose boxes placed on ``rank`` are ``local`` (in order).

    Built from metadata known everywhere (no collective per tensor). Replicas of a destination box
    are expressed by each replica naming itself as the box's holder in its own metadata: DCP plans
    a load from the local shards alone.
    """
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    metas = [ShardMetadata(list(offsets), list(sizes), f"rank:{r}/cpu") for r, offsets, sizes in boxes]
    mine = [m for (r, _, _), m in zip(boxes, metas) if r == rank]
    meta = ShardedTensorMetadata(metas, torch.Size(shape), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(t, m) for t, m in zip(local, mine)], meta, sharding_spec=EnumerableShardingSpec(metas)
    )


def _dcp_fn(ctx, spec, owners: dict, dst_owners: dict, dst: Topology, vpm: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    assert rank == ctx.rank, f"world rank {rank} != group rank {ctx.rank}"
    t0 = time.perf_counter()
    state = {}
    for p in spec.params:
        local = [_local_view(ctx, p.name, o, s) for r, o, s in owners[p.name] if r == rank]
        if local:
            state[p.name] = _sharded(local, owners[p.name], p.shape, TORCH_DTYPES[p.dtype], rank)
    dcp.save(state, checkpoint_id=path)
    state = None
    t1 = time.perf_counter()
    store = _new_dst_store(spec, dst, rank, vpm)
    target = {}
    for name, entries in store.by_param.items():
        p = spec.param(name)
        held = {(s.offsets, s.sizes): local[tuple(slice(0, n) for n in s.sizes)] for s, local in entries if s.numel}
        if held:
            boxes = [(rank if (o, s) in held else r, o, s) for r, o, s in dst_owners[name]]
            local = [held[o, s] for r, o, s in boxes if r == rank]
            target[name] = _sharded(local, boxes, p.shape, TORCH_DTYPES[p.dtype], rank)
    dcp.load(target, checkpoint_id=path)
    for entries in store.by_param.values():  # a param held twice on a rank (tied head) gets both copies
        for s, _ in entries[1:]:
            if s.numel:
                store.write(s.param, s.offsets, s.sizes, entries[0][1][tuple(slice(0, n) for n in s.sizes)])
    t2 = time.perf_counter()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"save": t1 - t0, "load": t2 - t1, "rm": time.perf_counter() - t2}


BASELINE_FNS = {
    "driver": baseline_driver,
    "broadcast": baseline_broadcast,
    "dcp": baseline_dcp,
    "gather": baseline_gather,
}
