"""Per-worker plan slices (realloc/plan/slices.py) against the plans they are cut from.

Every worker is shipped its slice only, so a slice must hold exactly that worker's routes, the
segment lists they name with the plan's segments, and its local copies. Here, on random layouts
in both plan forms (small: lists; large: arrays, runs of segments, the cyclic schedule), every
worker's slice is checked against the plan, and a plan rebuilt from nothing but the slices
(each route as its sender and its receiver were shipped it, which must agree) is executed and
checked bit for bit against the oracle.
"""

from __future__ import annotations

import json
import pickle
from contextlib import contextmanager, nullcontext

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_scale import large_form
from test_planner_properties import check_execution_matches_oracle, fsdp_reallocations, make_plan, reallocations

from realloc import Layout, ModelSpec, Placement, Topology, plan_reallocation
from realloc.plan import Plan, Route, Segment
from realloc.plan import slices as slices_module
from realloc.plan.slices import PlanSlice, slice_plan


def worker_routes(plan: Plan, w: int) -> list[tuple[int, int, int, int]]:
    return sorted((s, a, b, j) for s, a, b, j in plan.routes() if w in (a, b))


def held_layouts(case, w: int) -> tuple:
    """Worker ``w``'s ``(source, destination)`` rank layouts in ``case`` (None: none)."""
    spec = case.d.spec()
    out = []
    for topo, workers in ((case.src, case.src_workers), (case.dst, case.dst_workers)):
        ranks = workers if workers is not None else list(range(topo.world_size))
        out.append(Layout(spec, topo, case.pad).at(ranks.index(w)) if w in ranks else None)
    return tuple(out)


def check_slices(plan: Plan, case=None) -> list[PlanSlice]:
    """Every slice against the plan; with ``case``, every segment a worker reads or writes is
    held by the layout it reads or writes (``PlanSlice.check_held`` refuses no valid slice)."""
    slices = slice_plan(plan)
    assert [p.worker for p in slices] == list(range(len(plan.nodes)))
    for w, piece in enumerate(slices):
        piece.validate(len(plan.nodes))
        if case is not None:
            piece.check_held(*held_layouts(case, w))
        got = sorted((s, *r) for s, rs in piece.routes_by_step().items() for r in rs)
        assert got == worker_routes(plan, w)
        assert sorted(piece.local) == sorted(j for v, j in plan.local_copies if v == w)
        assert (piece.bucket_bytes, piece.forward_from, piece.num_steps) == (
            plan.bucket_bytes,
            plan.forward_from,
            len(plan.steps),
        )
        for j in {r[3] for r in got} | set(piece.local):
            assert piece.segment_list(j) == plan.segment_list(j)
            assert piece.list_bytes(j) == plan.list_bytes(j)
            assert piece.buckets(j) == plan.buckets(j)
        shipped = pickle.loads(pickle.dumps(piece))
        again = PlanSlice.from_json(json.loads(json.dumps(piece.to_json())))
        for other in (shipped, again):
            assert other.routes_by_step() == piece.routes_by_step()
            assert all(other.segment_list(j) == piece.segment_list(j) for j in {r[3] for r in got})
    return slices


def rebuilt(plan: Plan, slices: list[PlanSlice]) -> Plan:
    """A plan made from the slices alone: every route as both its ends hold it, every list as
    the slices that name it hold it (they must agree)."""
    lists: dict[int, list[Segment]] = {}
    routes: dict[tuple, int] = {}
    local = []
    for piece in slices:
        for s, rs in piece.routes_by_step().items():
            for a, b, j in rs:
                routes[s, a, b, j] = routes.get((s, a, b, j), 0) + 1
                segs = piece.segment_list(j)
                assert lists.setdefault(j, segs) == segs
        for j in piece.local:
            local.append((piece.worker, j))
            lists.setdefault(j, piece.segment_list(j))
    assert set(routes.values()) <= {2}, "a route one of its ends was not shipped"
    segments, ids = [], {}
    for j in sorted(lists):
        ids[j] = tuple(range(len(segments), len(segments) + len(lists[j])))
        segments += lists[j]
    order = sorted(ids)
    renumber = {j: k for k, j in enumerate(order)}
    steps = [[] for _ in range(max((s for s, *_ in routes), default=-1) + 1)]
    for s, a, b, j in sorted(routes):
        steps[s].append(Route(a, b, renumber[j]))
    return Plan(
        segments,
        [ids[j] for j in order],
        sorted((w, renumber[j]) for w, j in local),
        steps,
        plan.bucket_bytes,
        plan.nodes,
        plan.forward_from,
        plan.stats,  # what the oracle check compares the bytes moved with
    )


