"""Compiled copy programs (realloc/shards/copy_program.py): compiled on one set of buffers, replayed on
another, they must write exactly what one ``copy_`` per box writes on the second set."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc import Layout, Placement, Topology, plan_reallocation
from realloc.plan import bucket_nbytes
from realloc.shards import (
    Copies,
    ShardStore,
    allocate_buffers,
    execute_in_process,
    local_copies,
    pack_copies,
    unpack_copies,
    weight_kind,
)
from realloc.shards.copy_program import CopyProgram, ProgramCache, ProgramMismatch
from realloc.spec import decoder_spec

DTYPES = [torch.bfloat16, torch.float32, torch.int8, torch.float64]


def _buffer(n: int, dtype: torch.dtype, lead: int, fill: float | None) -> torch.Tensor:
    """A flat buffer of ``n`` elements starting ``lead`` elements into its storage."""
    base = (
        torch.arange(n + lead, dtype=torch.float64).to(dtype)
        if fill is None
        else torch.full((n + lead,), fill, dtype=torch.float64).to(dtype)
    )
    return base[lead:]


def _boxes(data, n_out: int, n_in: int):
    """Random non-overlapping destination boxes with source boxes, some repeated at a constant
    step (a weight in every layer), as ``(out offset, in offset, rows, cols, out pitch, in pitch)``."""
    boxes, used = [], 0
    for _ in range(data.draw(st.integers(1, 4))):
        rows, cols = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 20))
        pitch_o, pitch_i = cols + data.draw(st.integers(0, 7)), cols + data.draw(st.integers(0, 7))
        layers = data.draw(st.integers(1, 4))
        block_o = rows * pitch_o + data.draw(st.integers(0, 9))
        block_i = rows * pitch_i + data.draw(st.integers(0, 9))
        start_o, start_i = used + data.draw(st.integers(0, 9)), data.draw(st.integers(0, 200))
        for layer in range(layers):
            off_o, off_i = start_o + layer * block_o, start_i + layer * block_i
            if off_o + rows * pitch_o > n_out or off_i + rows * pitch_i > n_in:
                return boxes
            boxes.append((off_o, off_i, rows, cols, pitch_o, pitch_i))
            used = off_o + rows * pitch_o
    return boxes


def _copies(boxes, outs: dict, ins: dict, keys_o: list[str], keys_i: list[str]) -> Copies:
    c = Copies([], [], [])
    for k, (off_o, off_i, rows, cols, pitch_o, pitch_i) in enumerate(boxes):
        o, i = outs[keys_o[k]], ins[keys_i[k]]
        c.add(
            o.as_strided((rows, cols), (pitch_o, 1), o.storage_offset() + off_o),
            i.as_strided((rows, cols), (pitch_i, 1), i.storage_offset() + off_i),
            f"w{k % 3}",
        )
        c.nbytes += rows * cols * o.element_size()
    return c


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_program_replayed_on_other_buffers_writes_what_per_box_copies_write(data):
    """Two buffers a side (one dtype each, as a store's), offsets that are not 8-byte aligned,
    odd rows, runs to stack: compile on one pair of sides, run on fresh buffers (other bytes,
    other storage offsets of the same alignment), compare with one copy_ per box there."""
    dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=2, max_size=2, unique=True))
    n_out, n_in = 3000, 3000
    lead_o = [data.draw(st.integers(0, 3)) * 8 for _ in dtypes]  # storage offsets that keep 8-byte phases
    sides = lambda fill, lead: {str(d): _buffer(n_out, d, lead[k], fill) for k, d in enumerate(dtypes)}  # noqa: E731
    boxes = _boxes(data, n_out, n_in)
    if not boxes:
        return
    keys = [str(data.draw(st.sampled_from(dtypes))) for _ in boxes]
    compile_outs, compile_ins = sides(0.0, [0, 0]), sides(None, [0, 0])
    program = CopyProgram.compile(_copies(boxes, compile_outs, compile_ins, keys, keys), compile_outs, compile_ins)

    outs, want, ins = (
        sides(-1.0, lead_o),
        sides(-1.0, lead_o),
        {k: v.flip(0).contiguous() for k, v in sides(None, [0, 0]).items()},
    )
    assert program.run(outs, ins) == sum(r * c * outs[k].element_size() for k, (_, _, r, c, _, _) in zip(keys, boxes))
    reference = _copies(boxes, want, ins, keys, keys)
    for o, i in zip(reference.outs, reference.ins):
        o.copy_(i)
    for k in outs:
        assert torch.equal(outs[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_buffers_that_cannot_hold_the_views_are_refused_before_any_copy():
    outs = {"a": torch.zeros(64, dtype=torch.bfloat16)}
    ins = {"b": torch.arange(64, dtype=torch.float32).to(torch.bfloat16)}
    c = Copies([], [], [])
    c.add(outs["a"].as_strided((2, 8), (16, 1), 32), ins["b"][:16].view(2, 8), "w")  # strided: 8-byte words
    c.add(outs["a"][:8], ins["b"][40:48], "v")  # small and dense: bf16 elements
    program = CopyProgram.compile(c, outs, ins)
    assert {g.dtype for group in program.groups for g, _ in group} == {torch.bfloat16, torch.int64}
    small = {"a": torch.zeros(48, dtype=torch.bfloat16)}
    with pytest.raises(ProgramMismatch, match="'a' has 96 bytes, the compiled views reach 112"):
        program.run(small, ins)
    assert not small["a"].any()  # nothing copied, not even the box that fits
    with pytest.raises(ProgramMismatch, match="'b' is missing"):
        program.run(outs, {"c": ins["b"]})
    shifted = {"a": torch.zeros(80, dtype=torch.bfloat16)[1:65]}  # 2 bytes into its storage: no 8-byte words
    with pytest.raises(ProgramMismatch, match="starts at byte 2 of its storage: the compiled views need 0 modulo 8"):
        program.run(shifted, ins)
    assert not shifted["a"].any()
    aligned = {"a": torch.zeros(80, dtype=torch.bfloat16)[4:68]}  # 8 bytes in: the same phase, replayed there
    program.run(aligned, ins)
    want = torch.zeros(64, dtype=torch.bfloat16)
    want.as_strided((2, 8), (16, 1), 32).copy_(ins["b"][:16].view(2, 8))
    want[:8] = ins["b"][40:48]
    assert torch.equal(aligned["a"], want)


def test_compile_names_views_that_lie_on_no_given_buffer():
    outs = {"a": torch.zeros(8)}
    stray = torch.zeros(8)
    c = Copies([stray[:4]], [torch.ones(4)], ["w"])
    with pytest.raises(ValueError, match="an out view is on none of the out buffers"):
        CopyProgram.compile(c, outs, {"b": c.ins[0]})
    beyond = torch.zeros(16)  # on a buffer's storage, but outside the buffer's bytes
    with pytest.raises(ValueError, match="an out view is on none of the out buffers"):
        CopyProgram.compile(Copies([beyond[10:14]], [torch.ones(4)], ["w"]), {"a": beyond[:8]}, {"b": torch.ones(4)})


def test_buffers_that_share_a_storage_are_told_apart_by_their_bytes():
    """Checkpoint files read into memory hold several dtypes' buffers in one storage: each view
    belongs to the buffer whose bytes hold it, and replays on that buffer of another set."""
    blob = torch.zeros(64, dtype=torch.uint8)
    outs = {"f": blob[:32].view(torch.float32), "h": blob[32:].view(torch.bfloat16)}
    ins = {"f": torch.arange(8, dtype=torch.float32), "h": torch.arange(16, dtype=torch.float32).to(torch.bfloat16)}
    c = Copies([outs["f"][2:6], outs["h"][4:12]], [ins["f"][:4], ins["h"][8:16]], ["a", "b"])
    program = CopyProgram.compile(c, outs, ins)
    blob2 = torch.zeros(64, dtype=torch.uint8)
    again = {"f": blob2[:32].view(torch.float32), "h": blob2[32:].view(torch.bfloat16)}
    program.run(again, ins)
    assert again["f"].tolist() == [0, 0, 0, 1, 2, 3, 0, 0]
    assert again["h"][4:12].tolist() == list(range(8, 16)) and not again["h"][:4].any() and not again["h"][12:].any()


def test_the_cache_recompiles_when_the_buffers_no_longer_fit():
    """A key's program is replayed while the buffers hold its views; smaller ones get a program
    of their own (``plan`` is called again), never the views of the larger set."""
    calls = []

    def plan_for(outs, ins, n):
        def plan():
            calls.append(n)
            return Copies([outs["a"][:n]], [ins["b"][:n]], ["w"], 4 * n)

        return plan

    cache = ProgramCache()
    for n in (16, 16, 8):
        outs, ins = {"a": torch.zeros(n)}, {"b": torch.arange(n, dtype=torch.float32) + n}
        assert cache.run("k", plan_for(outs, ins, n), outs, ins) == 4 * n
        assert torch.equal(outs["a"], ins["b"])
    assert calls == [16, 8]  # compiled once for 16 elements, replayed, compiled again for 8


def _inside_a_block(buffers: dict[str, torch.Tensor], lead_bytes: int) -> dict[str, torch.Tensor]:
    """The same buffers ``lead_bytes`` into a larger storage, zeroed: what a CUDA IPC handle opens
    (a view into the exporter's allocator block) and a checkpoint file read into memory holds."""
    out = {}
    for k, t in buffers.items():
        lead = lead_bytes // t.element_size()
        out[k] = torch.zeros(t.numel() + lead + 3, dtype=t.dtype, device=t.device)[lead : lead + t.numel()]
    return out


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("src,dst", [("fsdp=8", "tp=8"), ("tp=4,pp=2", "dp=2,tp=4"), ("tp=8", "dp=4,tp=2")])
def test_a_plans_copies_compiled_once_replay_exactly_on_every_move(src, dst, device):
    """Every worker's local copies and reads of a real plan (a tied GQA model with fp32 norms, kv
    heads replicated at tp=8, vocabulary padding), compiled on the first set of destination
    buffers, replayed into others that start elsewhere in larger storages (as buffers opened
    from a peer's handle do): bit-identical to ``copy_local`` per segment list; packing and
    unpacking every bucket through staging too. On a GPU too, where the workers run them."""
    spec = decoder_spec(
        "gqa8", hidden=64, intermediate=96, layers=3, heads=8, kv_heads=4, vocab=1001, tied=True, norm_dtype="float32"
    )
    a, b = Layout(spec, Topology.parse(src)), Layout(spec, Topology.parse(dst), vocab_pad_multiple=64)
    plan = plan_reallocation(spec, a, b, Placement.blocks(8, per_node=4))
    sources = {r: ShardStore(a.shards(r), allocate_buffers(a, r, device)) for r in range(8)}
    for r, store in sources.items():
        for t in store.buffers.values():
            t.copy_((torch.arange(t.numel(), dtype=torch.float64) * 0.37 + r).to(t.dtype))
    want = {r: ShardStore(b.shards(r), allocate_buffers(b, r, device)) for r in range(8)}
    execute_in_process(plan, sources, want)  # per box, packing every bucket
    cache = ProgramCache()
    staging = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    compiled_after_two = None
    for move in range(3):  # compiled in the first, replayed on fresh buffers in the others
        got = {
            r: ShardStore(b.shards(r), _inside_a_block(allocate_buffers(b, r, device), 512 * move)) for r in range(8)
        }
        for w, j in plan.local_copies:
            cache.run(
                ("local", j, w),
                lambda: local_copies(sources[w], got[w], plan.segment_list(j)),
                got[w].buffers,
                sources[w].buffers,
            )
        for step, snd, rcv, j in plan.routes():
            sender = got[snd] if plan.reads_destination(step) else sources[snd]
            if move == 1:  # a zero-copy read of the sender's buffers
                n = cache.run(
                    ("read", j, snd, step),
                    lambda: local_copies(sender, got[rcv], plan.segment_list(j)),
                    got[rcv].buffers,
                    sender.buffers,
                )
                assert n == plan.list_bytes(j)
                continue
            for i, bucket in enumerate(plan.buckets(j)):  # through staging
                staged = staging[: bucket_nbytes(bucket)]
                cache.run(
                    ("pack", j, i, snd, step),
                    lambda: pack_copies(sender, bucket, staged),
                    {"staging": staged},
                    sender.buffers,
                )
                cache.run(
                    ("unpack", j, i, rcv),
                    lambda: unpack_copies(got[rcv], bucket, staged),
                    got[rcv].buffers,
                    {"staging": staged},
                )
        for r in range(8):
            for k in want[r].buffers:
                assert torch.equal(want[r].buffers[k].view(torch.uint8), got[r].buffers[k].view(torch.uint8))
        if move == 2:
            assert len(cache) == compiled_after_two  # the third move compiled nothing
        compiled_after_two = len(cache)


def test_weight_kinds_label_the_copies():
    c = Copies([], [], [])
    c.add(torch.zeros(2), torch.ones(2), "model.layers.3.mlp.up_proj.weight")
    assert c.kinds == [weight_kind("model.layers.7.mlp.up_proj.weight")]
