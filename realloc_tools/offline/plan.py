"""The pure commands of the ``realloc`` command line: ``plan`` and ``presets``.

Each subcommand is registered by an ``add_<name>_parser(subparsers)`` function that sets
``func`` (called with the parsed arguments, returns the exit status). This module never imports
Ray or the ``actors`` package: the ``realloc`` console script is ``realloc_tools.cli``, which builds the
parser here with its Ray-backed commands (``demo``, ``bench``, ``ckpt-demo``) as
``build_parser(extra=[...])`` and runs it with :func:`run`, importing them only for commands
other than ``plan`` and ``presets``. ``python -m realloc_tools.offline.plan`` has the pure commands only.
``realloc plan`` has to start fast: it imports torch only for ``--verify``.

Exit status: 0 success, 1 ``--verify`` found a mismatch, 2 invalid input (one line
``realloc: error: <message>`` on stderr) or a usage error.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from realloc._checks import check_choice, check_finite, check_positive
from realloc.boxes import box_index
from realloc.layout import Layout, Topology
from realloc.layout.conventions import EXPERT_ORDERS
from realloc.plan import DEFAULT_BUCKET_BYTES, Bandwidths, Placement, plan_reallocation
from realloc.plan.formats import Conversion, conversion
from realloc.plan.slices import shipping_stats
from realloc.spec import VOCAB_PAD_RULES, ModelSpec, load_spec, preset, preset_names
from realloc.spec.formats import FP8, WEIGHT_FORMATS, check_weight_format, scale_name, unformatted
from realloc_tools.offline.simulate import add_simulate_parser
from realloc_tools.offline.units import decimal_size

if TYPE_CHECKING:
    from realloc.plan import Plan

PROG = "realloc"
#: Subcommands defined in this module; ``realloc_tools.cli`` loads its Ray-side commands for any other word.
BUILTIN_COMMANDS = ("plan", "presets", "simulate")
#: ``--verify`` materialises the model about once per rank (full tensors, source and destination
#: shards); beyond this it would swap rather than check anything.
VERIFY_LIMIT_BYTES = 2 << 30
#: Per-rank and per-node tables, left out of ``--json`` unless ``--full-stats`` (huge at 16k ranks).
_TABLE_STATS = ("node_egress_bytes", "node_ingress_bytes", "rank_send_bytes", "rank_recv_bytes")


#: Registers one subcommand on an argparse subparsers object (see :func:`build_parser`).
AddParser = Callable[[Any], None]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pure command line (``plan``, ``presets``) and return its exit status.

    Example:
        >>> main(["plan", "--model", "tiny", "--src", "tp=2", "--dst", "dp=2", "--json"])  # doctest: +ELLIPSIS
        {"model": "tiny", ...}
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv`` with ``parser`` and call the chosen command's ``func``.

    Returns its exit status; argparse's own exits (help: 0, usage error: 2) become return values,
    and a ``ValueError`` becomes status 2 with one line ``realloc: error: <message>`` on stderr.
    """
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed help (status 0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def build_parser(extra: Sequence[AddParser] = ()) -> argparse.ArgumentParser:
    """The argument parser with the built-in subcommands, then one more per ``extra`` function.

    Example:
        >>> build_parser().parse_args(["presets", "--json"]).json
        True
    """
    parser = argparse.ArgumentParser(
        prog=PROG, description="Plan and run parameter reallocation between 3D-parallel layouts."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_plan_parser(subparsers)
    add_presets_parser(subparsers)
    add_simulate_parser(subparsers)
    for add_parser in extra:
        add_parser(subparsers)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option), if any.

    Example:
        >>> command_of(["--help"]), command_of(["plan", "--json"])
        (None, 'plan')
    """
    return next((a for a in argv if not a.startswith("-")), None)


# -- realloc plan ---------------------------------------------------------------------------


def add_plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan a reallocation between two layouts and print its statistics",
        description="Plan moving a model from one dp/tp/pp(/ep) layout to another on the same workers "
        "(filled into nodes in rank order) and print the plan's statistics.",
    )
    p.add_argument("--model", required=True, help="preset name (see 'realloc presets'), config.json or its directory")
    p.add_argument("--src", required=True, help="source layout, e.g. dp=2,tp=4,pp=2 or ep=8,tp=1 (expert parallelism)")
    p.add_argument("--dst", required=True, help="destination layout, e.g. dp=8,tp=2,pp=1")
    p.add_argument("--gpus-per-node", type=int, default=8, help="workers per node (default 8)")
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help=f"bucket size in MiB (default {DEFAULT_BUCKET_BYTES >> 20})",
    )
    p.add_argument(
        "--intra-gbps",
        type=float,
        default=Bandwidths().intra_node / 1e9,
        help="intra-node bandwidth in GB/s for the time estimate (default %(default)g)",
    )
    p.add_argument(
        "--inter-gbps",
        type=float,
        default=Bandwidths().inter_node / 1e9,
        help="inter-node bandwidth in GB/s per worker for the time estimate (default %(default)g)",
    )
    p.add_argument(
        "--vocab-pad-multiple",
        type=int,
        default=1,
        help="pad vocabulary shards to a multiple of this times tp (default 1)",
    )
    p.add_argument(
        "--vocab-pad-rule",
        default=VOCAB_PAD_RULES[0],
        help=f"how the padded vocabulary is split: {' or '.join(VOCAB_PAD_RULES)} (default "
        "%(default)s: pad to a multiple of --vocab-pad-multiple times tp; vllm: pad to a multiple "
        "of --vocab-pad-multiple, e.g. 64, then split over tp)",
    )
    for side in ("src", "dst"):
        p.add_argument(
            f"--{side}-expert-order",
            default=EXPERT_ORDERS[0],
            help=f"buffer order of the {side} layout's routed experts: {' or '.join(EXPERT_ORDERS)} "
            "(default %(default)s; vllm: FusedMoE's w13_weight/w2_weight; hf_stacked: transformers 5's "
            "gate_up_proj/down_proj, also under fsdp and zero3; torchtitan: its w1/w2/w3 stacks, with fsdp and ep)",
        )
    for side in ("src", "dst"):
        p.add_argument(
            f"--{side}-weight-format",
            help=f"the weight format the {side} layout holds: {', '.join(WEIGHT_FORMATS)} (default: the "
            "model's dtypes; realloc/spec/formats.py)",
        )
    p.add_argument("--weight-format", dest="dst_weight_format", help="the same as --dst-weight-format")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--full-stats", action="store_true", help="with --json, include per-node and per-rank byte tables")
    p.add_argument(
        "--slices",
        action="store_true",
        help="also cut and pickle every worker's slice of the plan, as the driver ships them, and report their "
        "sizes and times (seconds more at thousands of ranks)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="execute the plan in-process on random weights and check every destination shard (small models only)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of --verify's weights (default 0)")
    p.add_argument(
        "--svg",
        metavar="FILE",
        help="also write a picture of the plan: workers grouped by node, the bytes between and inside nodes "
        "(an SVG file; realloc_tools/offline/svg.py)",
    )
    p.add_argument(
        "--svg-view",
        default="auto",
        help="what --svg draws: workers (every worker, an arrow per node pair; small plans), matrix (node-by-node "
        "bytes, nodes grouped when there are many) or auto (workers when the plan is small; default)",
    )
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """``realloc plan``: returns 0, or 1 when ``--verify`` finds a wrong shard."""
    spec = load_spec(args.model)
    src = _topology(args.src, "--src")
    dst = _topology(args.dst, "--dst")
    if src.world_size != dst.world_size:
        raise ValueError(
            f"--src {src} has {src.world_size} ranks but --dst {dst} has {dst.world_size}; "
            "a reallocation keeps the same workers, so both must have the same dp*tp*pp"
        )
    bucket_bytes = _bucket_bytes(args.bucket_mb)
    bandwidths = Bandwidths(
        intra_node=_gbps(args.intra_gbps, "--intra-gbps"), inter_node=_gbps(args.inter_gbps, "--inter-gbps")
    )
    check_positive("--gpus-per-node", args.gpus_per_node)
    check_positive("--vocab-pad-multiple", args.vocab_pad_multiple)
    check_choice("--vocab-pad-rule", args.vocab_pad_rule, VOCAB_PAD_RULES)
    check_choice("--src-expert-order", args.src_expert_order, EXPERT_ORDERS)
    check_choice("--dst-expert-order", args.dst_expert_order, EXPERT_ORDERS)
    check_weight_format(args.src_weight_format)
    check_weight_format(args.dst_weight_format)
    placement = Placement.blocks(src.world_size, args.gpus_per_node)
    svg_path = None
    if args.svg is not None:
        from realloc_tools.offline.svg import VIEWS, check_svg_path

        check_choice("--svg-view", args.svg_view, VIEWS)
        svg_path = check_svg_path(args.svg)
    elif args.svg_view != "auto":
        raise ValueError(f"--svg-view {args.svg_view} needs --svg FILE (the picture it chooses the view of)")
    if args.verify:
        _check_verify_size(spec, src.world_size)

    # Planning 16k ranks allocates millions of small acyclic objects; the cyclic collector
    # rescanning them would add about a third to the planning time.
    gc.disable()
    try:
        started = time.perf_counter()
        src_layout = _layout(
            spec,
            src,
            args.vocab_pad_multiple,
            "--src",
            args.vocab_pad_rule,
            args.src_expert_order,
            args.src_weight_format,
        )
        dst_layout = _layout(
            spec,
            dst,
            args.vocab_pad_multiple,
            "--dst",
            args.vocab_pad_rule,
            args.dst_expert_order,
            args.dst_weight_format,
        )
        conv = conversion(src_layout, dst_layout)
        plan_src, plan_dst = conv.plan_sides(src_layout, dst_layout)
        plan = plan_reallocation(
            plan_src.spec, plan_src, plan_dst, placement, bucket_bytes=bucket_bytes, bandwidths=bandwidths
        )
        plan_seconds = time.perf_counter() - started
    finally:
        gc.enable()

    report = plan_report(spec, src, dst, placement, plan, plan_seconds, full=args.full_stats)
    if args.slices:
        report["slices"] = shipping_stats(plan)
    if conv.where is not None:
        report["weight_formats"] = [args.src_weight_format, args.dst_weight_format]
        report["conversion"] = {"where": conv.where, "reason": conv.reason}
    if args.verify:
        report.update(verify_plan(src_layout, dst_layout, plan, seed=args.seed, conv=conv))
    if svg_path is not None:
        from realloc_tools.offline.svg import plan_svg, write_atomic

        title = f"{spec.name}: {src} → {dst}, {placement.per_node()} workers per node"
        started = time.perf_counter()
        text = plan_svg(plan, title=title, view=args.svg_view)
        report["svg"] = {
            "path": str(svg_path),
            "bytes": write_atomic(svg_path, text),
            "seconds": time.perf_counter() - started,
        }
    if args.json:
        print(json.dumps(report))
    else:
        print(format_summary(report))
    return 0 if report.get("verified", True) else 1


def _topology(text: str, option: str) -> Topology:
    try:
        return Topology.parse(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def _layout(
    spec: ModelSpec,
    topology: Topology,
    vocab_pad_multiple: int,
    option: str,
    vocab_pad_rule: str = VOCAB_PAD_RULES[0],
    expert_order: str = EXPERT_ORDERS[0],
    weight_format: str | None = None,
) -> Layout:
    try:
        return Layout(
            spec, topology, vocab_pad_multiple, vocab_pad_rule, expert_order=expert_order, weight_format=weight_format
        )
    except ValueError as exc:
        raise ValueError(f"{option} {topology}: {exc}") from None


def _bucket_bytes(mib: float) -> int:
    check_finite("--bucket-mb", mib, minimum=1 / 1024, allowed="a number of MiB of at least 1/1024 (1 KiB)")
    return int(mib * 2**20)


def _gbps(value: float, option: str) -> float:
    return check_finite(option, value, positive=True, allowed="a positive number of GB/s") * 1e9


def plan_report(
    spec: ModelSpec,
    src: Topology,
    dst: Topology,
    placement: Placement,
    plan: "Plan",
    plan_seconds: float,
    *,
    full: bool = False,
) -> dict[str, Any]:
    """The JSON-ready statistics of a plan (per-node/per-rank tables only when ``full``)."""
    stats = {k: v for k, v in plan.stats.items() if full or k not in _TABLE_STATS}
    return {
        "model": spec.name,
        "model_parameters": sum(p.numel for p in spec.params if not p.buffer),  # buffers move but do not count
        "model_bytes": spec.total_bytes(),
        "src": str(src),
        "dst": str(dst),
        "world_size": src.world_size,
        "num_nodes": placement.num_nodes,
        "gpus_per_node": placement.per_node(),
        "bucket_bytes": plan.bucket_bytes,
        "plan_seconds": plan_seconds,
        **stats,
    }


def format_summary(report: dict[str, Any]) -> str:
    """Human-readable lines of a :func:`plan_report` (plus ``verified`` when present)."""
    bw = report["bandwidths"]
    lines = [
        (
            "model",
            f"{report['model']} ({report['model_parameters']:,} parameters, {decimal_size(report['model_bytes'])})",
        ),
        ("source", report["src"]),
        ("destination", report["dst"]),
        ("ranks", f"{report['world_size']} on {report['num_nodes']} nodes ({report['gpus_per_node']} per node)"),
        (
            "bytes moved",
            f"{decimal_size(report['bytes_total'])} (intra-node {decimal_size(report['bytes_intra_node'])}, "
            f"inter-node {decimal_size(report['bytes_inter_node'])})",
        ),
        ("inter-node lower bound", decimal_size(report["lower_bound_inter_node_bytes"])),
        ("local copies", decimal_size(report["bytes_local_copy"])),
        ("max node egress", decimal_size(report["max_node_egress_bytes"])),
        ("max node ingress", decimal_size(report["max_node_ingress_bytes"])),
        (
            "steps",
            f"{report['num_steps']} ({report['num_routes']} routes, {report['num_buckets']} buckets "
            f"of at most {report['bucket_bytes'] / 2**20:g} MiB)",
        ),
        (
            "estimated time",
            f"{report['estimated_seconds']:.3g} s at {bw['intra_node'] / 1e9:g} GB/s intra-node, "
            f"{bw['inter_node'] / 1e9:g} GB/s inter-node",
        ),
        ("plan time", f"{report['plan_seconds']:.3f} s"),
    ]
    sl = report.get("slices")
    if sl:
        lines.append(
            (
                "per-worker slices",
                f"largest {decimal_size(sl['max_bytes'])} ({sl['max_routes']} routes; whole plan "
                f"{decimal_size(sl['plan_pickle_bytes'])}), cut in {sl['slice_seconds']:.3f} s, pickled in "
                f"{sl['pickle_seconds']:.3f} s, prepared by its worker in {sl['prepare_seconds']:.3f} s",
            )
        )
    if "conversion" in report:
        lines.append(
            ("weight formats", f"{report['conversion']['reason']} (converted on the {report['conversion']['where']})")
        )
    if "svg" in report:
        svg = report["svg"]
        lines.append(("picture", f"{svg['path']} ({decimal_size(svg['bytes'])}, drawn in {svg['seconds']:.2f} s)"))
    if "verified" in report:
        lines.append(
            (
                "verified",
                "yes"
                if report["verified"]
                else f"NO: {report['mismatched_shards']} shards differ, e.g. {report['mismatches']}",
            )
        )
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


# -- --verify -------------------------------------------------------------------------------


def _check_verify_size(spec: ModelSpec, world_size: int) -> None:
    need = spec.total_bytes() * world_size
    if need > VERIFY_LIMIT_BYTES:
        raise ValueError(
            f"--verify would hold about {need / 2**30:.1f} GiB ({spec.name} is {spec.total_bytes():,} bytes "
            f"x {world_size} ranks); the limit is {VERIFY_LIMIT_BYTES / 2**30:g} GiB: use a smaller model "
            "(e.g. --model tiny) or fewer ranks"
        )


def verify_plan(
    src_layout: Layout, dst_layout: Layout, plan: "Plan", *, seed: int = 0, conv: "Conversion | None" = None
) -> dict[str, Any]:
    """Execute ``plan`` in-process on seeded random weights and compare every destination shard
    (and its padding, which must stay zero) bit for bit with the slice of the full tensors it should hold.

    Between weight formats (``conv``: :func:`realloc.plan.formats.conversion` of the two layouts,
    whose ``plan_sides`` ``plan`` moves between) the ranks convert as the workers do
    (:func:`realloc.shards.convert.convert_rank` on the senders before the plan, or on the
    receivers after it), and the expected destination is built from the full tensors with the
    project's quantizer (:func:`expected_full`): an FP8 weight is ``quantize_blocks`` of the
    full weight as the source holds it, its ``_scale_inv`` the scales of that call; an FP8
    source dequantized is ``dequantize_blocks`` of its full values and scales.

    Example:
        >>> from realloc import ModelSpec, Topology, plan_reallocation
        >>> spec = ModelSpec.preset("tiny")
        >>> a, b = Layout(spec, Topology(tp=2)), Layout(spec, Topology(dp=2))
        >>> verify_plan(a, b, plan_reallocation(spec, a, b, Placement.blocks(2, 1)))["verified"]
        True
    """
    import torch  # lazily, as the executor below: only --verify needs torch, `realloc plan` starts without it

    from realloc.shards import ShardStore, allocate_buffers, local_executor
    from realloc.shards.convert import convert_rank

    conv = conversion(src_layout, dst_layout) if conv is None else conv
    base = _random_weights(unformatted(src_layout.spec), seed)
    held = held_full(base, src_layout.spec)  # the source's tensors in its format
    world = src_layout.topology.world_size

    def stores(layout: Layout, tensors: dict | None = None) -> dict:
        out = {r: ShardStore(layout.shards(r), allocate_buffers(layout, r)) for r in range(world)}
        for store in out.values() if tensors is not None else ():
            for entries in store.by_param.values():
                for shard, local in entries:
                    local[_slices(shard.sizes)].copy_(tensors[shard.param][box_index(shard.offsets, shard.sizes)])
        return out

    src = stores(src_layout, held)
    dst = stores(dst_layout)
    if conv.where == "source":  # the senders convert into the wire layout, then the plan moves it
        wire = stores(conv.wire)
        for r in range(world):
            convert_rank(src_layout, conv.wire, r, src[r], wire[r])
        moved = local_executor.execute_in_process(plan, wire, dst)
    elif conv.where == "destination":  # the plan moves into the wire layout, the receivers convert
        wire = stores(conv.wire)
        moved = local_executor.execute_in_process(plan, src, wire)
        for r in range(world):
            convert_rank(conv.wire, dst_layout, r, wire[r], dst[r])
    else:
        moved = local_executor.execute_in_process(plan, src, dst)

    want = expected_full(held, src_layout.spec, dst_layout.spec)
    mismatches: list[str] = []
    for rank, store in dst.items():
        for entries in store.by_param.values():
            for shard, local in entries:
                expected = torch.zeros_like(local)
                expected[_slices(shard.sizes)] = want[shard.param][box_index(shard.offsets, shard.sizes)]
                if not torch.equal(_bits(local), _bits(expected)):
                    mismatches.append(f"rank {rank} {shard.slot}")
    return {
        "verified": not mismatches,
        "verified_shards": sum(len(e) for s in dst.values() for e in s.by_param.values()),
        "mismatched_shards": len(mismatches),
        "mismatches": mismatches[:5],
        "executed_bytes_moved": moved["bytes_moved"],
    }


def held_full(base: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The full tensors a layout of ``spec`` (a :func:`realloc.spec.formats.formatted` spec, or the
    model's own) holds, from the model's full tensors ``base``: an FP8 weight as
    :func:`realloc.shards.convert.quantize_blocks` of the whole weight (vLLM's
    ``per_block_cast_to_fp8``) with its block scales as ``<weight>_scale_inv``, every other tensor
    cast to its dtype."""
    from realloc.shards import TORCH_DTYPES
    from realloc.shards.convert import quantize_blocks

    out: dict[str, Any] = {}
    for p in spec.params:
        if p.name in out:
            continue  # a scale, written with its weight
        if p.dtype == FP8:
            out[p.name], out[scale_name(p.name)] = quantize_blocks(base[p.name])
        else:
            out[p.name] = base[p.name].to(TORCH_DTYPES[p.dtype])
    return out


def expected_full(held: dict[str, Any], src_spec: ModelSpec, dst_spec: ModelSpec) -> dict[str, Any]:
    """The full tensors the destination must hold after a move from a layout of ``src_spec``
    holding ``held`` (:func:`held_full`) into a layout of ``dst_spec``: FP8 kept as it is (its
    scales with it), FP8 made from another dtype by :func:`~realloc.shards.convert.quantize_blocks`
    of the source's values, FP8 made into another dtype by
    :func:`~realloc.shards.convert.dequantize_blocks` (DeepSeek-V3's ``weight_dequant``), casts by
    ``Tensor.to``."""
    from realloc.shards import TORCH_DTYPES
    from realloc.shards.convert import dequantize_blocks, quantize_blocks

    have = {p.name: p.dtype for p in src_spec.params}
    out: dict[str, Any] = {}
    for p in dst_spec.params:
        if p.name in out:
            continue
        value = held[p.name]
        if p.dtype == FP8:
            if have[p.name] == FP8:
                out[p.name], out[scale_name(p.name)] = value, held[scale_name(p.name)]
            else:
                out[p.name], out[scale_name(p.name)] = quantize_blocks(value)
        elif have[p.name] == FP8:
            out[p.name] = dequantize_blocks(value, held[scale_name(p.name)], TORCH_DTYPES[p.dtype])
        else:
            out[p.name] = value.to(TORCH_DTYPES[p.dtype])
    return out


def _bits(t: Any) -> Any:
    """``t``'s bytes (float8 has no ``torch.equal`` on CPU; bitwise is what --verify promises)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def _random_weights(spec: ModelSpec, seed: int) -> dict[str, "Any"]:
    import torch  # lazily: only --verify needs torch (see verify_plan)

    from realloc.shards import TORCH_DTYPES

    generator = torch.Generator().manual_seed(seed)
    full = {}
    for p in spec.params:
        dtype = TORCH_DTYPES[p.dtype]
        if dtype.is_floating_point:
            full[p.name] = torch.randn(p.shape, generator=generator).to(dtype)
        else:
            info = torch.iinfo(dtype)
            full[p.name] = torch.randint(info.min, info.max + 1, p.shape, generator=generator, dtype=dtype)
    return full


def _slices(sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in sizes)


# -- realloc presets ------------------------------------------------------------------------


def add_presets_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "presets", help="list the named model presets", description="List the named model presets with their sizes."
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_presets)


def run_presets(args: argparse.Namespace) -> int:
    """``realloc presets``: one row (or JSON entry) per preset."""
    rows = []
    for name in preset_names():
        spec = preset(name)
        rows.append(
            {
                "name": name,
                "parameters": sum(p.numel for p in spec.params),
                "bytes": spec.total_bytes(),
                "layers": spec.num_layers,
                "heads": spec.num_heads,
                "kv_heads": spec.num_kv_heads,
                "dtypes": spec.dtypes(),
            }
        )
    if args.json:
        print(json.dumps({"presets": rows}))
        return 0
    print(f"{'preset':<14}{'parameters':>16}{'bytes':>18}{'layers':>8}{'heads':>7}{'kv':>5}  dtypes")
    for r in rows:
        print(
            f"{r['name']:<14}{r['parameters']:>16,}{r['bytes']:>18,}{r['layers']:>8}{r['heads']:>7}"
            f"{r['kv_heads']:>5}  {','.join(r['dtypes'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
