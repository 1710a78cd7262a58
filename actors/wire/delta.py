"""Delta moves on the wire: the copy of the weights each sender keeps, and what it computes its
deltas against (issue 24). The order the driver sends is :class:`actors.records.DeltaOrder`.

A group created with ``GroupConfig(delta="host")`` (or ``"device"``) keeps, on every worker, a
copy of the weights it last sent (its *base*: one shard per worker, in host memory or beside the
buffers), tagged with the layout it sent from and the weight version. A move with ``delta=True``
(``copy_to``, its staged form, ``reallocate`` back to a kept layout) then carries a
:class:`~actors.records.DeltaOrder`: when the driver knows that the destination holds exactly that version
(a copy it made from this group and nothing wrote since; a kept layout of that version) and the
destination has not taken ``GroupConfig.delta_anchor_every - 1`` deltas in a row, ``base`` names
the version and every transport route travels as deltas (``actors/wire/executor.py``,
:class:`~actors.wire.executor.DeltaSides`); otherwise it is an anchor: a full move. Either way the
senders copy what they sent into their base once their part is done, tagged with ``version``.

Nothing trusts the bookkeeping alone: a sender whose base is not tagged ``base`` sends its
buckets whole, and every delta bucket is checked against the checksum of the sender's bucket, a
miss sending it whole (so a destination changed behind the driver's back, a restarted worker, or
a failed move that left the senders' bases newer than the destination still ends bit-exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.records import DeltaOrder
from realloc.layout import RankLayout
from realloc.shards import ShardStore


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
