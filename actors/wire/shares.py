"""Each worker's share of a plan and the peers it sees: what the driver cuts once for all
workers (:func:`worker_shares`) and ships each worker (``actors/driver/protocol.py``
``worker_plan_refs``), and what a receiver checks before any traffic (``received_share`` in
``actors/wire/executor.py``). Both ends of a route read the same :class:`PeerView` data, so they
agree without talking on which routes are zero-copy reads (:func:`is_zero_copy`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from realloc.layout import RankLayout
from realloc.plan import Plan
from realloc.plan.slices import PlanSlice, slice_plan


@dataclass(frozen=True)
class PeerView:
    """What a worker needs to know of another worker for one plan (sent by the driver)."""

    world_rank: int
    node: str
    src: RankLayout | None  # what it holds (sends from) in this plan, None: not a source
    dst: RankLayout | None  # what it will hold (receives into), None: not a destination
    src_handles: Any = None  # zero-copy handles of its buffers, when on my node
    dst_handles: Any = None
    #: Whether it exports zero-copy handles (set when the handles travel between the workers
    #: themselves, ``ShardWorker.op_run``, instead of inside this view). None: decided by the
    #: presence of the handles above.
    shared: bool | None = None
    #: What its source buffers hold when that is ``src`` in another weight format (a sender that
    #: converts as it sends, realloc/plan/formats.py): a same-node reader maps them as this and
    #: converts what it reads, as the sender converts what it packs. None: they hold ``src``.
    held: RankLayout | None = None


def is_zero_copy(peers: list[PeerView], sender: int, receiver: int, forward: bool) -> bool:
    """Whether a route is a direct read of the sender's buffers by the receiver (for a worker that
    can map same-node buffers). Both ends evaluate it on the same shared data, so they agree."""
    a, b = peers[sender], peers[receiver]
    if a.node != b.node:
        return False
    if a.shared is not None:  # buffers exist exactly where the layout does
        return a.shared and (a.dst if forward else a.src) is not None
    return (a.dst_handles if forward else a.src_handles) is not None


class PeerTable:
    """The peers of one worker for one plan, as its slice ships them: every worker's world rank
    and node (two small arrays), and the full :class:`PeerView` (layouts, handles) of itself and
    of the same-node peers it exchanges with, the only ones whose buffers it may map. Indexed
    like the list of every worker's view it stands for; a view it does not hold in full is
    rebuilt from the arrays (a worker on another node: never mapped)."""

    def __init__(self, ranks: np.ndarray, node_of: np.ndarray, nodes: tuple[str, ...], views: dict[int, PeerView]):
        self.ranks, self.node_of, self.nodes, self.views = ranks, node_of, nodes, views

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, worker: int) -> PeerView:
        view = self.views.get(worker)
        if view is None:
            view = PeerView(int(self.ranks[worker]), self.nodes[self.node_of[worker]], None, None, shared=False)
        return view


def worker_shares(plan: Plan, peers: list[PeerView]) -> list[tuple[PlanSlice, PeerTable]]:
    """What each worker of ``plan`` receives: its :class:`~realloc.plan.slices.PlanSlice` and its
    :class:`PeerTable` (``peers[i]``: worker ``i``'s full view), cut once for all workers."""
    nodes = tuple(sorted({v.node for v in peers}))
    index = {n: i for i, n in enumerate(nodes)}
    ranks = np.array([v.world_rank for v in peers], dtype=np.int32)
    node_of = np.array([index[v.node] for v in peers], dtype=np.int32)
    out = []
    for piece in slice_plan(plan):
        me = piece.worker
        near = [w for w in piece.peers() if node_of[w] == node_of[me]]
        views = {w: peers[w] for w in (me, *near)}
        out.append((piece, PeerTable(ranks, node_of, nodes, views)))
    return out
