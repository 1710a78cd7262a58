"""``realloc bench-scale``: one move between two layouts that grow with the world, on 8 to 64
Ray actors (issue 26, item 2: "runs with many workers").

For each worker count ``N`` of ``--workers`` it starts a local Ray with ``N / --nodes-of``
simulated nodes (real raylets on this machine, ``--nodes-of`` CPU slots each), creates a
:class:`~actors.driver.group.ModelGroup` of a tiny model on ``N`` workers in ``--src`` (``*`` stands for
what fills the world: ``tp=2,pp=2,dp=*`` is ``dp=N/4``), fills it with synthetic weights and
moves it ``--src -> --dst -> --src ...``, verifying every worker's shards bit-exact after every
move (``ModelGroup.verify_synthetic``). Per move it records:

* the driver's wall time around ``reallocate`` and the driver process's CPU time over it
  (``time.process_time``: planning, shipping the plan, Ray calls and their replies);
* what ``reallocate`` returned (:class:`~actors.driver.group.ReallocStats`: bytes by link kind, plan
  seconds, the slowest worker's own seconds);
* per worker, the point-to-point messages and bytes it sent and received
  (:func:`actors.communicator.traffic` before and after, read with ``group.run``): ``data``
  (the plan's transfers) and ``control`` (zero-copy handles, fan-out readiness);
* what the driver put into Ray's object store for the workers during the move (every
  ``ray.put``, sized after the move with Ray's own serializer): the largest object is the most a
  worker fetched (every worker fetches one plan object per move at most).

The first move of each direction plans and ships its plan (the first one also forms the
workers' process group); the ``--repeats`` round trips after them reuse both (the workers cache
the plan), as an RL loop alternating two layouts does. The report gives both.

Memory: after the group started, the node's used memory over what it used before Ray, and each
worker process's USS, PSS and RSS (``/proc/<pid>/smaps_rollup``), so the table says what one
actor costs and whether 64 fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from typing import Any, Iterator, Sequence

import psutil
import ray

from realloc._checks import check_finite, check_nonneg
from realloc.layout import Topology
from realloc.progress import Progress, write
from realloc_tools.cluster import ray_for_command

DEFAULT_WORKERS = "8,16,32,64"
DEFAULT_SRC = "tp=2,pp=2,dp=*"
DEFAULT_DST = "tp=2,dp=*"
MB = 1 << 20


def add_bench_scale_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-scale",
        help="time moves on 8 to 64 Ray actors on simulated nodes: driver time, messages and bytes per worker",
        description="For each worker count, start simulated nodes and a group of a tiny model, move it between "
        "two layouts that scale with the world and back, verify every shard after every move, and report the "
        "driver's wall and CPU time per move, per-worker messages and bytes, the plan bytes shipped per worker, "
        "and what one actor costs in memory.",
    )
    p.add_argument("--workers", default=DEFAULT_WORKERS, help="comma-separated worker counts (default %(default)s)")
    p.add_argument("--model", default="tiny", help="preset or HF config.json (default: tiny, 0.8 MB)")
    for flag, default in (("--src", DEFAULT_SRC), ("--dst", DEFAULT_DST)):
        p.add_argument(flag, default=default, help="layout; '*' is what fills the world (default %(default)s)")
    for flag, kind, default, what in (
        ("--nodes-of", int, 8, "workers per simulated node"),
        ("--repeats", int, 3, "round trips after the first two moves (their plans cached)"),
        ("--cpus-per-worker", float, 1.0, "CPU slots per worker bundle"),
        ("--timeout-s", float, 600.0, "the group's timeout_s"),
        ("--seed", int, 0, "seed of the synthetic weights"),
    ):
        p.add_argument(flag, type=kind, default=default, help=f"{what} (default %(default)s)")
    p.add_argument(
        "--zero-copy",
        action="store_true",
        help="let same-node workers read each other's buffers (default: off, so every byte that leaves a "
        "worker travels as a message over the transport, as between GPUs of different hosts)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run_bench_scale)


def scaled(text: str, workers: int) -> Topology:
    """``text`` with ``*`` replaced by what makes the topology ``workers`` ranks (``tp=2,dp=*``)."""
    if text.count("*") != 1:
        raise ValueError(f"layout {text!r} must have exactly one '*' (the dimension that fills the world)")
    fixed = Topology.parse(text.replace("*", "1")).world_size
    if workers % fixed:
        raise ValueError(f"layout {text!r}: {workers} workers are not a multiple of {fixed}")
    return Topology.parse(text.replace("*", str(workers // fixed)))


def parse_workers(text: str, nodes_of: int) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"--workers must be positive counts like 8,16,32,64, got {text!r}")
    if nodes_of < 1 or any(n % nodes_of for n in counts):
        raise ValueError(f"--nodes-of {nodes_of} must divide every worker count of {counts}")
    return counts


def check_scale_args(args: argparse.Namespace) -> None:
    """The numeric options, checked before any Ray starts (``ValueError`` naming the option)."""
    check_finite("--timeout-s", args.timeout_s, positive=True, allowed="a positive number of seconds")
    check_finite("--cpus-per-worker", args.cpus_per_worker, positive=True, allowed="a positive number of CPU slots")
    check_nonneg("--repeats", args.repeats)


def run_bench_scale(args: argparse.Namespace) -> int:
    from realloc.spec import load_spec

    check_scale_args(args)
    spec = load_spec(args.model)
    counts = parse_workers(args.workers, args.nodes_of)
    for n in counts:
        for option, text in (("--src", args.src), ("--dst", args.dst)):
            try:
                scaled(text, n).check(spec)
            except ValueError as exc:
                raise ValueError(f"{option} {text} on {n} workers: {exc}") from None
    runs = []
    per_count = 2 + 2 * args.repeats
    moves = Progress(
        log, f"bench-scale: {len(counts)} worker counts, {per_count} moves each", len(counts) * per_count, "move"
    )
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext(), moves:
        for n in counts:
            _log(f"{n} workers on {n // args.nodes_of} simulated nodes ...")
            runs.append(
                scale_run(
                    spec,
                    n,
                    args.nodes_of,
                    args.src,
                    args.dst,
                    repeats=args.repeats,
                    cpus_per_worker=args.cpus_per_worker,
                    timeout_s=args.timeout_s,
                    seed=args.seed,
                    zero_copy=args.zero_copy,
                    progress=moves,
                )
            )
    report = {
        "command": "realloc " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench-scale"] else None,
        "model": spec.name,
        "model_bytes": spec.total_bytes(),
        "src": args.src,
        "dst": args.dst,
        "nodes_of": args.nodes_of,
        "zero_copy": args.zero_copy,
        "machine": {"cpus": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total},
        "runs": runs,
        "growth": growth(runs),
    }
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if all(r["verified"] for r in runs) else 1


log = logging.getLogger(__name__)


def _log(msg: str) -> None:
    write(f"[bench-scale {time.strftime('%H:%M:%S')}] {msg}")  # above the progress bar, if one is shown


# -- one worker count ----------------------------------------------------------------------------


def scale_run(
    spec,
    workers: int,
    nodes_of: int,
    src_text: str,
    dst_text: str,
    *,
    repeats: int = 3,
    cpus_per_worker: float = 1.0,
    timeout_s: float = 600.0,
    seed: int = 0,
    zero_copy: bool = False,
    address: str | None = None,
    progress: Progress | None = None,
) -> dict:
    """Start Ray (unless ``address``), a group of ``workers``, the moves (each counted on
    ``progress``); returns the run's record."""
    from actors.driver.group import ModelGroup

    src, dst = scaled(src_text, workers), scaled(dst_text, workers)
    nodes = workers // nodes_of
    used_before, load_before = psutil.virtual_memory().used, psutil.getloadavg()
    cluster = (
        contextlib.nullcontext(f"attached to {address}")
        if address == "current"
        else ray_for_command(address, nodes, max(1, round(nodes_of * cpus_per_worker)))
    )
    with cluster as where:
        t0 = time.perf_counter()
        group = ModelGroup.create(
            spec,
            src,
            name=f"scale{workers}",
            cpus_per_worker=cpus_per_worker,
            timeout_s=timeout_s,
            zero_copy=zero_copy,
        )
        try:
            start_s = time.perf_counter() - t0
            group.init_synthetic(seed)
            memory = actor_memory([info["pid"] for info in group.infos])
            memory["node_used_bytes_over_before"] = psutil.virtual_memory().used - used_before
            moves = []
            for i in range(2 + 2 * repeats):
                target = dst if i % 2 == 0 else src
                moves.append(timed_move(group, target, seed))
                _log(f"  {workers} workers: move {i + 1} {moves[-1]['transition']}: {moves[-1]['wall_s']:.3f} s")
                if progress is not None:
                    progress.advance()
            memory["loadavg_before"] = list(load_before)
            return summarise(workers, nodes, where, src, dst, start_s, memory, moves)
        finally:
            group.shutdown()
            _log(f"  {workers} workers: group shut down")


