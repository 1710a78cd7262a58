"""What a worker checks of its share of a plan against what it holds, before any traffic.

The driver plans every move from the layouts its groups hold, and a worker runs its share as the
plan says. A plan made from a layout a worker no longer holds (its group was reallocated between
the planning and the move: a driver bug, such as the staged update fixed in 6bd7fea) sends the
bytes of one layout at the offsets of another, and a same-node reader maps the worker's buffers
at the stale layout's offsets: wrong weights, committed without an error. This is the worker's
own defence, whatever the driver checked: it refuses such a share with a ``ValueError`` naming
the worker, what it holds and what the plan says, before it allocates, exchanges handles or moves
a byte; the move then fails and the driver rolls every worker back as for any failed move
(a peer waiting for this worker's routes fails when its collective times out). Each worker
checks only what it knows: its own rank, and the views of the same-node peers whose buffers it
maps. Pure functions of layouts and views: no Ray, no tensors.

* :func:`source_converts`: what the plan sends from is what this worker holds (or relays), or
  that same rank in another weight format, same model and placement: a copy between formats that
  converts on the senders (realloc/plan/formats.py), the only legitimate difference. What its
  same-node readers map its buffers as (``PeerView.held``, else ``src``) is exactly what they hold.
* :func:`check_destination`: what it receives is its own rank; the layout the receivers convert
  into (``MoveOrder.convert``) is the plan's destination in another format; a copy's destination
  (``MoveOrder.into``) is what it holds.
* :func:`check_reads`: a same-node sender it maps is mapped as a layout it can read the plan's
  source from (the same rank, in another format at most).
* :func:`check_delta`: no delta move with a weight-format conversion: delta routes move the bytes
  as they are (actors/wire/delta.py; a sender's base is a copy of what it sent, in the plan's
  format), so a converting sender would send unconverted bytes into FP8 pieces, and a receiver
  that converts would apply deltas to the wrong format.
"""

from __future__ import annotations

from typing import Iterable

from actors.records import DeltaOrder, MoveOrder
from actors.wire.shares import PeerTable, PeerView
from realloc.layout import Layout, RankLayout
from realloc.plan.formats import same_placement

#: What a refusal of a stale layout ends with: when, and why.
REFUSED = "refused before any traffic (the bytes would sit at another layout's offsets: wrong weights)"


def reformatted(a: RankLayout, b: RankLayout) -> bool:
    """Whether ``a`` is rank ``b`` in another weight format (same model, rank and placement)."""
    return a.rank == b.rank and a.layout.spec != b.layout.spec and same_placement(a.layout, b.layout)


def source_converts(
    group: str, held: RankLayout | None, me: PeerView, sending: RankLayout | None = None, convert: bool = True
) -> bool:
    """Whether this worker (of ``group``, holding ``held``) converts what it sends: ``me`` is its
    own view in the plan, ``sending`` the staged set it relays instead of its serving set (sent
    as it is), ``convert`` whether the path it runs can convert at all (``op_execute``'s cannot).
    ``ValueError`` when the plan sends another layout than the one it holds (other than that
    layout in another weight format), or has its same-node readers map its buffers as another."""
    src = me.src
    if src is None:
        return False
    have, holds = (sending, "relays a staged set of") if sending is not None else (held, "holds")
    if have is None:
        raise ValueError(f"worker of {group} holds nothing, but the plan sends {src} from it: {REFUSED}")
    if src == have:
        converts = False
    elif convert and sending is None and reformatted(src, have):
        converts = True  # a copy between weight formats, converted as it is packed
    else:
        why = "a plan made from a layout it does not hold"
        if reformatted(src, have):
            why = "a relay sends its staged set as it is" if sending is not None else "this path converts nothing"
        raise ValueError(f"worker of {group} {holds} {have}, but the plan sends {src} from it ({why}): {REFUSED}")
    # what a same-node reader maps its buffers as: ``held``, else the plan's source (then equal
    # to what it holds unless it converts)
    if (converts and me.held is None) or (me.held is not None and me.held != have):
        mapped = me.held if me.held is not None else src
        raise ValueError(
            f"worker of {group} {holds} {have}, but the plan has its same-node readers map its buffers as "
            f"{mapped}: {REFUSED}"
        )
    return converts


