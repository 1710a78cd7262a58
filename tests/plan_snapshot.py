"""A fingerprint of the planner's output, for refactors that must not change a single plan.

Plans a fixed list of cases and prints one line per case: its kind, its number, the sha256 of
``plan.dumps()`` (the plan's JSON, keys sorted; the wall-clock planning time is not part of it)
and a short description. The cases are drawn from the property tests' own strategies
(tests/test_planner_properties.py, test_experts.py, test_zero3.py, test_conventions.py, with
hypothesis derandomized, so the same list on every run of the same test code), plus the tests'
hand-picked cases, plans forced into the large form (tests/test_plan_scale.py's ``large_form``) and a few preset models at
scale. Record before a change, compare after::

    python tests/plan_snapshot.py > /tmp/plan_json_before.txt
    ... change the planner ...
    python tests/plan_snapshot.py > /tmp/plan_json_after.txt
    cmp /tmp/plan_json_before.txt /tmp/plan_json_after.txt

With ``--slices`` each line digests the plan's per-worker slices instead (for changes to the
slicer, realloc/plan/slices.py).

Imports go through names every version of the tree keeps (``realloc``'s own face and the
test modules' strategies), so the script runs unchanged on both sides of a move.
"""

from __future__ import annotations

import hashlib
import sys
from contextlib import nullcontext
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracle
import test_conventions
import test_experts
import test_planner_properties as props
import test_zero3
from test_plan_scale import large_form

from realloc import Layout, ModelSpec, Placement, Topology, plan_exchange, plan_reallocation


