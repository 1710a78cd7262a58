"""``realloc simulate``: a plan's steps on a model of a GPU cluster (realloc/sim).

Three uses:

* one move: ``realloc simulate --model llama-70b --src fsdp=64 --dst dp=8,tp=8 --cluster h100``
  (a reallocation on the same workers, or ``--dst-workers N`` for a copy into N other workers);
* the anchors: ``realloc simulate --anchors`` simulates the four published workloads of issue 26
  beside their receiver-NIC floor and the published number;
* the calibration: ``realloc simulate --bench bench.json`` predicts every move of a
  ``realloc bench --json`` run from the rates measured in that run, beside the measured seconds.

Pure: no Ray, no torch (it plans with realloc.plan and simulates with realloc.sim).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from realloc.layout import Layout, Topology
from realloc.plan import DEFAULT_BUCKET_BYTES, Placement, plan_reallocation
from realloc.plan.formats import conversion
from realloc.sim import PRESETS, Cluster, cluster_preset, simulate
from realloc.spec import load_spec
from realloc.spec.formats import check_weight_format

CONFIGS = Path(__file__).resolve().parents[2] / "tests" / "data" / "configs"


@dataclass(frozen=True)
class Anchor:
    """A published weight-transfer number and the workload it was measured on."""

    name: str
    config: str  # tests/data/configs file
    src: str
    dst: str
    cluster: str
    dst_workers: int | None  # a copy into that many other GPUs; None: the same GPUs change layout
    src_format: str | None
    dst_format: str | None
    published_seconds: str
    source: str


ANCHORS = (
    Anchor(
        "Kimi-K2 (1T) 256 training GPUs -> 128 inference GPUs",
        "Kimi-K2-Instruct.json",
        "pp=16,ep=16",
        "dp=8,tp=16",
        "h100",
        128,
        None,
        "fp8_block128",
        "1.3",
        "Perplexity, weight transfer for RL post-training (bf16 trainer -> fp8 inference; converted on the senders)",
    ),
    Anchor(
        "DeepSeek-V3 bf16 PP16xEP16 -> TP32xDP8 on 256 H100",
        "DeepSeek-V3.json",
        "pp=16,ep=16",
        "dp=8,tp=32",
        "h100",
        None,
        None,
        None,
        "2.39-2.83",
        "NeMo-RL refit",
    ),
    Anchor(
        "Qwen3-235B-A22B between 8 and 8 H100",
        "Qwen3-235B-A22B.json",
        "fsdp=8",
        "tp=8",
        "h100",
        8,
        None,
        None,
        "3.3",
        "vLLM sharded Ray Direct Transport",
    ),
    Anchor(
        "Kimi-K2 FP8 on 256 H20",
        "Kimi-K2-Instruct.json",
        "pp=16,ep=16",
        "dp=16,tp=16",
        "h20",
        None,
        "fp8_block128",
        "fp8_block128",
        "16",
        "checkpoint-engine (MoonshotAI): an FP8 checkpoint into 256 H20 inference GPUs",
    ),
)


def add_simulate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a plan's steps on a model of a GPU cluster (seconds, binding resource, idle NICs)",
        description="Plan a move and run its steps on a model of a cluster: per-GPU NVLink and NIC "
        "bandwidth each way, NICs per node, per-step and per-message latency, buckets in flight, "
        "host cost per route. Prints seconds, the binding resource, idle fractions, the slowest "
        "worker and the floors. --anchors: the published workloads of issue 26; --bench FILE: "
        "predict a 'realloc bench --json' run's moves from its measured rates.",
    )
    p.add_argument("--model", help="preset name or HF config.json")
    p.add_argument("--src", help="source layout, e.g. fsdp=64")
    p.add_argument("--dst", help="destination layout, e.g. dp=8,tp=8")
    p.add_argument(
        "--dst-workers",
        type=int,
        help="copy into this many other workers (a trainer -> generator copy); default: the same workers change layout",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="with --dst-workers: a fleet of this many replicas of --dst, each on --dst-workers workers "
        "(Fleet.stage: the trainer stages one, the staged replicas relay to the rest, doubling each round; "
        "reported beside the trainer staging every replica itself)",
    )
    p.add_argument("--src-weight-format", help="weight format of the source (e.g. fp8_block128)")
    p.add_argument("--weight-format", dest="dst_weight_format", help="weight format of the destination")
    p.add_argument("--cluster", help=f"preset: {', '.join(sorted(PRESETS))} (default h100)")
    p.add_argument("--cluster-json", help="a JSON file of Cluster fields (overrides --cluster)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change one cluster field, e.g. --set nic_gbps=22.5 (repeatable)",
    )
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help="bucket size in MiB")
    p.add_argument("--anchors", action="store_true", help="simulate the four published workloads of issue 26")
    p.add_argument("--bench", metavar="FILE", help="a 'realloc bench --json' output: predict each of its moves")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_simulate)


#: The options of one move (``--model`` ...) and of its cluster, as ``(flag, attribute)``:
#: ``--anchors`` and ``--bench`` bring their own moves and clusters, so they refuse these.
MOVE_OPTIONS = (
    ("--model", "model"),
    ("--src", "src"),
    ("--dst", "dst"),
    ("--dst-workers", "dst_workers"),
    ("--replicas", "replicas"),
    ("--src-weight-format", "src_weight_format"),
    ("--weight-format", "dst_weight_format"),
    ("--cluster", "cluster"),
    ("--cluster-json", "cluster_json"),
    ("--set", "set"),
)
#: What ``--bench FILE`` must hold: the keys of ``realloc bench --json`` that :func:`predict_bench` reads.
BENCH_KEYS = ("model", "workers", "nodes", "transport", "bucket_bytes", "directions")


def run_simulate(args: argparse.Namespace) -> int:
    bucket_bytes = int(args.bucket_mb * 2**20)
    if args.anchors and args.bench:
        raise ValueError("--anchors and --bench FILE do not go together: give one of them")
    use = "--anchors" if args.anchors else "--bench FILE" if args.bench else None
    given = [flag for flag, name in MOVE_OPTIONS if getattr(args, name) not in (None, [])]
    if use and given:
        raise ValueError(
            f"{use} does not go with {', '.join(given)}: {use} simulates its own moves on its own clusters "
            "(drop them, or drop it to simulate the one move they describe)"
        )
    if args.anchors:
        report: Any = {"anchors": [simulate_anchor(a, bucket_bytes) for a in ANCHORS]}
        text = format_anchors(report["anchors"])
    elif args.bench:
        report = predict_bench_file(args.bench)
        text = format_bench(report)
    else:
        if not (args.model and args.src and args.dst):
            raise ValueError("simulate needs --model, --src and --dst (or --anchors, or --bench FILE)")
        cluster = _cluster(args)
        plan, seconds = plan_move(
            load_spec(args.model),
            args.src,
            args.dst,
            cluster.gpus_per_node,
            args.dst_workers,
            args.src_weight_format,
            args.dst_weight_format,
            bucket_bytes,
        )
        report = {"src": args.src, "dst": args.dst, "plan_seconds": seconds, **simulate(plan, cluster).to_json()}
        report["cluster_fields"] = cluster.to_json()
        text = format_result(report)
        if args.replicas is not None:
            if args.dst_workers is None or isinstance(args.replicas, bool) or args.replicas < 1:
                raise ValueError(
                    f"--replicas {args.replicas}: a fleet needs --dst-workers (each replica's workers) and "
                    "one or more replicas"
                )
            relay, _ = plan_move(
                load_spec(args.model),
                args.dst,
                args.dst,
                cluster.gpus_per_node,
                args.dst_workers,
                args.dst_weight_format,
                args.dst_weight_format,
                bucket_bytes,
            )
            report["fleet"] = simulate_fleet(report, simulate(relay, cluster).to_json(), args.replicas)
            text += "\n" + format_fleet(report["fleet"])
    print(json.dumps(report) if args.json else text)
    return 0


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster and args.cluster_json:
        raise ValueError("--cluster and --cluster-json FILE do not go together: give one of them")
    if args.cluster_json:
        data = read_json_file(args.cluster_json, "--cluster-json")
        try:
            cluster = Cluster.from_json(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--cluster-json {args.cluster_json}: not a cluster: {exc}") from None
    else:
        cluster = cluster_preset(args.cluster or "h100")
    changes: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes FIELD=VALUE, got {item!r}")
        current = getattr(cluster, key.strip(), None)
        try:
            changes[key.strip()] = int(value) if isinstance(current, int) else float(value)
        except ValueError:
            raise ValueError(f"--set {key}: {value!r} is not a number") from None
    return cluster.replace(**changes) if changes else cluster


def plan_move(
    spec,
    src: str,
    dst: str,
    gpus_per_node: int,
    dst_workers: int | None = None,
    src_format: str | None = None,
    dst_format: str | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
):
    """The plan of a move (a reallocation, or a copy into ``dst_workers`` other workers), placed
    on nodes of ``gpus_per_node`` in rank order; returns ``(plan, planning seconds)``."""
    check_weight_format(src_format)
    check_weight_format(dst_format)
    started = time.perf_counter()
    s_top, d_top = Topology.parse(src), Topology.parse(dst)
    src_layout = Layout(spec, s_top, weight_format=src_format)
    dst_layout = Layout(spec, d_top, weight_format=dst_format)
    plan_src, plan_dst = conversion(src_layout, dst_layout).plan_sides(src_layout, dst_layout)
    n = s_top.world_size
    if dst_workers is None:
        placement = Placement.blocks(n, gpus_per_node)
        plan = plan_reallocation(plan_src.spec, plan_src, plan_dst, placement, bucket_bytes=bucket_bytes)
    else:
        if dst_workers != d_top.world_size:
            raise ValueError(f"--dst-workers {dst_workers} but --dst {dst} has {d_top.world_size} ranks")
        placement = Placement.blocks(n + dst_workers, gpus_per_node)
        plan = plan_reallocation(
            plan_src.spec,
            plan_src,
            plan_dst,
            placement,
            src_workers=list(range(n)),
            dst_workers=list(range(n, n + dst_workers)),
            bucket_bytes=bucket_bytes,
        )
    return plan, time.perf_counter() - started


def simulate_anchor(anchor: Anchor, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    cluster = cluster_preset(anchor.cluster)
    plan, seconds = plan_move(
        load_spec(str(CONFIGS / anchor.config)),
        anchor.src,
        anchor.dst,
        cluster.gpus_per_node,
        anchor.dst_workers,
        anchor.src_format,
        anchor.dst_format,
        bucket_bytes,
    )
    result = simulate(plan, cluster).to_json()
    return {
        "anchor": anchor.name,
        "src": anchor.src,
        "dst": anchor.dst,
        "dst_workers": anchor.dst_workers,
        "weight_formats": [anchor.src_format, anchor.dst_format],
        "published_seconds": anchor.published_seconds,
        "published_by": anchor.source,
        "plan_seconds": seconds,
        **result,
    }


def simulate_fleet(copy: dict, relay: dict, replicas: int) -> dict:
    """A fleet update of ``replicas`` replicas (actors/driver/fleet.py) from two simulated moves:
    ``copy`` (the trainer into one replica) and ``relay`` (one replica into another, in the
    replicas' layout and format). The trainer stages one replica, then every staged replica
    relays to one more per round, the rounds' relays side by side on disjoint nodes: ``copy +
    ceil(log2(replicas)) x relay`` seconds, the model once out of the trainer. Before, the trainer
    staged each replica in turn: ``replicas x copy`` seconds, ``replicas`` times its bytes. The
    floor: every replica takes the model in through its own NICs, all at once at best (the
    copy's receiver-NIC floor)."""
    rounds = math.ceil(math.log2(replicas)) if replicas > 1 else 0
    floor = copy["receiver_nic_floor_seconds"]
    after = copy["seconds"] + rounds * relay["seconds"]
    before = replicas * copy["seconds"]
    return {
        "replicas": replicas,
        "relay_rounds": rounds,
        "copy_seconds": copy["seconds"],
        "relay_seconds": relay["seconds"],
        "seconds": after,
        "seconds_trainer_sends_each": before,
        "receiver_nic_floor_seconds": floor,
        "ratio_to_receiver_nic_floor": after / floor if floor else None,
        "ratio_trainer_sends_each": before / floor if floor else None,
        "trainer_egress_bytes": copy["bytes_inter_node"],
        "trainer_egress_bytes_trainer_sends_each": replicas * copy["bytes_inter_node"],
        "relay_bytes_inter_node": (replicas - 1) * relay["bytes_inter_node"],
    }


def format_fleet(f: dict) -> str:
    ratio = f"{f['ratio_to_receiver_nic_floor']:.2f}x" if f["ratio_to_receiver_nic_floor"] else "-"
    before = f"{f['ratio_trainer_sends_each']:.2f}x" if f["ratio_trainer_sends_each"] else "-"
    return "\n".join(
        [
            f"fleet of {f['replicas']}: the trainer stages one replica ({f['copy_seconds']:.3f} s), then "
            f"{f['relay_rounds']} relay round(s) of {f['relay_seconds']:.3f} s",
            f"  simulated {f['seconds']:.3f} s ({ratio} the receiver-NIC floor {f['receiver_nic_floor_seconds']:.3f} s); "
            f"the trainer staging every replica: {f['seconds_trainer_sends_each']:.3f} s ({before})",
            f"  trainer egress {f['trainer_egress_bytes'] / 1e9:.2f} GB (staging every replica: "
            f"{f['trainer_egress_bytes_trainer_sends_each'] / 1e9:.2f} GB); between replicas "
            f"{f['relay_bytes_inter_node'] / 1e9:.2f} GB",
        ]
    )


def read_json_file(path: str, option: str) -> Any:
    """The JSON ``path`` holds; ``ValueError`` naming ``option`` when it is missing, not a file,
    unreadable or not JSON."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"{option} {path}: no such file")
    if not file.is_file():
        raise ValueError(f"{option} {path}: not a file (a JSON file is expected)")
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{option} {path}: cannot be read ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} {path}: not JSON ({exc})") from None


def predict_bench_file(path: str) -> dict:
    """:func:`predict_bench` of the ``realloc bench --json`` output in ``path``; ``ValueError``
    naming ``--bench`` and what is wrong when the file holds something else."""
    bench = read_json_file(path, "--bench")
    what = f"--bench {path}: not a 'realloc bench --json' output"
    if not isinstance(bench, dict):
        raise ValueError(f"{what} (a JSON object is expected, got {type(bench).__name__})")
    missing = [k for k in BENCH_KEYS if k not in bench]
    if missing:
        raise ValueError(f"{what} (it lacks {', '.join(missing)})")
    try:
        return predict_bench(bench)
    except KeyError as exc:
        raise ValueError(f"{what} (a move or its transport lacks {exc})") from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"{what} ({exc})") from None


def predict_bench(bench: dict) -> dict:
    """Every move of a ``realloc bench --json`` run, simulated on the machine its probes measured."""
    from realloc.spec import preset

    workers, nodes = bench["workers"], bench["nodes"]
    per_node = -(-workers // nodes)
    cluster = Cluster.from_bench(bench["transport"], per_node, bench.get("machine", {}).get("cores", 2))
    spec = preset(bench["model"])
    rows = []
    for d in bench["directions"]:
        plan, _ = plan_move(spec, d["src"], d["dst"], per_node, bucket_bytes=bench["bucket_bytes"])
        r = simulate(plan, cluster)
        measured = d["ours_seconds"]
        rows.append(
            {
                "src": d["src"],
                "dst": d["dst"],
                "measured_seconds": measured,
                "measured_runs": d["ours"]["seconds"],
                "predicted_seconds": r.seconds,
                "error": r.seconds / measured - 1,
                "binding": r.binding,
                "bench_lower_bound_seconds": d["lower_bound_seconds"],
                "plan_bytes_match": all(
                    d["plan"][k] == getattr(r, k) for k in ("bytes_inter_node", "bytes_intra_node", "bytes_local_copy")
                ),
            }
        )
    return {
        "cluster": cluster.to_json(),
        "workers": workers,
        "nodes": nodes,
        "moves": rows,
        "worst_error": max(abs(r["error"]) for r in rows) if rows else None,
    }


def format_result(r: dict) -> str:
    crit = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["critical_path"].items() if v)
    idle = ", ".join(f"{k} {v:.0%}" for k, v in r["idle"].items())
    w = r["slowest_worker"]
    floor = r["ratio_to_receiver_nic_floor"]
    return "\n".join(
        [
            f"{r['src']} -> {r['dst']} on {r['cluster']}: {r['workers']} workers, {r['nodes']} nodes, "
            f"{r['num_steps']} steps, {r['num_routes']} routes",
            f"  bytes: inter-node {r['bytes_inter_node'] / 1e9:.2f} GB, intra-node {r['bytes_intra_node'] / 1e9:.2f} GB, "
            f"local {r['bytes_local_copy'] / 1e9:.2f} GB",
            f"  simulated {r['seconds']:.3f} s (data plane {r['data_seconds']:.3f} s, driver {r['driver_seconds']:.3f} s); "
            f"binding: {r['binding']}",
            f"  receiver-NIC floor {r['receiver_nic_floor_seconds']:.3f} s"
            + (f" ({floor:.2f}x)" if floor else "")
            + f"; this schedule's paired floor {r['schedule_floor_seconds']:.3f} s; floors: "
            + ", ".join(f"{k} {v:.3f} s" for k, v in r["floors"].items()),
            f"  critical path ({r['critical_path_routes']} routes): {crit}",
            f"  idle: {idle}",
            f"  slowest worker {w['worker']} (node {w['node']}): ends at {w['finish_seconds']:.3f} s, busy "
            f"{w['busy_seconds']:.3f} s, {w['steps']} routes, {w['inter_node_bytes_received'] / 1e9:.2f} GB in over its NIC",
        ]
    )


def format_anchors(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out.append(f"{r['anchor']} (published {r['published_seconds']} s, {r['published_by']})")
        out.append(format_result(r))
    return "\n".join(out)


def format_bench(report: dict) -> str:
    lines = [f"{'move':<52}{'measured':>10}{'predicted':>11}{'error':>8}  binding"]
    for r in report["moves"]:
        lines.append(
            f"{r['src'] + ' -> ' + r['dst']:<52}{r['measured_seconds']:>10.3f}{r['predicted_seconds']:>11.3f}"
            f"{r['error']:>+8.0%}  {r['binding']}"
        )
    lines.append(f"worst error {report['worst_error']:+.0%}")
    return "\n".join(lines)
