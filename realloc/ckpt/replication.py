"""Clique replication and retrieval after a loss, as inputs to the one exchange planner.

Each rank file is a pseudo-parameter ``ckpt/rank<r>``: a 1-D ``uint8`` tensor of the file's
bytes. Replication is then ``holdings`` = the writer of each file, ``needs`` = one clique member
on every other node of its clique; retrieval is ``holdings`` = every worker on a node whose
directory has a usable copy (any of them can read it), ``needs`` = the rank itself. The planner
does the rest: a worker whose own node has the file copies it locally, a file missing on a
node enters it once, and senders are balanced over the holder nodes (a file held by several
nodes is pulled in parts from all of them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

from realloc._checks import check_positive
from realloc.layout import Group
from realloc.plan import Placement, Plan

FILE_PREFIX = "ckpt/rank"


def cliques(world_size: int, jump: int, factor: int) -> list[tuple[int, ...]]:
    """Replica cliques: ranks ``n, n+J, ..., n+(F-1)J`` hold each other's files.

    Ranks are cut into blocks of ``J*F``; inside a block, ranks congruent mod ``J`` form a clique.
    With ``J`` = workers per node the members sit on ``F`` different nodes.

    Example:
        >>> cliques(8, jump=4, factor=2)
        [(0, 4), (1, 5), (2, 6), (3, 7)]
        >>> cliques(12, jump=2, factor=3)[:2]
        [(0, 2, 4), (1, 3, 5)]
    """
    for name, value in (("world size", world_size), ("replication jump", jump), ("replication factor", factor)):
        check_positive(name, value)
    block = jump * factor
    if world_size % block:
        raise ValueError(
            f"world size {world_size} is not divisible by jump*factor = {jump}*{factor} = {block}; "
            f"choose jump and factor whose product divides {world_size}"
        )
    return [
        tuple(start + offset + k * jump for k in range(factor))
        for start in range(0, world_size, block)
        for offset in range(jump)
    ]


def file_param(rank: int) -> str:
    return f"{FILE_PREFIX}{rank}"


def rank_of(param: str) -> int:
    if not param.startswith(FILE_PREFIX):
        raise ValueError(f"{param!r} is not a checkpoint file pseudo-parameter")
    return int(param[len(FILE_PREFIX) :])


def file_table(file_bytes: Mapping[int, int]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Planner parameter table of the rank files (name -> ((bytes,), "uint8"))."""
    return {file_param(r): ((n,), "uint8") for r, n in sorted(file_bytes.items())}


def _whole(rank: int, nbytes: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return file_param(rank), (0,), (nbytes,)


def replication_groups(
    file_bytes: Mapping[int, int], placement: Placement, jump: int, factor: int
) -> tuple[list[Group], list[Group]]:
    """Holdings and needs that put every file on every node of its clique (once per node).

    Example:
        >>> hold, need = replication_groups({0: 10, 1: 10}, Placement(("a", "b")), 1, 2)
        >>> [(g.workers, g.pieces[0][0]) for g in need]
        [((1,), 'ckpt/rank0'), ((0,), 'ckpt/rank1')]
    """
    world = placement.num_workers
    if sorted(file_bytes) != list(range(world)):
        raise ValueError(
            f"replication needs the file size of every rank 0..{world - 1}, got ranks {sorted(file_bytes)}"
        )
    holdings = [Group((r,), (_whole(r, n),)) for r, n in sorted(file_bytes.items())]
    needs = []
    for clique in cliques(world, jump, factor):
        for r in clique:
            covered = {placement.nodes[r]}
            for m in clique:
                if placement.nodes[m] not in covered:  # a node needs each file once
                    covered.add(placement.nodes[m])
                    needs.append(Group((m,), (_whole(r, file_bytes[r]),)))
    return holdings, needs


def retrieval_groups(
    copies: Mapping[int, Iterable[str]], file_bytes: Mapping[int, int], placement: Placement, ranks: Iterable[int]
) -> tuple[list[Group], list[Group]]:
    """Holdings (all workers of each node with a usable copy) and needs (each rank its own file).

    Example:
        >>> hold, need = retrieval_groups({0: {"b"}}, {0: 8}, Placement(("a", "b")), [0])
        >>> hold[0].workers, need[0].workers
        ((1,), (0,))
    """
    holdings = []
    ranks = list(ranks)
    for r in ranks:
        for node in sorted(copies.get(r, ())):
            workers = tuple(placement.workers_on(node))
            if workers:  # a node without live workers is not readable
                holdings.append(Group(workers, (_whole(r, file_bytes[r]),)))
    held = {rank_of(g.pieces[0][0]) for g in holdings}
    lacking = [r for r in ranks if r not in held]
    if lacking:
        raise ValueError(f"ranks {lacking} have no usable copy on a node with live workers")
    needs = [Group((r,), (_whole(r, file_bytes[r]),)) for r in ranks]
    return holdings, needs


def files_read_by(plan: Plan) -> dict[int, set[int]]:
    """Rank files each worker must read from its node's directory to run ``plan``.

    Local copies and phase-0 sends read files; forwarding steps send bytes already received.
    """
    out: dict[int, set[int]] = defaultdict(set)
    for worker, j in plan.local_copies:
        out[worker] |= {rank_of(s.param) for s in plan.segment_list(j)}
    for s, src, _, j in plan.routes():
        if not plan.reads_destination(s):
            out[src] |= {rank_of(seg.param) for seg in plan.segment_list(j)}
    return dict(out)