def drawn(strategy, n: int) -> list:
    """``n`` examples of ``strategy`` (fewer if it runs out), the same ones on every run.

    Hypothesis also draws literals it finds in the project's loaded modules ("local constants"),
    so a draw would change whenever the source does; they are switched off here, leaving the
    draws a function of the strategies and the hypothesis version alone.
    """
    providers._get_local_constants = lambda: providers.Constants()
    out = []

    @settings(
        derandomize=True,
        database=None,
        max_examples=n,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    return out


@st.composite
def zero3_reallocations(draw):
    d = draw(oracle.decoders(st))
    world = draw(st.sampled_from([8, 6, 4, 2]))
    zero3 = draw(test_zero3.zero3_topologies(d, world))
    other = draw(
        st.one_of(props.topologies(d, world), props.fsdp_topologies(d, world), test_zero3.zero3_topologies(d, world))
    )
    src, dst = (zero3, other) if draw(st.booleans()) else (other, zero3)
    return d.spec(), src, dst, draw(props.placements(world)), draw(st.integers(1024, 4096))


@st.composite
def convention_reallocations(draw):
    d = draw(oracle.decoders(st))
    world = draw(st.sampled_from([w for w in (8, 6, 4, 2) if oracle.factorisations(d, w)] or [1]))
    src = draw(test_conventions.conventional_layouts(d, world))
    dst = draw(test_conventions.conventional_layouts(d, world, src.topology))
    return src, dst, draw(props.placements(world)), draw(st.integers(1024, 4096))


def case_plan(case: props.Case):
    return props.make_plan(case)


def cases():
    """``(kind, description, thunk)`` of every case, in a fixed order."""
    out = []
    for kind, strategy, n in (
        ("reallocation", props.reallocations(), 80),
        ("cross-model", props.cross_model_copies(), 25),
        ("fsdp", props.fsdp_reallocations(), 40),
    ):
        for case in drawn(strategy, n):
            out.append(
                (
                    kind,
                    f"{case.d} {case.src} -> {case.dst} pad={case.pad} bucket={case.bucket_bytes} "
                    f"src_workers={case.src_workers} dst_workers={case.dst_workers}",
                    lambda case=case: case_plan(case),
                    nullcontext,
                )
            )
    for case in drawn(props.reallocations(), 20):
        out.append(("large-form", f"{case.d} {case.src} -> {case.dst}", lambda case=case: case_plan(case), large_form))
    for case in drawn(test_experts.ep_reallocations(), 30):
        m, src, dst, placement, pad, bucket = case
        out.append(
            (
                "experts",
                f"{src} -> {dst} bucket={bucket}",
                lambda src=src, dst=dst, placement=placement, bucket=bucket: plan_reallocation(
                    src.spec, src, dst, placement, bucket_bytes=bucket
                ),
                nullcontext,
            )
        )
    for case in drawn(test_experts.ep_reallocations(), 10):
        m, src, dst, placement, pad, bucket = case
        out.append(
            (
                "experts-large-form",
                f"{src} -> {dst} bucket={bucket}",
                lambda src=src, dst=dst, placement=placement, bucket=bucket: plan_reallocation(
                    src.spec, src, dst, placement, bucket_bytes=bucket
                ),
                large_form,
            )
        )
    for spec, src, dst, placement, bucket in drawn(zero3_reallocations(), 20):
        out.append(
            (
                "zero3",
                f"{src} -> {dst} bucket={bucket}",
                lambda spec=spec, src=src, dst=dst, placement=placement, bucket=bucket: plan_reallocation(
                    spec, src, dst, placement, bucket_bytes=bucket
                ),
                nullcontext,
            )
        )
    for src, dst, placement, bucket in drawn(convention_reallocations(), 20):
        out.append(
            (
                "conventions",
                f"{src} -> {dst} bucket={bucket}",
                lambda src=src, dst=dst, placement=placement, bucket=bucket: plan_reallocation(
                    src.spec, src, dst, placement, bucket_bytes=bucket
                ),
                nullcontext,
            )
        )
    for (holdings, needs, placement, table), bucket in drawn(
        st.tuples(props.random_exchanges(), st.integers(1024, 1536)), 30
    ):
        out.append(
            (
                "exchange",
                f"{holdings} -> {needs} on {placement.nodes} bucket={bucket}",
                lambda h=holdings, n=needs, p=placement, t=table, b=bucket: plan_exchange(h, n, p, t, bucket_bytes=b),
                nullcontext,
            )
        )
    chosen = [
        props.Case(props.GQA12, Topology(dp=3, tp=4), Topology(dp=2, tp=6), Placement.blocks(12, 4), bucket_bytes=1024),
        props.Case(
            props.GQA12, Topology(tp=4, pp=3), Topology(dp=1, tp=6, pp=2, layer_split=(2, 1)), props.SCATTERED12, pad=2
        ),
        props.Case(
            props.HEADS48,
            Topology(tp=4, pp=3, layer_split=(1, 2, 2)),
            Topology(tp=6, pp=2, layer_split=(4, 1)),
            props.SCATTERED12,
            pad=3,
            bucket_bytes=1500,
        ),
        props.Case(props.GQA8, Topology(tp=8), Topology(tp=4, pp=2, layer_split=(3, 1)), Placement.blocks(8, 1)),
        props.Case(props.FSDP8, Topology(fsdp=8), Topology(dp=2, tp=4), Placement.blocks(8, 4)),
        props.Case(
            props.FSDP8,
            Topology(dp=2, fsdp=3, tp=2),
            Topology(tp=4, pp=3, layer_split=(1, 2, 1)),
            Placement.blocks(12, 4),
        ),
        props.Case(
            props.GQA12,
            Topology(tp=2, pp=3),
            Topology(dp=2, tp=6, pp=1),
            Placement.blocks(18, 4),
            src_workers=list(range(12, 18)),
            dst_workers=list(range(12)),
            bucket_bytes=2048,
        ),
    ]
    for case in chosen:
        out.append(("chosen", f"{case.src} -> {case.dst}", lambda case=case: case_plan(case), nullcontext))
    for model, src, dst, n, options in (
        ("llama-70b", "dp=4,tp=8,pp=8", "dp=32,tp=8", 256, {}),
        ("qwen2.5-7b", "dp=2,tp=4,pp=2", "dp=8,tp=2", 16, dict(vocab_pad_multiple=64, vocab_pad_rule="vllm")),
        ("llama-7b", "fsdp=256", "dp=32,tp=8", 256, {}),
        ("llama-7b", "fsdp=512", "dp=64,tp=8", 512, {}),  # past LARGE_PLAN_ROUTES: StepTable, cyclic steps
        ("tiny", "dp=4", "dp=2,tp=2", 4, dict(qkv_order="megatron")),
    ):
        spec = ModelSpec.preset(model)
        out.append(
            (
                "preset",
                f"{model} {src} -> {dst}",
                lambda spec=spec, src=src, dst=dst, n=n, options=options: plan_reallocation(
                    spec,
                    Layout(spec, Topology.parse(src), **options),
                    Layout(spec, Topology.parse(dst), **options),
                    Placement.blocks(n, 8),
                ),
                nullcontext,
            )
        )
    return out


def slices_digest(plan) -> str:
    """The sha256 of every worker's slice of ``plan`` (``realloc.plan.slices.slice_plan``), value
    by value (integer widths of the run names aside), and of which parts the slices share; then
    of the slices of workers 3 and 0 cut alone."""
    import numpy as np

    from realloc.plan.slices import slice_plan

    h = hashlib.sha256()
    shared: dict[int, int] = {}

    def add(piece) -> None:
        h.update(repr((piece.worker, piece.num_workers, piece.num_steps, piece.bucket_bytes)).encode())
        h.update(repr((piece.forward_from, piece.local)).encode())
        for a in (piece.routes, piece.route_steps):
            h.update(a.dtype.str.encode() + a.tobytes())
        for part in piece.parts:
            h.update(str(shared.setdefault(id(part), len(shared))).encode())
            r = part.runs
            arrays = (part.list_ids, part.list_ptr, part.range_lo, part.range_hi)
            for a in arrays + (r.run_dtypes, r.run_cells, r.cell_ptr, r.ndim, r.offsets, r.sizes):
                h.update(a.dtype.str.encode() + a.tobytes())
            h.update(r.run_names.astype(np.int64).tobytes() + repr((r.names, r.dtypes)).encode())

    for piece in slice_plan(plan):
        add(piece)
    shared.clear()
    for piece in slice_plan(plan, [w for w in (3, 0) if w < len(plan.nodes)]):
        add(piece)
    return h.hexdigest()


def main() -> int:
    """One line per plan: the digest of its JSON, or with ``--slices`` of its workers' slices."""
    slices = "--slices" in sys.argv[1:]
    counts: dict[str, int] = {}
    for kind, description, plan_of, context in cases():
        i = counts[kind] = counts.get(kind, -1) + 1
        with context():
            plan = plan_of()
        digest = slices_digest(plan) if slices else hashlib.sha256(plan.dumps().encode()).hexdigest()
        print(f"{kind} {i} {digest} {description[:300]}")
    print(f"# {sum(c + 1 for c in counts.values())} plans", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
