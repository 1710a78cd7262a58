"""The plan: plain data that every executor (in-process, Ray actors) runs the same way.

A plan is a table of *segments* (one box of one parameter), *segment lists* (interned, since
the dp replicas of a layout send identical lists), *local copies* (a worker copying bytes it
already holds into its destination buffers) and *steps*. Each step is a set of routes
``(src, dst, segment_list)`` in which every worker sends at most one route and receives at most
one, so executors that post a step's send and receive together and finish it before the next
step cannot deadlock: both ends of every route are in the same step.

Buckets are a pure function of a segment list and ``bucket_bytes`` (:func:`buckets`), so both
ends of a route cut it identically without shipping millions of bucket records.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

from realloc._checks import check_int, is_int
from realloc.boxes import Box, take_prefix
from realloc.spec import DTYPE_BYTES

#: Bytes each packed piece is aligned to inside a bucket, so typed views are always legal.
BUCKET_ALIGN = 16

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Segment:
    param: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str

    @property
    def box(self) -> Box:
        return self.offsets, self.sizes

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.sizes:
            n *= s
        return n


@dataclass(frozen=True)
class Piece(Segment):
    """Part of a segment inside one bucket, at byte ``offset`` of the bucket."""

    offset: int = 0


class Route(NamedTuple):
    """One transfer of a step: ``src`` sends segment list ``segment_list`` to ``dst`` (JSON: a list)."""

    src: int
    dst: int
    segment_list: int


@dataclass
class Plan:
    """A reallocation/exchange plan. See the module docstring for the model.

    Example:
        >>> from realloc import ModelSpec, Topology, Placement, plan_reallocation
        >>> spec = ModelSpec.preset("tiny")
        >>> plan = plan_reallocation(spec, Topology(tp=2), Topology(dp=2), Placement.blocks(2, 1))
        >>> plan.stats["bytes_inter_node"] == plan.stats["lower_bound_inter_node_bytes"]
        True
    """

    segments: Sequence[Segment]  # a list, or a SegmentTable from the planner
    segment_lists: list[Sequence[int]]  # tuples, or ranges into a SegmentTable
    local_copies: list[tuple[int, int]]
    steps: Sequence[list[Route]]  # lists, or a StepTable for large plans
    bucket_bytes: int
    nodes: tuple[str, ...]
    #: Steps from this index on forward bytes the sender received earlier in this plan (intra-node
    #: fan-out): the sender reads them from its destination buffers, not its source buffers.
    forward_from: int = 0
    stats: dict = field(default_factory=dict)
    #: Wall time the planner took. Not part of the plan's data (so ``dumps`` is deterministic).
    plan_seconds: float = field(default=0.0, compare=False)

    def __eq__(self, other: object) -> bool:
        """Equal plans move the same segments the same way, whatever containers hold them."""
        if not isinstance(other, Plan):
            return NotImplemented
        return (self.bucket_bytes, self.nodes, self.forward_from, self.stats, self.local_copies) == (
            other.bucket_bytes,
            other.nodes,
            other.forward_from,
            other.stats,
            other.local_copies,
        ) and (
            [tuple(x) for x in self.segment_lists] == [tuple(x) for x in other.segment_lists]
            and self.segments == other.segments
            and self.steps == other.steps
        )

    # -- derived views ------------------------------------------------------------------
    def segment_list(self, index: int) -> list[Segment]:
        return [self.segments[i] for i in self.segment_lists[index]]

    def list_bytes(self, index: int) -> int:
        return sum(self.segments[i].nbytes for i in self.segment_lists[index])

    def routes(self) -> Iterator[tuple[int, int, int, int]]:
        """``(step, src, dst, segment_list)`` of every route, in order."""
        for s, step in enumerate(self.steps):
            for src, dst, seg in step:
                yield s, src, dst, seg

    def worker_schedule(self, worker: int) -> list[tuple[int, list[tuple[str, int, int]]]]:
        """What ``worker`` does per step: ``(step, [("send"|"recv", peer, segment_list), ...])``.

        Steps where it has nothing to do are left out; each listed step has at most one send and
        one receive, to be posted together.
        """
        out = []
        for s, step in enumerate(self.steps):
            ops = [("send", dst, seg) for src, dst, seg in step if src == worker]
            ops += [("recv", src, seg) for src, dst, seg in step if dst == worker]
            if ops:
                out.append((s, ops))
        return out

    def reads_destination(self, step: int) -> bool:
        """Whether senders of ``step`` forward from their destination buffers."""
        return step >= self.forward_from

    def buckets(self, index: int) -> list[list[Piece]]:
        return buckets(self.segment_list(index), self.bucket_bytes)

    # -- serialisation -------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "bucket_bytes": self.bucket_bytes,
            "nodes": list(self.nodes),
            "forward_from": self.forward_from,
            "segments": [[s.param, list(s.offsets), list(s.sizes), s.dtype] for s in self.segments],
            "segment_lists": [list(x) for x in self.segment_lists],
            "local_copies": [list(x) for x in self.local_copies],
            "steps": [[list(r) for r in step] for step in self.steps],
            "stats": self.stats,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(data: dict) -> "Plan":
        """Rebuild a plan from :meth:`to_json` output; malformed input raises ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"a plan is a JSON object, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise ValueError(f"plan format {data.get('format')!r} is not supported (expected {PLAN_FORMAT})")
        missing = [
            k
            for k in ("bucket_bytes", "nodes", "forward_from", "segments", "segment_lists", "local_copies", "steps")
            if k not in data
        ]
        if missing:
            raise ValueError(f"plan JSON lacks {missing}")
        try:
            plan = Plan(
                segments=[Segment(p, tuple(o), tuple(s), d) for p, o, s, d in data["segments"]],
                segment_lists=[tuple(x) for x in data["segment_lists"]],
                local_copies=[(w, s) for w, s in data["local_copies"]],
                steps=[[Route(a, b, c) for a, b, c in step] for step in data["steps"]],
                bucket_bytes=data["bucket_bytes"],
                nodes=tuple(data["nodes"]),
                forward_from=data["forward_from"],
                stats=data.get("stats", {}),
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"malformed plan JSON: {err}") from None
        plan.validate()
        return plan

    def validate(self, num_workers: int | None = None) -> None:
        """``ValueError`` naming the first inconsistency, before any executor touches a buffer.

        Checks: segments have known dtypes and non-empty boxes; segment lists, local copies and
        routes name things that exist; worker ids are non-negative (and below ``num_workers``
        when given); in every step each worker sends at most once and receives at most once
        (the executors post one send and one receive per step: a second one would be dropped).
        """
        check_int("plan bucket_bytes", self.bucket_bytes, BUCKET_ALIGN)
        for i, seg in enumerate(self.segments):
            if seg.dtype not in DTYPE_BYTES:
                raise ValueError(
                    f"plan segment {i} ({seg.param!r}) has dtype {seg.dtype!r}, not one of {sorted(DTYPE_BYTES)}"
                )
            if (
                len(seg.offsets) != len(seg.sizes)
                or not seg.sizes
                or any(not isinstance(x, int) or x < 0 for x in seg.offsets)
                or any(not isinstance(x, int) or x < 1 for x in seg.sizes)
            ):
                raise ValueError(
                    f"plan segment {i} ({seg.param!r}) has an invalid box offsets={seg.offsets} sizes={seg.sizes}"
                )
        n_seg, n_lists = len(self.segments), len(self.segment_lists)
        if any(not isinstance(i, int) or not 0 <= i < n_seg for lst in self.segment_lists for i in lst):
            raise ValueError("malformed plan: a segment list names a segment that does not exist")
        if any(not isinstance(j, int) or not 0 <= j < n_lists for _, j in self.local_copies) or any(
            not isinstance(j, int) or not 0 <= j < n_lists for step in self.steps for _, _, j in step
        ):
            raise ValueError("malformed plan: a route names a segment list that does not exist")
        if not isinstance(self.forward_from, int) or not 0 <= self.forward_from <= len(self.steps):
            raise ValueError(f"plan forward_from {self.forward_from!r} is outside 0..{len(self.steps)}")
        limit = "" if num_workers is None else f" and below {num_workers}"
        workers = [w for w, _ in self.local_copies] + [w for step in self.steps for r in step for w in r[:2]]
        bad = [w for w in workers if not is_int(w) or w < 0 or (num_workers is not None and w >= num_workers)]
        if bad:
            raise ValueError(
                f"plan names worker(s) {sorted(set(map(str, bad)))[:5]} that do not exist "
                f"(worker ids are integers from 0{limit})"
            )
        for s, step in enumerate(self.steps):
            for end, verb in ((0, "send"), (1, "receive")):
                counts = Counter(route[end] for route in step)
                twice = sorted(w for w, n in counts.items() if n > 1)
                if twice:
                    raise ValueError(
                        f"plan step {s}: worker(s) {twice} {verb} more than once (one send and one "
                        "receive per worker per step)"
                    )