def check_destination(
    group: str, held: RankLayout | None, dst: RankLayout | None, convert: Layout | None, into: Layout | None
) -> None:
    """``ValueError`` unless what this worker (of ``group``, holding ``held``) receives, ``dst``,
    is its own rank; converted into ``convert`` (the receivers convert), that rank in another
    weight format; and, for a copy into ``into`` (what the receivers hold and keep), what it holds."""
    if dst is None:
        return
    if held is not None and dst.rank != held.rank:
        raise ValueError(f"worker of {group} holds {held}, but the plan writes {dst} into it: {REFUSED}")
    final = dst
    if convert is not None:
        final = RankLayout(convert, dst.rank)
        if final != dst and not reformatted(dst, final):
            raise ValueError(
                f"worker of {group}: the plan writes {dst} into it to be converted into {convert}, which is "
                f"not that layout in another weight format: {REFUSED}"
            )
    if into is not None and final != held:
        raise ValueError(
            f"worker of {group} holds {held}, but the copy into {into} writes {final} into it (made from a "
            f"layout it does not hold): {REFUSED}"
        )


def check_reads(group: str, peers: PeerTable, readers: Iterable[int], convert: bool = True) -> None:
    """``ValueError`` unless every same-node peer in ``readers`` whose source buffers this worker
    (of ``group``) maps is mapped as its plan source (``PeerView.src``) or, when the path reads
    converting (``convert``; ``op_execute`` does not), that rank in another weight format
    (``PeerView.held``: a sender that converts as it sends). The sender checks that this is what
    it holds (:func:`source_converts`)."""
    for p in readers:
        view = peers[p]
        if view.src is None or view.held is None or view.held == view.src:
            continue
        if not (convert and reformatted(view.held, view.src)):
            raise ValueError(
                f"worker of {group}: the plan maps the buffers of same-node worker {p} as {view.held} to read "
                f"{view.src} from them: {REFUSED}"
            )


def check_delta(group: str, delta: DeltaOrder | None, converts: bool, convert: Layout | None) -> None:
    """``ValueError`` for a delta move (``delta``, an anchor included: it sets the senders' bases)
    in which the senders convert what they send (``converts``: this worker, or a same-node sender
    it knows of) or the receivers convert into ``convert``, this worker being of ``group``. Every driver path refuses the
    combination first (``copy_to(delta=True)`` between weight formats)."""
    if delta is None or not (converts or convert is not None):
        return
    how = "the senders convert what they send" if converts else f"the receivers convert into {convert}"
    raise ValueError(
        f"worker of {group}: a delta move (delta=True) with a weight-format conversion ({how}): delta routes "
        "move the bytes as they are, in one format on both sides; refused before any traffic"
    )


def peers_convert(peers: PeerTable, me: int) -> bool:
    """Whether a same-node sender of worker ``me``'s plan converts what it sends (its view's
    ``held``: its buffers hold its plan source in another weight format)."""
    return any(peers[p].held not in (None, peers[p].src) for p in peers.views if p != me)


def checked_order(
    group: str,
    held: RankLayout | None,
    peers: PeerTable,
    me: int,
    order: MoveOrder,
    sending: RankLayout | None = None,
) -> bool:
    """Every check above of worker ``me``'s share (``peers``: its :class:`PeerTable`, the full
    views of itself and its same-node peers) under ``order``; returns whether it converts what
    it sends. ``sending``: the staged set it relays (``MoveOrder.relay``)."""
    mine = peers[me]
    converts = source_converts(group, held, mine, sending)
    check_destination(group, held, mine.dst, order.convert, order.into)
    check_reads(group, peers, [p for p in peers.views if p != me])
    check_delta(group, order.delta, converts or peers_convert(peers, me), order.convert)
    return converts
