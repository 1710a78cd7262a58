"""Delta moves on the wire: the copy of the weights each sender keeps, and what it computes its
deltas against (issue 24). The order the driver sends is :class:`actors.records.DeltaOrder`.

A group created with ``GroupConfig(delta="host")`` (or ``"device"``) keeps, on every worker, a
copy of the weights it last sent (its *base*: one shard per worker, in host memory or beside the
buffers), tagged with the layout it sent from and the weight version. A move with ``delta=True``
(``copy_to``, its staged form, ``reallocate`` back to a kept layout) then carries a
:class:`~actors.records.DeltaOrder`: when the driver knows that the destination holds exactly that version
(a copy it made from this group and nothing wrote since; a kept layout of that version) and the
destination has not taken ``GroupConfig.delta_anchor_every - 1`` deltas in a row, ``base`` names
the version and every transport route travels as deltas (:class:`DeltaRoute` below, with
:class:`DeltaSides`); otherwise it is an anchor: a full move. Either way the
senders copy what they sent into their base once their part is done, tagged with ``version``.

Nothing trusts the bookkeeping alone: a sender whose base is not tagged ``base`` sends its
buckets whole, and every delta bucket is checked against the checksum of the sender's bucket, a
miss sending it whole (so a destination changed behind the driver's back, a restarted worker, or
a failed move that left the senders' bases newer than the destination still ends bit-exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from actors.records import DELTA_COUNTERS, DeltaOrder
from realloc.layout import RankLayout
from realloc.plan import bucket_nbytes
from realloc.shards import ShardStore, pack_copies, unpack_copies
from realloc.shards import delta as deltas

if TYPE_CHECKING:
    from actors.wire.executor import StepRunner


@dataclass
class Base:
    """A worker's copy of the weights it last sent: ``held`` is the layout it sent from,
    ``version`` the weight version, ``buffers`` a copy of that layout's buffers."""

    held: RankLayout
    version: int
    buffers: dict[str, torch.Tensor]

    def store(self) -> ShardStore:
        return ShardStore(self.held.shards(), self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def sender_base(base: Base | None, held: RankLayout | None, order: DeltaOrder) -> ShardStore | None:
    """The store a sender computes its deltas against: its base, if it is of the layout it sends
    from and of the order's base version (else None: it sends whole buckets)."""
    if base is None or held is None or order.base is None or base.held != held or base.version != order.base:
        return None
    return base.store()


def snapshot(base: Base | None, held: RankLayout, buffers: dict[str, torch.Tensor], order: DeltaOrder) -> Base:
    """The base after sending ``buffers`` (layout ``held``) at ``order.version``: the old base's
    memory reused when it fits, else new buffers where ``order.where`` says."""
    device = next(iter(buffers.values())).device if buffers else torch.device("cpu")
    place = torch.device("cpu") if order.where == "host" else device
    fits = (
        base is not None
        and base.buffers.keys() == buffers.keys()
        and all(
            base.buffers[k].shape == b.shape and base.buffers[k].dtype == b.dtype and base.buffers[k].device == place
            for k, b in buffers.items()
        )
    )
    if fits:
        copies = base.buffers
    else:
        pin = place.type == "cpu" and device.type == "cuda"
        copies = {k: torch.empty(b.shape, dtype=b.dtype, device=place, pin_memory=pin) for k, b in buffers.items()}
    for k, b in buffers.items():
        copies[k].copy_(b)
    return Base(held, order.version, copies)


@dataclass
class DeltaSides:
    """What a worker needs to run its routes as deltas (issue 24; ``realloc/shards/delta.py``).

    ``src_base``: the weights this worker last sent, in the layout it sends from now (None: it has
    none that match the move's base version; it sends every bucket whole). ``dst_base``: what its
    destination held before the move, in the destination's layout (its serving buffers for a
    copy, the kept layout itself for a refresh in place; None: nothing usable, every delta it
    receives fails its checksum and is sent again whole). ``stats`` counts buckets and wire bytes.

    Per bucket, in lockstep with the peer: a header ``[whole 0 / delta 1, payload bytes, entries,
    checksum of the new bucket]``, then the payload (the delta, or the packed bucket). After a
    route's last bucket the receiver returns one flag per bucket (its delta missed the checksum),
    and the sender sends those buckets whole. Staging: five slots of one bucket (``delta-new``,
    ``delta-base``, ``delta-out`` on the sending side, ``delta-in``, ``delta-patch`` on the
    receiving side); a bucket packed for a delta has the gaps between its pieces zeroed, so a
    sender's and a receiver's packed bucket agree byte for byte when their weights do.
    """

    src_base: ShardStore | None
    dst_base: ShardStore | None
    stats: dict = field(default_factory=lambda: dict.fromkeys(DELTA_COUNTERS, 0))


def _same_memory(a: ShardStore, b: ShardStore) -> bool:
    """Whether two stores share buffer memory (a kept layout refreshed in place is both a
    destination and its own base: two store objects over the same tensors)."""
    mine = {t.untyped_storage().data_ptr() for t in a.buffers.values()}
    return any(t.untyped_storage().data_ptr() in mine for t in b.buffers.values())


#: Bytes of a delta bucket's header: four int64.
DELTA_HEADER = 4


class DeltaRoute:
    """One step's send and receive of a :class:`~actors.wire.executor.StepRunner` as deltas
    (:class:`DeltaSides`), handed the runner: its transport, stores, staging, cuts and peers.
    Both ends run it in lockstep (``StepRunner.run_step`` picks it when the runner has sides)."""

    def __init__(self, runner: StepRunner):
        self.runner, self.sides = runner, runner.delta

    def run(self, send, recv, forward: bool) -> list[tuple[str, int]]:
        """This step's send and receive as deltas, bucket by bucket, then the repair of the
        buckets whose delta missed its checksum (see :class:`DeltaSides`)."""
        r = self.runner
        d, st = self.sides, self.sides.stats
        new_from = r.dst if forward else r.src
        base_from = d.src_base
        if forward:  # a fan-out sender forwards its destination: its base is what that held, if not overwritten
            base_from = d.dst_base if d.dst_base is not None and not _same_memory(d.dst_base, r.dst) else None
        send_b = r.buckets(send[1]) if send else []
        recv_b = r.buckets(recv[1]) if recv else []
        to = r.peers[send[0]].world_rank if send else None
        frm = r.peers[recv[0]].world_rank if recv else None
        bad: list[int] = []

        side = "dst" if forward else "src"  # the layout the sent buckets are packed from

        def packed(slot: str, store: ShardStore, layout: str, j: int, i: int, bucket: list) -> torch.Tensor:
            """Bucket ``i`` of segment list ``j`` packed from ``store`` (in the ``layout`` side's
            layout: the program key names it) into staging slot ``slot``."""
            out = r.staging.get(slot, bucket_nbytes(bucket))
            r.cuts.programs.run(
                ("delta-pack", j, i, layout),
                lambda: pack_copies(store, bucket, out),
                {"staging": out},
                store.buffers,
            )
            gaps = r.cuts.gaps.get((j, i))
            if gaps is None:
                gaps = r.cuts.gaps[j, i] = deltas.gap_positions(bucket, r.device)
            if gaps.numel():
                out[gaps] = 0  # what an earlier bucket left between the pieces: both ends compare zeros
            return out

        def unpacked(j: int, i: int, bucket: list, data: torch.Tensor) -> None:
            r.cuts.programs.run(
                ("delta-unpack", j, i),
                lambda: unpack_copies(r.dst, bucket, data),
                r.dst.buffers,
                {"staging": data},
            )

        header_in = torch.empty(DELTA_HEADER, dtype=torch.int64, device=r.device)
        for i in range(max(len(send_b), len(recv_b))):
            out = payload = None
            if i < len(send_b):
                new = packed("delta-new", new_from, side, send[1], i, send_b[i])
                entries = None
                if base_from is not None:
                    base = packed("delta-base", base_from, side, send[1], i, send_b[i])
                    slot = r.staging.get("delta-out", new.numel())
                    entries = deltas.encode(new, base, slot)
                if entries is None:
                    payload, head = new, [0, new.numel(), 0, 0]
                else:
                    payload = slot[: deltas.delta_nbytes(entries, new.numel())]
                    head = [1, payload.numel(), entries, deltas.checksum(new)]
                out = (to, torch.tensor(head, dtype=torch.int64, device=r.device))
            into = (frm, header_in) if i < len(recv_b) else None
            for work in r.transport.exchange(out, into):
                work.wait()
            kind, size, entries, check = header_in.tolist() if into is not None else (0, 0, 0, 0)
            landing = r.staging.get("delta-in", size) if into is not None and size else None
            ops_out = (to, payload) if out is not None and payload.numel() else None
            ops_in = (frm, landing) if landing is not None else None
            if ops_out or ops_in:
                for work in r.transport.exchange(ops_out, ops_in):
                    work.wait()
            if into is not None:
                bucket = recv_b[i]
                st["buckets"] += 1
                st["bytes"] += bucket_nbytes(bucket)
                st["wire_bytes"] += 8 * DELTA_HEADER + size
                if kind == 0:
                    st["whole"] += 1
                    if size:
                        unpacked(recv[1], i, bucket, landing)
                elif d.dst_base is None:
                    bad.append(i)
                else:
                    patch = packed("delta-patch", d.dst_base, "dst", recv[1], i, bucket)
                    deltas.apply(landing if landing is not None else patch[:0], entries, patch)
                    if deltas.checksum(patch) == check:
                        st["delta"] += 1
                        unpacked(recv[1], i, bucket, patch)
                    else:
                        bad.append(i)
            if r.on_bucket is not None:
                r.on_bucket()
        self.repair(
            send,
            recv,
            send_b,
            recv_b,
            bad,
            lambda i: packed("delta-new", new_from, side, send[1], i, send_b[i]),
            unpacked,
        )
        return r.received(recv)

    def repair(self, send, recv, send_b, recv_b, bad, packed_new, unpacked) -> None:
        """After a delta route: one flag per received bucket goes back to its sender (1: its delta
        missed the checksum), and the flagged buckets travel whole (``packed_new(i)``: sent
        bucket ``i`` packed)."""
        r = self.runner
        to = r.peers[send[0]].world_rank if send else None
        frm = r.peers[recv[0]].world_rank if recv else None
        flags_in = torch.zeros(len(send_b), dtype=torch.uint8, device=r.device) if send_b else None
        flags_out = None
        if recv_b:
            flags_out = torch.zeros(len(recv_b), dtype=torch.uint8)
            flags_out[bad] = 1
            flags_out = flags_out.to(r.device)
            self.sides.stats["wire_bytes"] += len(recv_b)
        for work in r.transport.exchange(
            (frm, flags_out) if flags_out is not None else None, (to, flags_in) if flags_in is not None else None
        ):
            work.wait()
        resend = flags_in.nonzero().view(-1).tolist() if flags_in is not None else []
        for k in range(max(len(resend), len(bad))):
            out = into = None
            if k < len(resend):
                i = resend[k]
                out = (to, packed_new(i))
            if k < len(bad):
                i = bad[k]
                into = (frm, r.staging.get("delta-in", bucket_nbytes(recv_b[i])))
            for work in r.transport.exchange(out, into):
                work.wait()
            if into is not None:
                unpacked(recv[1], bad[k], recv_b[bad[k]], into[1])
                self.sides.stats["repaired"] += 1
                self.sides.stats["wire_bytes"] += into[1].numel()