@settings(max_examples=40, deadline=None)
@given(reallocations())
def test_slices_are_the_plan_per_worker_and_execute_bit_exact(case):
    plan = make_plan(case)
    check_execution_matches_oracle(case, rebuilt(plan, check_slices(plan, case)))


@settings(max_examples=25, deadline=None)
@given(fsdp_reallocations())
def test_slices_of_large_form_plans(case):
    with large_form():
        plan = make_plan(case)
    check_execution_matches_oracle(case, rebuilt(plan, check_slices(plan, case)))


def shape(slices: list[PlanSlice]) -> list:
    """Every slice's arrays as values and which of its parts are one object with an earlier one's."""
    ids: dict[int, int] = {}
    out = []
    for piece in slices:
        out.append((piece.worker, piece.routes.tolist(), piece.route_steps.tolist(), piece.local))
        for part in piece.parts:
            runs = part.runs
            out.append(ids.setdefault(id(part), len(ids)))
            out += [a.tolist() for a in (part.list_ids, part.list_ptr, part.range_lo, part.range_hi)]
            out += [runs.names, runs.dtypes, *(a.tolist() for a in runs.segment_rows()[1:]), runs.offsets.tolist()]
    return out


@settings(max_examples=30, deadline=None)
@given(reallocations(), st.booleans())
def test_slices_cut_a_worker_and_a_part_at_a_time_are_the_same(case, large):
    """``slice_plan`` cuts blocks of workers (``_BLOCK_ENDS`` route ends) and numbers each
    block's names a block of parts at a time (``_NAMES_BLOCK``); at one worker and one part a
    block the slices are the plan's and equal the slices cut in one block, parts shared alike."""
    with large_form() if large else nullcontext():
        plan = make_plan(case)
    whole = slice_plan(plan)
    with blocks(ends=1, names=1):
        slices = check_slices(plan, case)
        some = [w for w in (3, 0, 1) if w < len(plan.nodes)]
        assert shape(slice_plan(plan, some)) == shape([whole[w] for w in some])
    assert shape(slices) == shape(whole)


@contextmanager
def blocks(ends: int, names: int):
    saved = slices_module._BLOCK_ENDS, slices_module._NAMES_BLOCK
    slices_module._BLOCK_ENDS, slices_module._NAMES_BLOCK = ends, names
    try:
        yield
    finally:
        slices_module._BLOCK_ENDS, slices_module._NAMES_BLOCK = saved


def test_slice_is_proportional_to_own_routes():
    """At 256 workers every rank of an fsdp source sends to every destination rank, yet each
    slice holds only its own routes, and workers that receive the same lists share one part."""
    spec = ModelSpec.preset("small")
    plan = plan_reallocation(spec, Topology(fsdp=256), Topology(dp=32, tp=8), Placement.blocks(256, 8))
    slices = slice_plan(plan)
    total = sum(1 for _ in plan.routes())
    for w in (0, 17, 255):
        assert len(slices[w].routes) == len(worker_routes(plan, w)) < total / 50
    sizes = [len(pickle.dumps(p)) for p in slices]
    assert max(sizes) < len(pickle.dumps(plan)) / 20