def timed_move(group, target: Topology, seed: int) -> dict:
    """One ``reallocate`` with the driver's wall and CPU time, the workers' messages and bytes, the
    objects the driver put for the workers, and the verification afterwards (untimed)."""
    before = worker_traffic(group)
    with counting_puts() as puts:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        stats = group.reallocate(target)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    after = worker_traffic(group)
    traced = time.perf_counter()
    trace = group.last_trace()  # the move's timeline, gathered from every worker (untimed above)
    trace_s = time.perf_counter() - traced
    bad = group.verify_synthetic(seed)
    sizes = [serialized_bytes(v) for v in puts]
    per_worker = [traffic_delta(a, b) for a, b in zip(before, after)]
    return {
        "transition": stats.transition,
        "wall_s": wall,
        "driver_cpu_s": cpu,
        "plan_s": stats.plan_seconds,
        "workers_s": stats.seconds,
        "bytes": {"local": stats.bytes_local, "intra": stats.bytes_intra_node, "inter": stats.bytes_inter_node},
        "shipped_objects": len(sizes),
        "shipped_max_bytes": max(sizes, default=0),
        "shipped_total_bytes": sum(sizes),
        "per_worker": per_worker,
        "trace_gather_s": trace_s,
        "trace_json_bytes": len(json.dumps(trace.chrome())),
        "trace_steps": len(trace.steps()),
        "slowest_worker": stats.slowest_worker,
        "slowest_phase": stats.slowest_phase,
        "verified": not bad,
        "mismatches": {str(r): v[:5] for r, v in bad.items()},
    }


