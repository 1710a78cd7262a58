"""Shard stores address boxes by precomputed strides (realloc/shards/store.py: ShardIndex): every view
checked against numpy slicing of the shard's local tensor, described from the shard record."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.layout import Shard
from realloc.shards import ShardIndex, ShardStore, zero_padding


@st.composite
def store_case(draw):
    """A rank holding one param twice (a tied head), each shard at its own buffer offset with
    padding past its box, and a box inside the held part."""
    ndim = draw(st.integers(1, 3))
    full = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, n - 1)) for n in full)
    sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(full, offsets))
    local_shape = tuple(s + draw(st.integers(0, 2)) for s in sizes)
    gap = draw(st.integers(0, 5))
    first = Shard("w", "w", offsets, sizes, local_shape, "float32", draw(st.integers(0, 5)))
    second = Shard(
        "w", "head", offsets, sizes, local_shape, "float32", first.buffer_offset + math.prod(local_shape) + gap
    )
    box_offsets = tuple(draw(st.integers(o, o + s - 1)) for o, s in zip(offsets, sizes))
    box_sizes = tuple(draw(st.integers(1, o + s - bo)) for o, s, bo in zip(offsets, sizes, box_offsets))
    return (first, second), (box_offsets, box_sizes), second.buffer_offset + math.prod(local_shape)


def reference(buf: np.ndarray, shard: Shard, box) -> np.ndarray:
    local = buf[shard.buffer_offset : shard.buffer_offset + math.prod(shard.local_shape)].reshape(shard.local_shape)
    return local[tuple(slice(o - so, o - so + n) for o, so, n in zip(box[0], shard.offsets, box[1]))]


@settings(max_examples=200, deadline=None)
@given(store_case(), st.booleans())
def test_views_are_the_boxes_of_the_local_tensors(case, offset_buffer):
    shards, box, numel = case
    base = torch.arange(numel + 3, dtype=torch.float32)
    buf = base[3:] if offset_buffer else base[:numel]  # a buffer need not start its storage
    store = ShardStore(shards, {"float32": buf})
    views = store.views("w", *box)
    assert len(views) == 2
    for view, shard in zip(views, shards):
        assert np.array_equal(view.numpy(), reference(buf.numpy(), shard, box))
    value = torch.full(box[1], -1.0)
    store.write("w", *box, value)
    for shard in shards:
        assert (reference(buf.numpy(), shard, box) == -1).all()
    assert int((buf == -1).sum()) == 2 * math.prod(box[1])  # nothing else written


def test_a_box_no_shard_holds_names_itself():
    shard = Shard("w", "w", (0, 4), (4, 4), (4, 4), "float32", 0)
    store = ShardStore((shard,), {"float32": torch.zeros(16)})
    with pytest.raises(KeyError, match=r"'w' containing offsets=\(0, 2\) sizes=\(4, 4\)"):
        store.view("w", (0, 2), (4, 4))
    with pytest.raises(KeyError, match="'b'"):
        store.view("b", (0,), (1,))


def test_stores_over_one_shards_tuple_share_an_index():
    shards = (Shard("w", "w", (0,), (4,), (6,), "float32", 0),)
    a = ShardStore(shards, {"float32": torch.zeros(6)})
    b = ShardStore(shards, {"float32": torch.ones(6)})
    assert a.index is b.index is ShardIndex.of(shards)
    assert ShardStore(list(shards), {"float32": torch.zeros(6)}).index is not a.index  # a list may change: not cached
    assert b.view("w", (1,), (2,)).tolist() == [1.0, 1.0]  # same addresses, each store's own buffers
    zero_padding(b)
    assert b.buffers["float32"].tolist() == [1, 1, 1, 1, 0, 0]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_copy_boxes_moves_exactly_the_bytes_of_per_pair_copies(data):
    """copy_boxes (grouped small copies, 8-byte words where rows allow) against one copy_ per
    pair: the same destination bits, misaligned offsets and odd row lengths included."""
    from realloc.shards import copy_boxes

    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.float64]))
    src = torch.arange(4096, dtype=torch.float64).to(dtype)
    got, want = torch.full((4096,), -1, dtype=dtype), torch.full((4096,), -1, dtype=dtype)
    outs, ins, refs, used = [], [], [], 0
    for _ in range(data.draw(st.integers(1, 5))):
        rows, cols = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 24))
        pitch_src = cols + data.draw(st.integers(0, 9))
        pitch_dst = cols + data.draw(st.integers(0, 9))
        off_src = data.draw(st.integers(0, 100))
        off_dst = used + data.draw(st.integers(0, 9))  # boxes of outs never overlap
        used = off_dst + rows * pitch_dst
        if used > 4096:
            break
        view = lambda t, off, pitch: t.as_strided((rows, cols), (pitch, 1), off)  # noqa: E731
        outs.append(view(got, off_dst, pitch_dst))
        ins.append(view(src, off_src, pitch_src))
        refs.append((view(want, off_dst, pitch_dst), view(src, off_src, pitch_src)))
    if not outs:
        return
    copy_boxes(outs, ins)
    for o, i in refs:
        o.copy_(i)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_stacked_runs_copy_exactly_the_layers_boxes(data):
    """Boxes repeated at a constant step in both buffers (a weight in every layer), shuffled and
    mixed with odd ones, some runs broken by a different step: stacking them must leave the
    destination bit-identical to one copy per pair, and must stack a clean run into one pair."""
    from realloc.shards import copy_boxes, stack_runs

    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]))
    layers = data.draw(st.integers(2, 7))
    rows, cols = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 12))
    pitch_s, pitch_d = cols + data.draw(st.integers(0, 6)), cols + data.draw(st.integers(0, 6))
    block_s = rows * pitch_s + data.draw(st.integers(0, 20))
    block_d = rows * pitch_d + data.draw(st.integers(0, 20))
    base_s, base_d = data.draw(st.integers(0, 30)), data.draw(st.integers(0, 30))
    src = torch.arange(8192, dtype=torch.float64).to(dtype)
    got, want = torch.full((8192,), 7, dtype=dtype), torch.full((8192,), 7, dtype=dtype)
    skip = data.draw(st.sets(st.integers(0, layers - 1), max_size=layers // 2))  # gaps break the step
    pairs = [(base_d + L * block_d, base_s + L * block_s) for L in range(layers) if L not in skip]
    for _ in range(data.draw(st.integers(0, 3))):  # odd boxes elsewhere in the destination
        pairs.append((4096 + 300 * len(pairs), data.draw(st.integers(0, 2000))))
    order = data.draw(st.permutations(range(len(pairs))))
    box = lambda t, off, pitch: t.as_strided((rows, cols), (pitch, 1), off)  # noqa: E731
    outs = [box(got, pairs[k][0], pitch_d) for k in order]
    ins = [box(src, pairs[k][1], pitch_s) for k in order]
    copy_boxes(outs, ins)
    for d, s_ in pairs:
        box(want, d, pitch_d).copy_(box(src, s_, pitch_s))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if not skip and len(pairs) == layers:
        stacked_o, _ = stack_runs(outs, ins)
        assert len(stacked_o) == 1 and stacked_o[0].shape == (layers, rows, cols)


def test_two_interleaved_weights_stack_into_one_copy_each():
    """Two weights of one shape in every layer (a decoder's two norms) interleave in the buffer;
    labelled by weight_kind, each stacks across the layers on its own."""
    from realloc.shards import copy_boxes, stack_runs, weight_kind

    layers, n, block = 6, 8, 40  # per layer: norm a at +0, norm b at +8, then other weights
    src = torch.arange(layers * block, dtype=torch.float32)
    got = torch.zeros(layers * 2 * n)
    outs, ins, kinds = [], [], []
    for layer in range(layers):
        for k, name in enumerate(("input_layernorm", "post_attention_layernorm")):
            outs.append(got[(2 * layer + k) * n : (2 * layer + k + 1) * n])
            ins.append(src[layer * block + k * n : layer * block + (k + 1) * n])
            kinds.append(weight_kind(f"model.layers.{layer}.{name}.weight"))
    assert kinds[0] == "model.layers.#.input_layernorm.weight"
    stacked, _ = stack_runs(outs, ins, kinds)
    assert sorted(tuple(t.shape) for t in stacked) == [(layers, n), (layers, n)]
    copy_boxes(outs, ins, kinds)
    want = torch.cat([src[layer * block : layer * block + 2 * n] for layer in range(layers)])
    assert torch.equal(got, want)