def _send_twice(d):
    a, b, j = next(r for r in d["routes"] if r[0] == 0)
    d["routes"].append([0, 3 if b != 3 else 2, j])
    d["route_steps"].append(d["route_steps"][d["routes"].index([a, b, j])])


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d["routes"][0].__setitem__(slice(0, 2), [1, 2]), "neither sends nor receives"),
        (_send_twice, "send more than once"),
        (lambda d: d["routes"][0].__setitem__(2, 10**6), "are not in it"),
        (lambda d: d["routes"][0].__setitem__(1 if d["routes"][0][0] == 0 else 0, 9), "names workers outside 0..3"),
        (lambda d: d["route_steps"].__setitem__(0, d["num_steps"] + 3), "steps must lie within"),
        (lambda d: d.update(forward_from=d["num_steps"] + 1), "forward_from"),
        (lambda d: d.update(worker=4), "worker ids"),
        (lambda d: d["parts"][0]["range_hi"].__setitem__(0, 10**6), "ranges lie outside"),
        (lambda d: d.update(bucket_bytes=0), "bucket_bytes must be an integer of at least 16, got 0"),
        (lambda d: d["parts"][0]["segments"][0].__setitem__(1, "float12"), "segment dtype 'float12'"),
        (lambda d: d["parts"][0]["segments"][0][2][0][1].__setitem__(0, 0), "segment box"),
        (lambda d: d["parts"][0]["segments"][0][2][0][0].__setitem__(0, -1), "segment box"),
    ],
)
def test_malformed_slices_are_refused_before_any_traffic(change, words):
    spec = ModelSpec.preset("tiny")
    plan = plan_reallocation(spec, Topology(tp=4), Topology(dp=2, tp=2), Placement.blocks(4, 2))
    data = slice_plan(plan, [0])[0].to_json()
    PlanSlice.from_json(json.loads(json.dumps(data)))  # as cut: valid
    change(data)
    with pytest.raises(ValueError, match=words):
        PlanSlice.from_json(data)


def _first_run(part: int, change):
    """A change of the first run of segments of part ``part`` of a slice's JSON:
    ``change(run, shape)`` (``run``: ``[params, dtype, cells]``; ``shape``: its first
    parameter's shape in the tiny model)."""
    spec = ModelSpec.preset("tiny")

    def apply(d):
        run = d["parts"][part]["segments"][0]
        change(run, spec.by_name[run[0][0]].shape)

    return apply


def _set_dtype(run, shape):
    run[1] = "float32" if run[1] != "float32" else "bfloat16"


def _rename(run, shape):
    run[0][0] = "model.layers.0.mlp.nope.weight"


def _outside(run, shape):
    run[2][0][0][0] = shape[0]  # first dim's offset at the tensor's end, any size: outside


def _larger(run, shape):
    run[2][0][0][0], run[2][0][1][0] = 0, shape[0] + 1  # the whole first dim and one more


def _not_held(run, shape):
    # worker 0 holds rows 0.. of a tp=4 shard of most tensors; its last row is held by worker 3
    offsets, sizes = run[2][0]
    offsets[:] = [s - 1 for s in shape]
    sizes[:] = [1] * len(shape)


@pytest.mark.parametrize("part", [0, 1], ids=["sent", "received"])
@pytest.mark.parametrize(
    "change, words",
    [
        (_set_dtype, r"segment dtype '\w+' of '[\w.]+' does not match its layout's dtype"),
        (_rename, "segment param 'model.layers.0.mlp.nope.weight' is not a parameter of 'tiny'"),
        (_outside, r"segment box offsets=\(\d+, .* lies outside '[\w.]+' of shape"),
        (_larger, r"segment box offsets=\(0, .* sizes=\(\d+, .* lies outside '[\w.]+' of shape"),
    ],
)
def test_a_slice_naming_what_its_worker_cannot_hold_is_refused(part, change, words):
    """Issue 36: a slice whose segments name a dtype other than the layout's, an unknown
    parameter, a box outside its tensor or larger than it passed ``validate`` and reached the
    worker, which wrote reinterpreted bytes (dtype) or failed mid-transfer with the shard
    store's bare ``KeyError``. ``check_held`` (run by the worker as it receives its slice,
    ``actors.executor.received_share``) refuses each, naming the field."""
    spec = ModelSpec.preset("tiny")
    src, dst = Topology(tp=4), Topology(dp=2, tp=2)
    plan = plan_reallocation(spec, src, dst, Placement.blocks(4, 2))
    held = Layout(spec, src).at(0), Layout(spec, dst).at(0)
    data = slice_plan(plan, [0])[0].to_json()
    PlanSlice.from_json(json.loads(json.dumps(data))).check_held(*held)  # as cut: valid
    _first_run(part, change)(data)
    piece = PlanSlice.from_json(data)  # well formed: only the layouts tell
    with pytest.raises(ValueError, match=words):
        piece.check_held(*held)
    piece.check_held(None, None)  # sides without a layout (a checkpoint worker's files): unchecked