@contextlib.contextmanager
def counting_puts() -> Iterator[list]:
    """Collect every value the driver ``ray.put``s meanwhile (sized afterwards, off the clock)."""
    values: list = []
    original = ray.put

    def put(value, *args, **kwargs):
        values.append(value)
        return original(value, *args, **kwargs)

    ray.put = put
    try:
        yield values
    finally:
        ray.put = original


def serialized_bytes(value: Any) -> int:
    """What ``ray.put(value)`` stores: Ray's own serialization of it, out-of-band buffers included."""
    context = ray._private.worker.global_worker.get_serialization_context()
    return context.serialize(value).total_bytes


def _read_traffic(ctx) -> dict:
    from actors.wire.communicator import traffic

    return traffic()


def worker_traffic(group) -> list[dict]:
    return group.run(_read_traffic, writes=False)


def traffic_delta(before: dict, after: dict) -> dict:
    """Messages and bytes one worker sent and received between two readings, by kind."""
    out = {}
    for direction in ("sent", "received"):
        for kind in ("data", "control"):
            b, a = before[direction][kind], after[direction][kind]
            out[f"{direction}_{kind}_messages"] = a[0] - b[0]
            out[f"{direction}_{kind}_bytes"] = a[1] - b[1]
    out["messages"] = sum(v for k, v in out.items() if k.endswith("_messages"))
    out["bytes"] = out["sent_data_bytes"] + out["received_data_bytes"]
    return out


def actor_memory(pids: Sequence[int]) -> dict:
    """Mean and largest USS / PSS / RSS of the worker processes (``/proc/<pid>/smaps_rollup``)."""
    rows = [smaps_rollup(pid) for pid in pids]
    out: dict[str, Any] = {"workers": len(rows)}
    for key in ("uss", "pss", "rss"):
        values = [r[key] for r in rows]
        out[f"{key}_mean_bytes"] = int(statistics.mean(values))
        out[f"{key}_max_bytes"] = max(values)
    return out


