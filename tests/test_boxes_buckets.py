"""Box arithmetic and bucket cutting, checked element by element with numpy masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.boxes import contains, intersect, split_rows, take_prefix
from realloc.plan import BUCKET_ALIGN, Segment, bucket_count, bucket_nbytes, buckets
from realloc.spec import DTYPE_BYTES

SHAPE_DIMS = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@st.composite
def box_in(draw, shape):
    offsets, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n - 1))
        offsets.append(o)
        sizes.append(draw(st.integers(1, n - o)))
    return tuple(offsets), tuple(sizes)


@st.composite
def shape_and_boxes(draw, count):
    shape = draw(SHAPE_DIMS)
    return shape, [draw(box_in(shape)) for _ in range(count)]


def mask(shape, box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[tuple(slice(o, o + n) for o, n in zip(*box))] = True
    return m


def flat_start(shape, box) -> int:
    return int(np.ravel_multi_index(box[0], shape))


@settings(max_examples=100, deadline=None)
@given(shape_and_boxes(2))
def test_intersect_is_the_elementwise_and(case):
    shape, (a, b) = case
    both = mask(shape, a) & mask(shape, b)
    got = intersect(a, b)
    if not both.any():
        assert got is None
    else:
        assert got is not None and np.array_equal(mask(shape, got), both)
    assert intersect(a, b) == intersect(b, a)


@settings(max_examples=100, deadline=None)
@given(shape_and_boxes(2))
def test_contains_is_mask_inclusion(case):
    shape, (outer, inner) = case
    assert contains(outer, inner) == bool(np.all(mask(shape, outer)[mask(shape, inner)]))
    assert contains(outer, outer)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(0, 5), st.integers(1, 3), st.integers(1, 12))
def test_split_rows_tiles_the_box_in_near_equal_row_blocks(rows, first_row, cols, parts):
    shape = (first_row + rows, cols + 1)
    box = ((first_row, 1), (rows, cols))
    pieces = split_rows(box, parts)
    assert len(pieces) == min(parts, rows)
    counts = sum(mask(shape, p).astype(int) for p in pieces)
    assert np.array_equal(counts, mask(shape, box).astype(int)), "pieces must cover the box exactly once"
    sizes = [p[1][0] for p in pieces]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, f"row blocks {sizes} are not near-equal"
    assert all(p[0][1:] == box[0][1:] and p[1][1:] == box[1][1:] for p in pieces), "only dim 0 is cut"
    assert [p[0][0] for p in pieces] == sorted(p[0][0] for p in pieces)


@settings(max_examples=150, deadline=None)
@given(shape_and_boxes(1), st.integers(-2, 40))
def test_take_prefix_cuts_a_bounded_leading_piece(case, cap):
    shape, (box,) = case
    head, rest = take_prefix(box, cap)
    if cap <= 0:
        assert head is None and rest == [box]
        return
    assert head is not None, "any cap of at least one element makes progress"
    assert math.prod(head[1]) <= cap
    if math.prod(box[1]) <= cap:
        assert head == box and rest == []
    pieces = [head, *rest]
    counts = sum(mask(shape, p).astype(int) for p in pieces)
    assert np.array_equal(counts, mask(shape, box).astype(int)), "head and remainder must tile the box"
    # the head leads: it holds the first element of the box in row-major order
    assert head[0] == box[0]


@settings(max_examples=100, deadline=None)
@given(shape_and_boxes(1), st.integers(1, 12))
def test_repeated_take_prefix_tiles_the_box_in_row_major_order(case, cap):
    shape, (box,) = case
    pending, pieces = [box], []
    while pending:
        head, rest = take_prefix(pending.pop(0), cap)
        pieces.append(head)
        pending[:0] = rest
    assert all(math.prod(p[1]) <= cap for p in pieces)
    counts = sum(mask(shape, p).astype(int) for p in pieces)
    assert np.array_equal(counts, mask(shape, box).astype(int))
    starts = [flat_start(shape, p) for p in pieces]
    assert starts == sorted(starts), "pieces must come in row-major order"


@st.composite
def segment_lists(draw):
    segs = []
    for i in range(draw(st.integers(1, 6))):
        shape = draw(SHAPE_DIMS)
        offsets, sizes = draw(box_in(shape))
        dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
        segs.append((shape, Segment(f"p{i}", offsets, sizes, dtype)))
    return segs


@settings(max_examples=150, deadline=None)
@given(segment_lists(), st.integers(BUCKET_ALIGN, 200))
def test_buckets_respect_the_cap_alignment_and_tile_segments_in_order(case, cap):
    shapes = {seg.param: shape for shape, seg in case}
    segments = [seg for _, seg in case]
    out = buckets(segments, cap)
    assert all(out), "no empty bucket"
    order = []  # segment index of each piece, bucket by bucket
    covered = {seg.param: np.zeros(shapes[seg.param], dtype=int) for seg in segments}
    for bucket in out:
        end = 0
        for piece in bucket:
            item = DTYPE_BYTES[piece.dtype]
            assert piece.offset % BUCKET_ALIGN == 0
            assert piece.offset >= end, "pieces of a bucket must not overlap"
            end = piece.offset + math.prod(piece.sizes) * item
            order.append(int(piece.param[1:]))
            covered[piece.param] += mask(shapes[piece.param], piece.box)
            seg = segments[order[-1]]
            assert piece.dtype == seg.dtype
        assert bucket_nbytes(bucket) == end
        single_big = len(bucket) == 1 and math.prod(bucket[0].sizes) == 1
        assert end <= cap or single_big, f"bucket of {end} bytes over the cap {cap}"
    assert order == sorted(order), "segments must be packed in order"
    for seg in segments:
        assert np.array_equal(covered[seg.param], mask(shapes[seg.param], seg.box).astype(int)), (
            f"pieces of {seg.param} must tile its box exactly once"
        )
    # within a segment pieces come in row-major order
    for seg in segments:
        starts = [flat_start(shapes[seg.param], p.box) for b in out for p in b if p.param == seg.param]
        assert starts == sorted(starts)


def test_bucket_cap_below_alignment_is_refused():
    with pytest.raises(ValueError):
        buckets([Segment("w", (0,), (4,), "float32")], BUCKET_ALIGN - 1)


def test_buckets_fill_a_bucket_before_opening_the_next():
    """A segment larger than the space left is cut, not moved whole to a fresh bucket."""
    segs = [Segment("a", (0,), (3,), "float32"), Segment("b", (0, 0), (10, 4), "float32")]
    out = buckets(segs, 64)
    # 'a' takes 12 bytes; 'b' starts at the aligned offset 16, leaving room for 3 rows of 16 bytes
    assert [(p.param, p.offset, p.sizes) for p in out[0]] == [("a", 0, (3,)), ("b", 16, (3, 4))]
    assert all(bucket_nbytes(b) <= 64 for b in out)


@settings(max_examples=300, deadline=None)
@given(segment_lists(), st.integers(BUCKET_ALIGN, 200))
def test_bucket_count_is_the_number_of_buckets(case, cap):
    segments = [seg for _, seg in case]
    assert bucket_count(segments, cap) == len(buckets(segments, cap))
    assert bucket_count(segments * 3, cap) == len(buckets(segments * 3, cap))