def test_a_box_the_worker_does_not_hold_is_refused():
    spec = ModelSpec.preset("tiny")
    src, dst = Topology(tp=4), Topology(dp=2, tp=2)
    plan = plan_reallocation(spec, src, dst, Placement.blocks(4, 2))
    held = Layout(spec, src).at(0), Layout(spec, dst).at(0)
    data = slice_plan(plan, [0])[0].to_json()
    _first_run(1, _not_held)(data)
    with pytest.raises(ValueError, match=r"segment box .* is in no shard of worker 0's destination \(rank 0 of"):
        PlanSlice.from_json(data).check_held(*held)


def test_a_slice_shipped_to_another_worker_is_refused():
    spec = ModelSpec.preset("tiny")
    plan = plan_reallocation(spec, Topology(tp=2), Topology(dp=2), Placement.blocks(2, 1))
    piece = slice_plan(plan, [1])[0]
    piece.validate(2, 1)
    with pytest.raises(ValueError, match="slice of worker 1 was shipped to worker 0"):
        piece.validate(2, 0)
    with pytest.raises(ValueError, match="plan of 2 workers, not of the 3"):
        piece.validate(3, 1)


def test_a_fresh_slice_answers_two_threads_at_once():
    """A worker reads its slice from two threads from the start (local copies run beside the
    transfers, actors/worker/actor.py ``_run``): the first lookups of segment lists, racing, must all
    find their lists (a 64-worker Ray move once failed with ``KeyError: segment list 9 is not in
    worker 57's slice`` while the other thread was still filling the index)."""
    import sys

    spec = ModelSpec.preset("small")
    plan = plan_reallocation(spec, Topology(fsdp=64), Topology(dp=8, tp=8), Placement.blocks(64, 8))
    shipped = pickle.dumps(slice_plan(plan, [5])[0])
    errors = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race, if any, shows
    try:
        race(shipped, errors)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


def race(shipped: bytes, errors: list) -> None:
    import threading

    for _ in range(20):
        piece = pickle.loads(shipped)
        named = [int(j) for j in piece.routes[:, 2]] + list(piece.local)
        start = threading.Barrier(4)

        def look(js):
            start.wait()
            try:
                for j in js:
                    piece.segment_list(j)
            except KeyError as err:
                errors.append(err)

        threads = [threading.Thread(target=look, args=(named[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


@pytest.mark.parametrize("file_bytes", [3 * 2**30, 5 * 2**30 + 12345])
def test_slices_of_checkpoint_files_past_two_gib_carry_their_boxes_exactly(file_bytes):
    """A checkpoint's rank files are one-dimensional byte arrays (realloc/ckpt/replication.py),
    4.4 GB each for llama-70b at dp=4,tp=8,pp=4. The slices packed every box as int32: a file of
    2-4 GiB got a negative size (refused: ``ckpt-demo --factor 4`` failed), and one past 4 GiB a
    wrapped one that validated and copied the wrong bytes (a 5 GiB file shipped as 1 GiB)."""
    from realloc.ckpt.replication import file_table, replication_groups
    from realloc.plan.planner import plan_exchange

    files = {r: file_bytes for r in range(4)}
    placement = Placement.blocks(4, 2)  # 2 nodes; replication factor 2: every file onto the other node
    holdings, needs = replication_groups(files, placement, 2, 2)
    plan = plan_exchange(holdings, needs, placement, file_table(files))
    assert plan.stats["bytes_inter_node"] == sum(files.values())
    check_slices(plan)  # every worker's segments equal the plan's, shipped (pickled) and as JSON
