"""The process groups user code gets on a worker: dp, fsdp, tp, pp and the expert groups of the current layout.

Each model group has its own rendezvous store (hosted by its rank-0 worker) and, on every
worker, one :class:`~actors.wire.communicator.Communicators` cache of private process groups over
it. :class:`ParallelGroups` names the groups of one rank of one layout:

* ``tp``: the ranks that share this rank's data-parallel coordinates and pipeline stage;
* ``dp``: the replicas of this rank's shard (same fsdp, tp and pp coordinate);
* ``fsdp``: the ranks sharding this rank's tp shard (FSDP2's shard group; one rank when fsdp=1);
* ``pp``: the stages of this rank's replica and tp coordinate;
* ``ep``, ``etp``, ``edp``: the expert-parallel, expert-tensor-parallel and expert-data-parallel
  groups of the expert mesh (Megatron's tp-ep-dp-pp order inside a stage, see
  :meth:`realloc.layout.topology.Topology.expert_coords`; with fsdp torchtitan's sparse mesh
  ``(dp_replicate, efsdp, ep)``, ``edp`` being its efsdp x dp_replicate ranks of the same experts);
  without expert parallelism ``ep`` is this rank alone, ``etp`` is ``tp`` and ``edp`` is ``dp``, as
  in Megatron-core;
* ``replica``: the ranks of this rank's model replica (its dp coordinate: every fsdp, tp and pp
  rank of it), over which ``ctx.safe_point()`` agrees;
* ``model``: every worker of the model group.

Group ranks follow the topology's rank order (tp fastest, then fsdp, dp and pp: torchtitan's
mesh order, Megatron's when fsdp=1),
so rank ``i`` of ``tp`` is tp rank ``i``. Groups are private (never torch's default group, and
never registered in it): user code may create its own default group and keep it. They are
created on first use (collective over the members only, like ``torch.distributed.new_group``
but without the non-members) and cached by their member ranks, so a loop that alternates two
layouts creates communicators in its first round only.
"""

from __future__ import annotations

from dataclasses import dataclass

from realloc.layout import Layout


@dataclass(frozen=True)
class GroupRanks:
    """The member ranks of each group of one rank of a layout (pure: no process groups)."""

    dp: tuple[int, ...]
    fsdp: tuple[int, ...]
    tp: tuple[int, ...]
    pp: tuple[int, ...]
    model: tuple[int, ...]
    ep: tuple[int, ...] = ()
    etp: tuple[int, ...] = ()
    edp: tuple[int, ...] = ()
    replica: tuple[int, ...] = ()

    @staticmethod
    def of(layout: Layout, rank: int) -> "GroupRanks":
        """Example:
        >>> from realloc import ModelSpec, Topology
        >>> GroupRanks.of(Layout(ModelSpec.preset("tiny"), Topology(dp=2, tp=2, pp=2)), 5)
        GroupRanks(dp=(5, 7), fsdp=(5,), tp=(4, 5), pp=(1, 5), model=(0, 1, 2, 3, 4, 5, 6, 7), ep=(5,), etp=(4, 5), edp=(5, 7), replica=(0, 1, 4, 5))
        >>> GroupRanks.of(Layout(ModelSpec.preset("tiny"), Topology(dp=2, fsdp=2, tp=2)), 5).fsdp
        (5, 7)
        """
        t = layout.topology
        dp_rank, fsdp_rank, tp_rank, pp_rank = t.coords4(rank)
        edp_rank, ep_rank, etp_rank, _ = t.expert_coords(rank)
        etp, stage = t.expert_tp, t.dp * t.fsdp * t.tp * pp_rank

        def expert_rank(edp: int, ep: int, etp_: int) -> int:
            return stage + etp_ + etp * (ep + t.ep * edp)

        dp = tuple(t.replica_ranks(tp_rank, pp_rank, fsdp_rank))
        tp = tuple(t.rank(dp_rank, i, pp_rank, fsdp_rank) for i in range(t.tp))
        if t.expert_parallel:
            experts = (
                tuple(expert_rank(edp_rank, i, etp_rank) for i in range(t.ep)),
                tuple(expert_rank(edp_rank, ep_rank, i) for i in range(etp)),
                tuple(t.expert_replica_ranks(etp_rank, ep_rank, pp_rank)),
            )
        else:  # ep is this rank alone, etp is tp, edp is dp (the expert mesh knows no fsdp)
            experts = ((rank,), tp, dp)
        return GroupRanks(
            dp=dp,
            fsdp=tuple(t.rank(dp_rank, tp_rank, pp_rank, i) for i in range(t.fsdp)),
            tp=tp,
            pp=tuple(t.rank(dp_rank, tp_rank, i, fsdp_rank) for i in range(t.pp)),
            model=tuple(range(t.world_size)),
            ep=experts[0],
            etp=experts[1],
            edp=experts[2],
            replica=tuple(r for r in range(t.world_size) if t.coords4(r)[0] == dp_rank),
        )


class _Axis:
    """A group of :class:`ParallelGroups` named by the attribute, created on first use, then cached."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, groups, owner=None):
        if groups is None:
            return self
        group = groups.__dict__[self.name] = groups._group(self.name)
        return group


class ParallelGroups:
    """The dp/fsdp/tp/pp/model process groups of rank ``rank`` of ``layout`` (``ctx.groups``).

    Valid while the worker holds that layout: read them again from the context after every
    change (the ``on_shards_changed`` hook gets a fresh context). ``ranks`` lists the members.

    Each property creates its group on first use: every member must ask for it (as every
    rank calls ``torch.distributed.new_group``), typically all workers in the same user call.
    Use them with ``torch.distributed`` collectives (``all_reduce``, ``all_gather``,
    ``broadcast(..., group_src=i)``) and, for point-to-point, ``group.send([t], peer, 0)`` /
    ``group.recv([t], peer, 0)`` with group ranks (``P2POp`` refuses unregistered groups).
    """

    def __init__(self, layout: Layout, rank: int, communicators):
        self.layout, self.rank = layout, rank
        self.ranks = GroupRanks.of(layout, rank)
        self._communicators = communicators

    def _group(self, axis: str):
        if self._communicators is None:
            raise RuntimeError("this worker has no process groups for user code yet (the group is still starting)")
        return self._communicators.group(getattr(self.ranks, axis))

    dp = _Axis()
    fsdp = _Axis()
    tp = _Axis()
    pp = _Axis()
    model = _Axis()
    ep = _Axis()
    etp = _Axis()
    edp = _Axis()
    replica = _Axis()

    def __repr__(self) -> str:
        return f"ParallelGroups(rank {self.rank} of {self.layout}, {self.ranks})"
