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
:class:`DeltaSides`); otherwise it is an anchor: a full move. Either way the senders' bases hold
what they sent once their part is done, tagged with ``version``: brought up to date word by word
as the deltas were encoded where that covered every shard, else copied (:func:`snapshot`). From
the start of a delta move until it is done a sender's base is tagged with no version (-1), so a
failed move leaves bases that send whole buckets.

Nothing trusts the bookkeeping alone: a sender whose base is not tagged ``base`` sends its
buckets whole, and every delta bucket is checked against the checksum of the sender's bucket, a
miss sending it whole (so a destination changed behind the driver's back, a restarted worker, or
a failed move that left the senders' bases newer than the destination still ends bit-exact).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from actors.records import DELTA_COUNTERS, DeltaOrder
from realloc.layout import RankLayout
from realloc.plan import bucket_nbytes
from realloc.shards import ShardStore, local_copies, pack_copies, unpack_copies
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
    and the sender sends those buckets whole.

    Where a bucket's boxes can be compared as 16-bit words where they are
    (:func:`realloc.shards.delta.bucket_words`: every bucket of bf16/fp32 weights), nothing is
    packed: the sender compares its weights' boxes with its base's, writes the delta into the
    ``delta-out`` slot and checksums its boxes in bucket order (gaps as zeros), and brings its
    base up to date with the changed words of each box it sends for the last time in the move
    (:meth:`DeltaRoute.encoded`; after the move :func:`updated_in_place` copies the shards it sent
    none of, and the base is what was sent without a :func:`snapshot`); the receiver copies its
    base's boxes into its destination (nothing when the destination is the base), writes the
    changed words there and checksums the boxes. Otherwise (one-byte elements, a box held twice,
    a base on another device) a bucket is packed as before: five slots of one bucket
    (``delta-new``, ``delta-base``, ``delta-out`` on the sending side, ``delta-in``,
    ``delta-patch`` on the receiving side), the gaps between its pieces zeroed, so a sender's and
    a receiver's packed bucket agree byte for byte when their weights do. Both forms put the same
    bytes on the wire.
    """

    src_base: ShardStore | None
    dst_base: ShardStore | None
    stats: dict = field(default_factory=lambda: dict.fromkeys(DELTA_COUNTERS, 0))
    #: Sends of each box (piece key) left in this move, on this worker's own sends (filled by the
    #: first :class:`DeltaRoute` that sends), and the boxes that overlap another one sent.
    left: Counter | None = None
    overlapping: set = field(default_factory=set)
    #: The boxes whose ``src_base`` was brought up to date in place as they were sent.
    updated: set = field(default_factory=set)

    def unsent(self) -> list[str] | None:
        """The params of ``src_base`` this worker sent none of (their shards to copy into the base
        whole) when the boxes updated in place are the whole of every other shard: then the base
        is what was sent once those are copied (:func:`snapshot`'s work, without copying what was
        sent). None when some shard was sent in part or is held twice (or there is no base)."""
        if self.src_base is None:
            return None
        volume: dict[str, int] = {}
        for param, _, sizes in self.updated:
            volume[param] = volume.get(param, 0) + math.prod(sizes)
        unsent = []
        for param, shards in self.src_base.index.by_param.items():
            if len(shards) != 1:
                return None
            if param not in volume:
                unsent.append(param)
            elif volume[param] != math.prod(shards[0].sizes):
                return None
        return unsent


def updated_in_place(sides: DeltaSides | None, sent: ShardStore) -> bool:
    """Bring ``sides.src_base`` up to ``sent`` (the store this worker sent from, in the base's
    layout) where the move did not (:meth:`DeltaSides.unsent`): True when the base is now what was
    sent, False when it needs a :func:`snapshot`."""
    unsent = sides.unsent() if sides is not None else None
    if unsent is None:
        return False
    for param in unsent:
        (shard,) = sides.src_base.index.by_param[param]
        sides.src_base.view(param, shard.offsets, shard.sizes).copy_(sent.view(param, shard.offsets, shard.sizes))
    return True


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

        in_place = recv is not None and d.dst_base is not None and _same_memory(d.dst_base, r.dst)
        header_in = torch.empty(DELTA_HEADER, dtype=torch.int64, device=r.device)
        for i in range(max(len(send_b), len(recv_b))):
            out = payload = None
            compared = self.compared(new_from, base_from, send_b[i]) if i < len(send_b) else None
            if compared is not None:
                payload, head = self.encoded(
                    send_b[i],
                    compared,
                    packed=lambda: packed("delta-new", new_from, side, send[1], i, send_b[i]),
                    own=not forward,
                )
                out = (to, torch.tensor(head, dtype=torch.int64, device=r.device))
            elif i < len(send_b):
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
                elif (written := self.written(recv[1], i, bucket, in_place)) is not None:
                    empty = torch.empty(0, dtype=torch.uint8, device=r.device)
                    pos, values = deltas.decode(
                        landing if landing is not None else empty, entries, bucket_nbytes(bucket)
                    )
                    deltas.scatter_words(written, [p.offset // 2 for p in bucket], pos, values)
                    if deltas.checksum_boxes(written, bucket) == check:
                        st["delta"] += 1
                    else:
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

    def compared(self, new_from: ShardStore, base_from: ShardStore | None, bucket: list) -> tuple | None:
        """Sent bucket ``bucket`` as word boxes of ``new_from`` (what is sent) and of ``base_from``
        (its base), compared where they are (:func:`realloc.shards.delta.bucket_words`), or None
        where it is not (no base; a bucket that cannot be; a base on another device)."""
        if base_from is None:
            return None
        new = deltas.bucket_words([new_from.views(p.param, p.offsets, p.sizes) for p in bucket], bucket)
        base = deltas.bucket_words([base_from.views(p.param, p.offsets, p.sizes) for p in bucket], bucket)
        if new is None or base is None or any(a.device != b.device for a, b in zip(new[0], base[0])):
            return None
        return new[0], base[0], new[1]

    def encoded(self, bucket: list, compared: tuple, packed, own: bool) -> tuple[torch.Tensor, list[int]]:
        """The payload and header of a sent bucket compared in place (:meth:`compared`): its
        delta, or the bucket whole (``packed()``) when the delta is not smaller. ``own``: sent
        from this worker's weights against its ``src_base`` (not forwarded): then the base of each
        box sent for the last time in this move (and overlapping no other box sent) is brought up
        to date here, with the changed words (or the whole box when it travels whole)."""
        r, d = self.runner, self.sides
        new, base, starts = compared
        nbytes = bucket_nbytes(bucket)
        if own and d.left is None:
            d.left, d.overlapping = _sent_boxes(r)
        keys = [(p.param, p.offsets, p.sizes) for p in bucket]
        update = []
        for k in keys:
            if own:
                d.left[k] -= 1
            update.append(own and d.left[k] == 0 and k not in d.overlapping)
        slot = r.staging.get("delta-out", nbytes)
        enc = deltas.encode_words(new, base, starts, nbytes, slot)
        if enc is None:
            payload, head = packed(), [0, nbytes, 0, 0]
            for w, b, u in zip(new, base, update):
                if u:
                    b.copy_(w)
        else:
            n, pos, values = enc
            head = [1, deltas.delta_nbytes(n, nbytes), n, deltas.checksum_boxes(new, bucket)]
            payload = slot[: head[1]]
            deltas.scatter_words([b if u else None for b, u in zip(base, update)], starts, pos, values)
        d.updated.update(k for k, u in zip(keys, update) if u)
        return payload, head

    def written(self, j: int, i: int, bucket: list, in_place: bool) -> list | None:
        """Received bucket ``i`` of segment list ``j``'s destination boxes as words, holding the
        receiver's base (copied from ``dst_base`` unless the destination is it), for a delta to be
        written into; None where they cannot be (the bucket is then packed and unpacked)."""
        r, d = self.runner, self.sides
        dst = deltas.bucket_words([r.dst.views(p.param, p.offsets, p.sizes) for p in bucket], bucket)
        base = deltas.bucket_words([d.dst_base.views(p.param, p.offsets, p.sizes) for p in bucket], bucket)
        if dst is None or base is None or any(a.device != b.device for a, b in zip(dst[0], base[0])):
            return None
        if not in_place:
            r.cuts.programs.run(
                ("delta-base", j, i),
                lambda: local_copies(d.dst_base, r.dst, bucket),
                r.dst.buffers,
                d.dst_base.buffers,
            )
        return dst[0]

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


def _sent_boxes(r: StepRunner) -> tuple[Counter, set]:
    """The boxes (piece keys) worker ``r.me`` sends from its own weights in its plan, with how
    many times each, and those that overlap another box it sends (their bases are never updated
    in place: the next send of the overlapping box would compare against a base moved on)."""
    count: Counter = Counter()
    for s, routes in r.plan.routes_by_step().items():
        if r.plan.reads_destination(s):
            continue
        for a, b, j in routes:
            if a == r.me and not r.zero_copy(a, b, False):
                count.update((p.param, p.offsets, p.sizes) for bucket in r.buckets(j) for p in bucket)
    by_param: dict[str, list] = {}
    for k in count:
        by_param.setdefault(k[0], []).append(k)
    overlapping = set()
    for keys in by_param.values():
        for x, a in enumerate(keys):
            for b in keys[x + 1 :]:
                if all(max(o1, o2) < min(o1 + s1, o2 + s2) for o1, s1, o2, s2 in zip(a[1], a[2], b[1], b[2])):
                    overlapping.update((a, b))
    return count, overlapping
