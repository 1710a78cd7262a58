"""``realloc bench``'s command line: the parser, its checks, the entry points and the exit status."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys

from actors.trace import check_trace_path, write_chrome_trace
from realloc.layout import Layout, Topology
from realloc_tools.bench.common import BASELINES, DEFAULT_DST, DEFAULT_SRC, MB, log_line
from realloc_tools.bench.faults import injected_faults
from realloc_tools.bench.moves import bench
from realloc_tools.bench.report import format_report
from realloc_tools.bench.staged import STAGED_IDLE_CALLS
from realloc_tools.cluster import ray_for_command

#: ``--transitions all``: the RLHF default, a tp change, a pp change and a sharded (FSDP) source.
ALL_TRANSITIONS = (
    (DEFAULT_SRC, DEFAULT_DST),
    ("dp=4,tp=2", "tp=8"),
    (DEFAULT_SRC, "dp=1,tp=2,pp=4"),
    ("fsdp=8", "dp=4,tp=2"),
)


#: ``--staged-layouts``: the trainer's layout and the generator's, each on half the bench's 8 actors.
DEFAULT_STAGED = "dp=2,tp=2->tp=4"


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
        "--fleet",
        type=int,
        metavar="R",
        help="run the fleet measurement alone: R replica groups updated by Fleet.stage (relayed: the trainer "
        "sends once) beside the trainer staging each replica in turn and trainer.copy_to(replicas) "
        "(realloc_tools/bench/fleet.py)",
    )
    p.add_argument(
        "--fleet-layouts",
        default="dp=2->tp=2",
        help="the fleet measurement's 'trainer->replica' layouts (default dp=2->tp=2)",
    )
    p.add_argument(
        "--weight-format",
        help="run the weight-format measurement alone: the trainer (--src) copied into a generator "
        "(--dst) in its own format, then in this one (e.g. fp8_block128; realloc_tools/format_bench.py)",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="run the vLLM measurement alone: a trainer group updating a real vLLM engine with realloc's "
        "backend beside vLLM's reload_weights path (realloc_tools/bench/vllm.py; needs vLLM)",
    )
    p.add_argument(
        "--vllm-trainer",
        action="store_true",
        help="run the vLLM trainer-side measurement alone: an FSDP2 trainer in plain Ray actors updating a real "
        "vLLM engine with realloc's trainer engine beside vLLM's ModuleSource (full gather) path and vLLM's nccl "
        "protocol over gloo (gloo_bcast, our stand-in) (realloc_tools/bench/vllm_trainer.py; needs vLLM)",
    )
    p.add_argument("--trainer-world", type=int, default=2, help="--vllm-trainer: the trainer's ranks (default 2)")
    p.add_argument("--vllm-tp", type=int, default=2, help="the vLLM engine's tensor parallel size (default 2)")
    p.add_argument(
        "--vllm-size", default="small", help="the vLLM measurement's Llama: tiny or small (default small, 236 MiB)"
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


def parse_staged(text: str, option: str = "--staged-layouts") -> tuple[Topology, Topology]:
    """``--staged-layouts`` (or ``option``): ``'trainer->generator'`` (two groups, each on actors of its own)."""
    a, sep, b = text.partition("->")
    if not sep or not a.strip() or not b.strip():
        raise ValueError(f"{option}: {text!r} is not 'trainer->generator' (e.g. '{DEFAULT_STAGED}')")
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
    from realloc.spec import load_spec

    if args.trace is not None and (args.delta or args.weight_format is not None):
        raise ValueError("--trace traces the transitions' moves; it does not go with --delta or --weight-format")
    if args.vllm or args.vllm_trainer:
        return run_vllm_bench(args)
    if args.delta:
        return run_delta_bench(args)
    if args.fleet is not None:
        return run_fleet_bench(args)
    if args.weight_format is not None:
        return run_format_bench(args)
    spec = load_spec(args.model)
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
        log_line(f"trace of {len(traces)} moves written to {args.trace}")
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return exit_status(report, args.strict)


def run_delta_bench(args: argparse.Namespace) -> int:
    """``--delta``: the per-step table of delta copies beside full ones; exit 1 unless every
    generator ended bit-exact."""
    from realloc.spec import load_spec
    from realloc_tools.bench.delta import format_rows, measure

    specs = [load_spec(m.strip()) for m in args.delta_models.split(",") if m.strip()]
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
            log_line(f"delta bench on {where}")
            for spec in specs:
                rows += measure(spec, lrs, args.delta_steps, int(args.bucket_mb * MB), log=log_line)
    if args.json:
        print(json.dumps({"delta": rows}))
    else:
        print(format_rows(rows))
    return 0 if all(r["exact"] for r in rows) else 1


def run_fleet_bench(args: argparse.Namespace) -> int:
    """``--fleet R``: a relayed fleet update beside the trainer staging each replica; exit 1 unless
    every replica ended bit-exact after every update."""
    from realloc.spec import load_spec
    from realloc_tools.bench.fleet import format_rows, measure

    if isinstance(args.fleet, bool) or args.fleet < 1:
        raise ValueError(f"--fleet must be at least 1 replica, got {args.fleet}")
    spec = load_spec(args.model)
    layouts = parse_staged(args.fleet_layouts, "--fleet-layouts")
    for t in layouts:
        t.check(spec)
    check_run_args(args)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        with ray_for_command(args.address, args.nodes, 8) as where:
            log_line(f"fleet bench on {where}")
            rows = measure(spec, args.fleet, layouts, int(args.bucket_mb * MB), args.repeats, log=log_line)
    print(json.dumps({"fleet": rows}) if args.json else format_rows(rows))
    return 0 if all(r["exact"] for r in rows) else 1


def run_vllm_bench(args: argparse.Namespace) -> int:
    """``--vllm``: realloc's vLLM backend beside vLLM's ``reload_weights``; ``--vllm-trainer``: realloc's
    trainer engine in an FSDP2 trainer beside vLLM's full-gather source and vLLM's nccl protocol over
    gloo (our stand-in). Exit 1 unless the engines' outputs after every method were identical on the
    same weights."""
    from realloc_tools.bench import vllm, vllm_trainer
    from realloc_tools.cluster import ray_for_command

    if args.vllm and args.vllm_trainer:
        raise ValueError("--vllm and --vllm-trainer are two measurements: run one at a time")
    if args.vllm_size not in vllm.SIZES:
        raise ValueError(f"--vllm-size must be one of {sorted(vllm.SIZES)}, got {args.vllm_size!r}")
    if args.vllm_tp not in (1, 2, 4, 8):
        raise ValueError(f"--vllm-tp must be 1, 2, 4 or 8, got {args.vllm_tp}")
    if args.trainer_world not in (1, 2, 4, 8):
        raise ValueError(f"--trainer-world must be 1, 2, 4 or 8, got {args.trainer_world}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    try:
        import vllm as _  # noqa: F401
    except ImportError as err:
        raise ValueError(f"--vllm needs vLLM (pip install -e '.[vllm]'): {err}") from None
    key = "vllm_trainer" if args.vllm_trainer else "vllm"
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        with ray_for_command(args.address, 1, 4) as where:
            log_line(f"{key} bench on {where}")
            if args.vllm_trainer:
                report = vllm_trainer.measure(args.vllm_size, args.vllm_tp, args.trainer_world, args.repeats, log_line)
            else:
                report = vllm.measure(args.vllm_size, args.vllm_tp, args.repeats, log_line)
    formatted = vllm_trainer.format_report(report) if args.vllm_trainer else vllm.format_report(report)
    print(json.dumps({key: report}) if args.json else formatted)
    return 0 if report["exact"] else 1


def run_format_bench(args: argparse.Namespace) -> int:
    """``--weight-format``: the trainer copied into a generator of its own format and of the given
    one, wire bytes and seconds side by side; exit 1 unless every generator shard verified."""
    from realloc.spec import load_spec
    from realloc.spec.formats import check_weight_format
    from realloc_tools.bench.formats import format_rows, measure
    from realloc_tools.cluster import ray_for_command

    check_weight_format(args.weight_format)
    spec = load_spec(args.model)
    ((src, dst),) = parse_transitions(None, args.src or DEFAULT_SRC, args.dst or DEFAULT_DST)
    Layout(spec, src)
    Layout(spec, dst, weight_format=args.weight_format)  # the engine's block rule, before Ray starts
    if args.repeats < 1 or args.nodes < 1:
        raise ValueError(f"--repeats and --nodes must be at least 1, got {args.repeats}, {args.nodes}")
    cpus = -(-(src.world_size + dst.world_size) // args.nodes)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        with ray_for_command(args.address, args.nodes, cpus) as where:
            log_line(f"weight-format bench on {where}")
            rows = measure(
                spec, src, dst, args.weight_format, args.repeats, int(args.bucket_mb * MB), args.seed, log_line
            )
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