def smaps_rollup(pid: int) -> dict[str, int]:
    """``uss`` (private clean + dirty), ``pss`` and ``rss`` of a process in bytes."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "pss": fields.get("Pss", 0),
        "rss": fields.get("Rss", 0),
    }


# -- the same move without actors: what the plan and the driver's shipping code say ---------------


def plan_reference(spec, src_text: str, dst_text: str, workers: int, nodes_of: int) -> dict:
    """Per direction (``there``: src -> dst, ``back``), for ``workers`` placed ``nodes_of`` a node
    without starting any: each worker's data messages (every route's buckets, one message at each
    end: what the workers post without zero-copy reads), a bound on its control messages (one
    fan-out readiness message per peer it notifies or waits for), and the largest object the
    driver's own shipping code (``actors.driver.protocol.worker_plan_refs``) puts for a worker. Needs
    Ray initialised (the shipping code ``ray.put``s)."""
    from realloc.layout import Layout
    from realloc.plan import DEFAULT_BUCKET_BYTES, Placement, plan_reallocation

    a, b = Layout(spec, scaled(src_text, workers)), Layout(spec, scaled(dst_text, workers))
    placement = Placement.blocks(workers, nodes_of)
    out = {}
    for way, (x, y) in (("there", (a, b)), ("back", (b, a))):
        plan = plan_reallocation(spec, x, y, placement, bucket_bytes=DEFAULT_BUCKET_BYTES)
        out[way] = {**plan_messages(plan, workers), "shipped_max_bytes": shipped_bytes(plan, x, y, placement)}
    return out


def plan_messages(plan, workers: int) -> dict:
    """Each worker's data messages in ``plan`` (every route's buckets, one message at each end:
    what the workers post without zero-copy reads) and a bound on any worker's control messages
    (one fan-out readiness message per peer it forwards to or from)."""
    messages = [0] * workers
    peers: list[set] = [set() for _ in range(workers)]
    for step, s, d, seg in plan.routes():
        n = len(plan.buckets(seg))
        messages[s] += n
        messages[d] += n
        if step >= plan.forward_from:
            peers[s].add(d)
            peers[d].add(s)
    return {"data_messages": messages, "control_bound": max(len(p) for p in peers)}


class _World:
    """The little of a world the driver's shipping code reads (an id, a rank per actor)."""

    def __init__(self, workers: int):
        self.id = f"reference-{workers}"

    @staticmethod
    def rank_of(actor: int) -> int:
        return actor


def shipped_bytes(plan, src, dst, placement) -> int:
    """The largest object ``actors.driver.protocol.worker_plan_refs`` puts for one worker of ``plan``."""
    from actors.driver import protocol

    n = placement.num_workers
    with counting_puts() as puts:
        protocol.worker_plan_refs(
            plan,
            _World(n),
            list(range(n)),
            [src.at(r) for r in range(n)],
            [dst.at(r) for r in range(n)],
            placement,
            [False] * n,
        )
    return max(serialized_bytes(v) for v in puts)


# -- summaries -----------------------------------------------------------------------------------


def summarise(workers, nodes, where, src, dst, start_s, memory, moves) -> dict:
    """A run's record: the first move of each direction (plan shipped), the cached ones after."""
    first, cached = moves[:2], moves[2:]
    steady = cached or first

    def per_worker(move_list, key):
        values = [w[key] for m in move_list for w in m["per_worker"]]
        return {"mean": statistics.mean(values), "max": max(values)}

    return {
        "workers": workers,
        "nodes": nodes,
        "cluster": where,
        "src": str(src),
        "dst": str(dst),
        "start_s": start_s,
        "memory": memory,
        "first_move": first[0],
        "second_move": first[1] if len(first) > 1 else None,
        "cached_moves": len(cached),
        "cached_wall_s": statistics.median(m["wall_s"] for m in steady),
        "cached_driver_cpu_s": statistics.median(m["driver_cpu_s"] for m in steady),
        "shipped_per_worker_max_bytes": max(m["shipped_max_bytes"] for m in moves),
        "shipped_objects_per_move": max(m["shipped_objects"] for m in moves),
        # src -> dst sends; dst -> src (a generation layout back to training) is every byte a local copy
        "messages_per_worker": per_worker(moves[0::2], "messages"),
        "data_bytes_per_worker": per_worker(moves[0::2], "bytes"),
        "return_messages_per_worker": per_worker(moves[1::2], "messages"),
        "trace_gather_s": statistics.median(m["trace_gather_s"] for m in moves),
        "trace_json_max_bytes": max(m["trace_json_bytes"] for m in moves),
        "moves": [{k: v for k, v in m.items() if k != "per_worker"} for m in moves],
        "verified": all(m["verified"] for m in moves),
    }