def _cuts(segments: list[Segment], bucket_bytes: int) -> Iterator["tuple[Segment, tuple, tuple, int] | None"]:
    """The pieces of :func:`buckets` in order, as ``(segment, offsets, sizes, byte offset)``;
    ``None`` between two buckets. A segment that fits the space left is one piece (what
    ``take_prefix`` would return, without calling it: the hot path of large plans)."""
    if bucket_bytes < BUCKET_ALIGN:
        raise ValueError(f"bucket_bytes must be at least {BUCKET_ALIGN}, got {bucket_bytes}")
    current, used = False, 0
    for seg in segments:
        item = DTYPE_BYTES[seg.dtype]
        start = -(-used // BUCKET_ALIGN) * BUCKET_ALIGN
        n = item * math.prod(seg.sizes)
        if start + n <= bucket_bytes:
            yield seg, seg.offsets, seg.sizes, start
            current, used = True, start + n
            continue
        pending = [seg.box]
        while pending:
            box = pending.pop(0)
            start = -(-used // BUCKET_ALIGN) * BUCKET_ALIGN
            head, rest = take_prefix(box, (bucket_bytes - start) // item)
            if head is None:
                if current:
                    yield None
                    current, used = False, 0
                    pending.insert(0, box)
                    continue
                head, rest = take_prefix(box, 1)  # one element larger than the cap
            yield seg, head[0], head[1], start
            current, used = True, start + item * math.prod(head[1])
            pending[:0] = rest


def buckets(segments: list[Segment], bucket_bytes: int) -> list[list[Piece]]:
    """Cut ``segments`` (in order) into buckets of at most ``bucket_bytes`` bytes.

    A segment larger than the space left is cut into leading boxes (whole rows when a row fits),
    so every bucket respects the cap except when a single element is larger than the cap.
    """
    out: list[list[Piece]] = [[]]
    for cut in _cuts(segments, bucket_bytes):
        if cut is None:
            out.append([])
        else:
            seg, offsets, sizes, start = cut
            out[-1].append(Piece(seg.param, offsets, sizes, seg.dtype, start))
    return [b for b in out if b]


def bucket_count(segments: list[Segment], bucket_bytes: int) -> int:
    """``len(buckets(segments, bucket_bytes))`` without building the pieces (plan statistics)."""
    breaks, pieces = 0, False
    for cut in _cuts(segments, bucket_bytes):
        if cut is None:
            breaks += 1
        else:
            pieces = True
    return breaks + pieces


def bucket_nbytes(bucket: list[Piece]) -> int:
    """Bytes a bucket buffer needs (end of its last piece)."""
    last = bucket[-1]
    n = DTYPE_BYTES[last.dtype]
    for s in last.sizes:
        n *= s
    return last.offset + n
