"""The transfers a user would otherwise write (``driver``, ``broadcast``, ``gather``, ``dcp``), one direction at a time, each verified."""

from __future__ import annotations

import itertools
import math
import os
import shutil
import statistics
import time
import uuid
from typing import Any

import torch

from realloc.boxes import box_index
from realloc.layout import Layout, Topology
from realloc.shards import TORCH_DTYPES, ShardStore, allocate_buffers
from realloc_tools.bench.common import STATE, drop_state, log_line, malloc_trim
from realloc_tools.bench.faults import fault_fn, recover_group
from realloc_tools.bench.memory import MemoryGuard, baseline_memory_estimate, driver_store_bytes, window_json
from realloc_tools.bench.report import lower_bound
from realloc_tools.bench.verify import Layouts, crc


def run_direction(
    group,
    layouts: Layouts,
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
    memory: MemoryGuard,
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
    log_line(
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
    layouts: Layouts,
    d: dict,
    names: list[str],
    direction: int,
    dst: Topology,
    baseline_repeats: int,
    verify: str,
    seed: int,
    memory: MemoryGuard,
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
            malloc_trim()
            estimate = baseline_memory_estimate(name, group.layout, group.target(dst), nodes, memory.store_resident)
            if i == 0:
                mem.update(estimate_bytes=estimate["bytes"], estimate_terms=estimate["terms"])
            if memory.checked:  # what an earlier run took counts, less the store pages it left touched
                taken = [r["peak_extra_bytes"] - r["store_growth_bytes"] for r in mem["runs"]]
                go, budget, reason = memory.decide(estimate["bytes"], taken, baseline_repeats)
                mem["budget_bytes"] = budget
                if not go:
                    log_line(f"baseline {name} {src} -> {dst} {reason}")
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
                        group.run(fault_fn, fault, writes=False)
                    seconds, info = BASELINE_FNS[name](group, dst)
            except Exception as err:  # noqa: BLE001 - e.g. Ray's memory monitor killed a worker: record it, go on
                text = f"{type(err).__name__}: {err}"[:2000]
                log_line(f"baseline {name} {src} -> {dst} FAILED in run {i + 1}: {text[:300]}")
                failed = d["baselines_failed"][name] = {"error": text, "runs_before": runs, "memory": window_json(w)}
                try:
                    failed["recovery"] = recover_group(group, layouts, seed)
                    if memory.sampler.local:
                        memory.sampler.set_pids([x["pid"] for x in group.infos])
                except Exception as err2:  # noqa: BLE001 - the caller stops after keeping this direction
                    d["group_broken"] = failed["recovery_error"] = f"{type(err2).__name__}: {err2}"[:2000]
                    log_line(f"group could not be restored: {d['group_broken'][:300]}")
                break
            mem["runs"].append({**window_json(w), "store_growth_bytes": estimate["terms"].get("object_store_bytes", 0)})
            if name == "driver":
                memory.store_resident = max(memory.store_resident, driver_store_bytes(group.spec.total_bytes(), nodes))
            bad = (
                _verify_baseline(group, verify, seed, reference)
                if reference is not None or verify == "exact"
                else ["<no verified reference digests>"]
            )
            group.run(drop_state, writes=False)
            malloc_trim()  # the driver baseline's full tensors
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
        log_line(
            f"baseline {name} {src} -> {dst}: median {d['baselines'][name]:.2f}s of "
            f"{', '.join(f'{s:.2f}' for s in runs)}; verified {'ok' if not bad_any else bad_any[:3]}; "
            f"peak +{mem['peak_extra_bytes'] / 1e9:.2f} GB (node {mem['peak_used_bytes'] / 1e9:.1f} GB; "
            f"estimated +{mem['estimate_bytes'] / 1e9:.2f})"
        )
    d["speedup_vs"] = {k: v / d["ours_seconds"] for k, v in d["baselines"].items()}


def run_deferred(
    group,
    layouts: Layouts,
    transitions: list[tuple[Topology, Topology]],
    directions: list[dict],
    names: list[str],
    baseline_repeats: int,
    verify: str,
    seed: int,
    memory: MemoryGuard,
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


def _verify_baseline(group, how: str, seed: int, reference: list[dict[str, int]]) -> list[str]:
    return [
        f"rank {r} {slot}"
        for r, bad in enumerate(group.run(_verify_state, how, seed, reference, writes=False))
        for slot in bad
    ]


def _verify_state(ctx, how: str, seed: int, reference: list[dict[str, int]]) -> list[str]:
    state = STATE.get("dst")
    if state is None:
        return ["<no destination buffers>"]
    store: ShardStore = state
    tensors = store.shard_tensors()
    if how == "digest":
        mine = {slot: crc(t) for slot, t in tensors.items()}
        want = reference[ctx.rank]
        return sorted(s for s in set(mine) | set(want) if mine.get(s) != want.get(s))
    from realloc.shards.synthetic import synthetic_box

    spec = STATE["spec"]
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


def _new_dst_store(spec, dst: Topology, rank: int, vocab_pad_multiple: int) -> ShardStore:
    layout = Layout(spec, dst, vocab_pad_multiple)
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    STATE.update(dst=store, spec=spec)
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