def growth(runs: list[dict]) -> dict | None:
    """From the smallest run to the largest: how each quantity grew, against the workers' growth."""
    if len(runs) < 2:
        return None
    a, b = runs[0], runs[-1]

    def ratio(get) -> float | None:
        x, y = get(a), get(b)
        return y / x if x else None

    return {
        "workers": b["workers"] / a["workers"],
        "messages_per_worker_max": ratio(lambda r: r["messages_per_worker"]["max"]),
        "data_bytes_per_worker_max": ratio(lambda r: r["data_bytes_per_worker"]["max"]),
        "shipped_per_worker_max": ratio(lambda r: r["shipped_per_worker_max_bytes"]),
        "cached_driver_cpu": ratio(lambda r: r["cached_driver_cpu_s"]),
        "cached_wall": ratio(lambda r: r["cached_wall_s"]),
        "first_return_driver_cpu": ratio(lambda r: (r["second_move"] or r["first_move"])["driver_cpu_s"]),
    }


def format_report(r: dict) -> str:
    lines = [
        f"bench-scale: model {r['model']}, {r['src']} <-> {r['dst']}, {r['nodes_of']} workers per simulated node, "
        f"{r['machine']['cpus']} CPUs, {r['machine']['ram_bytes'] / 2**30:.0f} GiB",
        "",
        "| workers | nodes | start s | actor USS / PSS MiB | node +GB | 1st move s (world) | return move s "
        "(plan shipped) / driver CPU s | cached move s / driver CPU s | driver CPU ms per worker | plan s "
        "| shipped per worker KB | objects put | src->dst msgs per worker mean / max | src->dst data KB per worker "
        "mean / max "
        "| last_trace() s / JSON KB | verified |",
        "|" + "---|" * 16,
    ]
    for x in r["runs"]:
        m, ret = x["memory"], x["second_move"] or x["first_move"]
        lines.append(
            f"| {x['workers']} | {x['nodes']} | {x['start_s']:.1f} | {m['uss_mean_bytes'] / MB:.0f} / "
            f"{m['pss_mean_bytes'] / MB:.0f} | {m['node_used_bytes_over_before'] / 1e9:.1f} | "
            f"{x['first_move']['wall_s']:.2f} | {ret['wall_s']:.3f} / {ret['driver_cpu_s']:.3f} | "
            f"{x['cached_wall_s']:.3f} / {x['cached_driver_cpu_s']:.3f} | "
            f"{1e3 * x['cached_driver_cpu_s'] / x['workers']:.2f} | {ret['plan_s']:.3f} | "
            f"{x['shipped_per_worker_max_bytes'] / 1e3:.1f} | {x['shipped_objects_per_move']} | "
            f"{x['messages_per_worker']['mean']:.1f} / {x['messages_per_worker']['max']} | "
            f"{x['data_bytes_per_worker']['mean'] / 1e3:.1f} / {x['data_bytes_per_worker']['max'] / 1e3:.1f} | "
            f"{x['trace_gather_s']:.3f} / {x['trace_json_max_bytes'] / 1e3:.0f} | "
            f"{'yes' if x['verified'] else 'NO'} |"
        )
    g = r.get("growth")
    if g:
        parts = ", ".join(f"{k} x{v:.2f}" for k, v in g.items() if v is not None and k != "workers")
        lines += [
            "",
            f"growth {r['runs'][0]['workers']} -> {r['runs'][-1]['workers']} workers (x{g['workers']:.0f}): {parts}",
        ]
    return "\n".join(lines)
