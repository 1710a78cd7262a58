"""Executing one worker's share of a plan over the transport (and zero-copy reads): the
:class:`StepRunner`, its bucket :class:`Staging` and :class:`Cuts`, and the recorder of its
timeline (:class:`Phases`). Its share and peers are :mod:`actors.wire.shares`; delta routes are
:mod:`actors.wire.delta`. Nothing here needs a ``ShardWorker``: any process holding a store and
a transport runs it (``tests/test_wire_plain_process.py``)."""

from __future__ import annotations

import functools
import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import ray
import torch

from actors.wire.delta import DeltaRoute, DeltaSides
from actors.wire.shares import PeerTable, PeerView, is_zero_copy
from realloc.plan import Piece, bucket_nbytes
from realloc.plan.slices import PlanSlice
from realloc.shards import ShardStore, local_copies, pack_copies, piece_view, unpack_copies
from realloc.shards.convert import Converted
from realloc.shards.copy_program import ProgramCache


def received_share(box: list, me: int) -> tuple[PlanSlice, PeerTable]:
    """This worker's ``(PlanSlice, PeerTable)`` from ``box`` (``[ObjectRef]``), checked (it is
    worker ``me``'s slice and holds nothing malformed, and every segment it sends, receives or
    copies is in a shard of the layout it reads or writes, with that shard's dtype:
    ``ValueError`` naming the field, before any traffic) and unpacked."""
    plan, peers = ray.get(box[0])
    return checked_share(plan, peers, me)


def checked_share(plan: PlanSlice, peers: PeerTable, me: int) -> tuple[PlanSlice, PeerTable]:
    """Worker ``me``'s share, checked as :func:`received_share` says and unpacked (a process
    that gets its share without Ray: a vLLM worker, actors/vllm/engine.py)."""
    if not isinstance(plan, PlanSlice) or not isinstance(peers, PeerTable):
        raise ValueError(
            f"a share is a (PlanSlice, PeerTable) pair, got ({type(plan).__name__}, {type(peers).__name__})"
        )
    plan.validate(len(peers), me)
    plan.unpack()  # before any thread of the worker reads it
    plan.check_held(peers[me].src, peers[me].dst)
    return plan, peers


class Phases:
    """Where one worker's time in one operation went, and when (its part of a move's trace,
    actors/trace.py).

    ``mark(name)`` charges the time since the previous mark to phase ``name``: ``seconds`` sums
    them by name (``ShardWorker.last_phases()``, bench-gpu) and ``spans`` keeps each as
    ``(name, start, end)``. ``step(...)`` records one step's exchange of the plan (the
    :class:`StepRunner` calls it), ``local(...)`` the local copies (from their own thread). Times
    are ``time.perf_counter()`` seconds; :meth:`record` turns them into this host's wall clock.
    Recording costs two clock reads and one tuple per phase and per step the worker takes part in.
    """

    def __init__(self, op: str | None = None) -> None:
        self.op = op
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        self.steps: list[tuple] = []  # (step, start, end, received from, bytes, link, sent to, bytes)
        self.locals: list[tuple[float, float, int]] = []  # (start, end, bytes)
        self.converts: list[tuple[float, float, int]] = []  # (start, end, bytes), inside the steps
        self._wall, self._last = time.time(), time.perf_counter()
        self._origin = self._last

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self.spans.append((name, self._last, now))
        self._last = now

    def step(
        self, step: int, start: float, end: float, recv: tuple[int, int, str] | None, send: tuple[int, int] | None
    ) -> None:
        """Step ``step`` ran from ``start`` to ``end``: it received ``(peer, bytes, link)`` (link
        ``intra``, ``inter``, or ``read``: a zero-copy read of a same-node peer's buffers) and
        sent ``(peer, bytes)``, either may be None."""
        self.steps.append((step, start, end, *(recv or (None, 0, None)), *(send or (None, 0))))

    def local(self, start: float, end: float, nbytes: int) -> None:
        self.locals.append((start, end, nbytes))

    def convert(self, start: float, end: float, nbytes: int) -> None:
        """A message's boxes converted into another weight format as they were packed."""
        self.converts.append((start, end, nbytes))

    def record(self) -> dict:
        """This operation's timeline as plain data, times in seconds of this host's wall clock
        (``time.time()``): ``{"op", "phases": [[name, start, end]], "steps": [[step, start, end,
        recv_peer, recv_bytes, link, send_peer, send_bytes]], "local": [[start, end, bytes]],
        "convert": [[start, end, bytes]]}``."""
        shift = self._wall - self._origin
        return {
            "op": self.op,
            "phases": [[name, a + shift, b + shift] for name, a, b in self.spans],
            "steps": [[s, a + shift, b + shift, *rest] for s, a, b, *rest in self.steps],
            "local": [[a + shift, b + shift, n] for a, b, n in self.locals],
            "convert": [[a + shift, b + shift, n] for a, b, n in self.converts],
        }


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a worker executes its share of a plan, back
    as it was after. A full collection walks every object the process tracks: ~218k in a Ray
    worker that imported torch, 0.12-0.17 s each here (half the workers ran one per ~10 moves
    of ``bench-1gb``), and one landing inside a move stalls every peer that waits on this
    worker. Execution allocates only small acyclic objects (views, tuples), so pausing the
    collector for its duration leaves no garbage behind; the next collection runs outside."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Staging:
    """A worker's bucket staging buffers, kept across plans: their pages are touched once, not
    per step (fresh pages cost a page fault each; at 64 MiB buckets that dominated a step).

    Two slots, ``"a"`` and ``"b"``, so a worker never holds more than one bucket pair: the next
    bucket to send is packed into whichever slot the bucket on the wire (sent or received)
    leaves free, or after it has landed when it needs both (:meth:`StepRunner._transfer`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, nbytes: int) -> torch.Tensor:
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


#: Pieces of a bucket at least this large travel as their own message: sent straight from the
#: source view and received straight into the destination view wherever that view is contiguous
#: (no pack or unpack copy); smaller ones are packed together.
DIRECT_MIN_BYTES = int(os.environ.get("REALLOC_DIRECT_MIN_BYTES", 256 << 10))
#: Direct messages a worker posts beyond the one it exchanges, where its transport allows
#: (:meth:`StepRunner._transfer`); 0 posts one message at a time.
AHEAD_MESSAGES = int(os.environ.get("REALLOC_AHEAD_MESSAGES", 16))


def messages(bucket: list[Piece]) -> list[list[Piece]]:
    """A bucket as the messages that carry it: every piece of at least ``DIRECT_MIN_BYTES`` alone,
    runs of smaller pieces together. A pure function of the bucket, so both ends of a route cut
    it identically; each end then decides by itself whether its side of a one-piece message is a
    contiguous view (no copy) or goes through staging (pieces keep their offsets in the bucket)."""
    out: list[list[Piece]] = []
    small = False
    for p in bucket:
        big = p.nbytes >= DIRECT_MIN_BYTES
        if big or not small:
            out.append([p])
        else:
            out[-1].append(p)
        small = not big
    return out


def _direct_bytes(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of a single contiguous view (send from / receive into it without a copy)."""
    if len(views) != 1 or not views[0].is_contiguous():
        return None
    return views[0].reshape(-1).view(torch.uint8)


@dataclass
class Cuts:
    """One plan's segment lists cut into buckets and messages, and this worker's copies of it
    compiled (``realloc/shards/copy_program.py``), filled as a runner needs them. Kept with a cached
    plan, so a worker running the plan again plans no box: program keys name the segment list
    and the sides (``("local", j)``, ``("read", j, sender, forward)``, ``("pack", j, message,
    forward)``, ``("unpack", j, message)``), and within one plan each side's layout is fixed."""

    buckets: dict[int, list] = field(default_factory=dict)
    messages: dict[int, list] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)  # segment list -> its bytes
    gaps: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (list, bucket) -> gap bytes (deltas)
    programs: ProgramCache = field(default_factory=ProgramCache)


class StepRunner:
    """Runs one worker's routes of a plan, step by step, bucket by bucket.

    ``plan``: the worker's :class:`~realloc.plan.slices.PlanSlice` (what it was shipped), whose
    segment lists, buckets and fan-out flag are the plan's. ``peers``: its :class:`PeerTable`
    (or a list of every worker's view). ``src``/``dst`` are this worker's stores (model buffers,
    checkpoint files read into memory, ...); ``open_peer(peer_view, forward)`` opens a same-node peer's store for zero-copy reads.
    ``convert``: ``src`` seen in the plan's weight format when it holds another (its sends are
    converted message by message as they are packed, realloc/plan/formats.py; ``src`` is then
    what it holds, and no converted copy of it exists). A same-node sender in that case
    (``PeerView.held``) is read where it is and converted box by box as it is read
    (:meth:`read`); :meth:`conversion_failures` collects the blocks either could not quantize.
    ``cuts``: a :class:`Cuts` of the same plan to reuse (the plan's buckets and messages are
    pure functions of it: a worker running one plan again does not cut them again).
    ``timeline``: the operation's :class:`Phases`, which records every step this worker runs.
    """

    def __init__(
        self,
        transport,
        device: torch.device,
        plan: PlanSlice,
        me: int,
        peers: "PeerTable | list[PeerView]",
        src: ShardStore | None,
        dst: ShardStore | None,
        open_peer: Callable[[PeerView, bool], ShardStore] | None = None,
        on_bucket: Callable[[], None] | None = None,
        staging: "Staging | None" = None,
        cuts: "Cuts | None" = None,
        delta: "DeltaSides | None" = None,
        timeline: Phases | None = None,
        convert: Converted | None = None,
    ):
        self.transport, self.plan, self.me, self.peers, self.src, self.dst = transport, plan, me, peers, src, dst
        self.timeline = timeline
        self.open_peer = open_peer
        self.on_bucket = on_bucket
        self.staging = staging if staging is not None else Staging(device)
        self.device = device
        self.my_node = peers[me].node
        self.cuts = cuts if cuts is not None else Cuts()
        self._peer_stores: dict[tuple[int, bool], ShardStore] = {}
        self.delta = delta
        self.convert = convert
        self._read_converts: dict[int, Converted] = {}  # sender -> its mapped buffers in the plan's format

    def buckets(self, j: int) -> list:
        if j not in self.cuts.buckets:
            self.cuts.buckets[j] = self.plan.buckets(j)
        return self.cuts.buckets[j]

    def zero_copy(self, sender: int, receiver: int, forward: bool) -> bool:
        """Whether a route is a direct read of the sender's buffers by the receiver.

        Both ends evaluate this on the same shared data, so they agree without talking.
        """
        return self.open_peer is not None and is_zero_copy(self.peers, sender, receiver, forward)

    def peer_store(self, peer: int, forward: bool) -> ShardStore:
        key = (peer, forward)
        if key not in self._peer_stores:
            self._peer_stores[key] = self.open_peer(self.peers[peer], forward)
        return self._peer_stores[key]

    def run_step(self, s: int, routes: list[tuple[int, int, int]]) -> list[tuple[str, int]]:
        """Step ``s``; ``routes``: this worker's routes of it (``PlanSlice.routes_by_step``)."""
        started = time.perf_counter()
        forward = self.plan.reads_destination(s)
        send = recv = read = None
        done = []
        for src, dst, j in routes:
            if src == self.me and not self.zero_copy(src, dst, forward):
                send = (dst, j)
            if dst == self.me:
                if self.zero_copy(src, dst, forward):
                    nbytes = self.read(j, src, forward)
                    done.append(("intra", nbytes))
                    read = (src, nbytes, "read")
                else:
                    recv = (src, j)
        if send or recv:
            done += (
                self._transfer(send, recv, forward) if self.delta is None else DeltaRoute(self).run(send, recv, forward)
            )
        if self.timeline is not None:
            self.timeline.step(
                s,
                started,
                time.perf_counter(),
                (recv[0], done[-1][1], done[-1][0]) if recv else read,
                (send[0], self.list_bytes(send[1])) if send else None,
            )
        return done

    def read(self, j: int, sender: int, forward: bool) -> int:
        """Segment list ``j`` read from same-node ``sender``'s buffers (its destination's for a
        fan-out read) into this worker's destination; returns the bytes read. The boxes a sender
        that converts as it sends would have converted (``PeerView.held``: its buffers hold
        another weight format than the plan's) are converted here as they are read, with the
        sender's arithmetic (:class:`~realloc.shards.convert.Converted` over its mapped buffers)."""
        peer = self.peer_store(sender, forward)
        segments = self.plan.segment_list(j)
        view = self.peers[sender]
        convert = None
        if not forward and view.held is not None:
            convert = self._read_converts.get(sender)
            if convert is None:
                have, want = view.held.layout.spec.by_name, view.src.layout.spec.by_name
                convert = self._read_converts[sender] = Converted(peer, have, want)
        plain = segments if convert is None else [p for p in segments if not convert.converts(p.param)]
        nbytes = 0
        if plain:
            nbytes = self.cuts.programs.run(
                ("read", j, sender, forward),
                lambda: local_copies(peer, self.dst, plain),
                self.dst.buffers,
                peer.buffers,
            )
        changed = [] if convert is None else [p for p in segments if convert.converts(p.param)]
        if changed:
            started = time.perf_counter()
            for p in changed:
                for out in self.dst.views(p.param, p.offsets, p.sizes):
                    convert.write(p.param, p.offsets, p.sizes, out)
            converted = sum(p.nbytes for p in changed)
            if self.timeline is not None:
                self.timeline.convert(started, time.perf_counter(), converted)
            nbytes += converted
        return nbytes

    def conversion_failures(self) -> list:
        """The blocks this worker could not quantize (inf/NaN), converting its sends or what it
        read (:class:`~realloc.shards.convert.NonFiniteBlock`): it raises the first once its
        routes are done, so that no peer waits on it."""
        failed = list(self.convert.failed) if self.convert is not None else []
        for convert in self._read_converts.values():
            failed += convert.failed
        return failed

    def list_bytes(self, j: int) -> int:
        if j not in self.cuts.nbytes:
            self.cuts.nbytes[j] = self.plan.list_bytes(j)
        return self.cuts.nbytes[j]

    def messages(self, j: int) -> list[list[Piece]]:
        """Segment list ``j`` as messages: its buckets, each split by :func:`messages`."""
        if j not in self.cuts.messages:
            self.cuts.messages[j] = [m for bucket in self.buckets(j) for m in messages(bucket)]
        return self.cuts.messages[j]

    def _transfer(self, send, recv, forward: bool) -> list[tuple[str, int]]:
        source = self.dst if forward else self.src
        convert = None if forward else self.convert  # a fan-out forwards the plan's format
        send_b = self.messages(send[1]) if send else []
        recv_b = self.messages(recv[1]) if recv else []
        world = lambda peer: self.peers[peer].world_rank  # noqa: E731

        # Staging slots (one bucket pair at most, see Staging): bucket i+1 is packed into a slot
        # that neither bucket i's send nor its receive is using, while bucket i is on the wire;
        # when both slots are taken (a packed send and a packed receive), after it has landed.

        @functools.cache
        def converted(i: int) -> tuple[list[Piece], list[Piece]]:
            """Message ``i``'s pieces copied as they are and those converted as they are packed."""
            if convert is None:
                return send_b[i], []
            return [p for p in send_b[i] if not convert.converts(p.param)], [
                p for p in send_b[i] if convert.converts(p.param)
            ]

        @functools.cache  # asked again for every message the window passes over (post_ahead)
        def direct_out(i: int) -> torch.Tensor | None:
            """Message ``i``'s source view when it is one contiguous box copied as it is (sent
            without a copy)."""
            plain = converted(i)[0]
            p = plain[0] if len(plain) == 1 == len(send_b[i]) else None
            return _direct_bytes([source.view(p.param, p.offsets, p.sizes)]) if p is not None else None

        @functools.cache
        def direct_in(i: int) -> torch.Tensor | None:
            """Message ``i``'s destination view when it is one contiguous box (received in place)."""
            p = recv_b[i][0]
            return _direct_bytes(self.dst.views(p.param, p.offsets, p.sizes)) if len(recv_b[i]) == 1 else None

        def outgoing(i: int, slot: str) -> tuple[torch.Tensor, str | None]:
            """Message ``i``'s bytes and the slot they occupy: the source view itself (no slot)
            when it is one contiguous box, else packed into ``slot`` (its converted boxes
            converted into it)."""
            direct = direct_out(i)
            if direct is not None:
                return direct, None
            end = bucket_nbytes(send_b[i])
            staged = self.staging.get(slot, end)
            plain, changed = converted(i)
            if plain:
                self.cuts.programs.run(
                    ("pack", send[1], i, forward, convert is not None),
                    lambda: pack_copies(source, plain, staged),
                    {"staging": staged},
                    source.buffers,
                )
            if changed:
                started = time.perf_counter()
                for p in changed:
                    convert.write(p.param, p.offsets, p.sizes, piece_view(staged, p))
                if self.timeline is not None:
                    self.timeline.convert(started, time.perf_counter(), sum(p.nbytes for p in changed))
            return staged[send_b[i][0].offset : end], slot

        # Messages posted ahead (index -> requests): on a transport that matches a pair's messages
        # in posting order and posts asynchronously (gloo with host tensors), the direct messages
        # that follow the one being exchanged are posted with it, in order on each side, up to
        # AHEAD_MESSAGES beyond it. They hold no staging slot, so the slot discipline above is
        # unchanged; they overlap the per-message rendezvous of gloo (the receiver's "ready"
        # reaches the sender before the bytes go), which a message at a time pays in full.
        sent_ahead: dict[int, list] = {}
        received_ahead: dict[int, list] = {}

        def post_ahead(i: int) -> None:
            for queue, ahead, direct, peer, as_send in (
                (send_b, sent_ahead, direct_out, send, True),
                (recv_b, received_ahead, direct_in, recv, False),
            ):
                for k in range(i + 1, min(i + 1 + AHEAD_MESSAGES, len(queue))):
                    if k in ahead:
                        continue
                    view = direct(k)
                    if view is None or not self.transport.posts_ahead(view):
                        break  # a staged message is next in this side's order: it waits for its turn
                    op = (world(peer[0]), view)
                    ahead[k] = self.transport.exchange(op, None) if as_send else self.transport.exchange(None, op)

        nxt, sending = outgoing(0, "a") if send_b else (None, None)
        for i in range(max(len(send_b), len(recv_b))):
            out = (world(send[0]), nxt) if i < len(send_b) and i not in sent_ahead else None
            busy = {sending} if i < len(send_b) and sending else set()
            into, landing = None, None
            if i < len(recv_b) and i not in received_ahead:
                direct = direct_in(i)
                if direct is None:
                    landing = "b" if "b" not in busy else "a"
                    busy.add(landing)
                    end = bucket_nbytes(recv_b[i])
                    direct = self.staging.get(landing, end)[recv_b[i][0].offset : end]
                into = (world(recv[0]), direct)
            requests = self.transport.exchange(out, into) + sent_ahead.pop(i, []) + received_ahead.pop(i, [])
            post_ahead(i)  # every message up to i is posted on both sides now
            packed = False
            free = [slot for slot in ("a", "b") if slot not in busy]
            if i + 1 < len(send_b) and free:  # pack the next bucket while this one is on the wire
                nxt, sending = outgoing(i + 1, free[0])
                packed = True
            for r in requests:
                r.wait()
            if landing is not None:
                staged = self.staging.get(landing, bucket_nbytes(recv_b[i]))
                self.cuts.programs.run(
                    ("unpack", recv[1], i),
                    lambda: unpack_copies(self.dst, recv_b[i], staged),
                    self.dst.buffers,
                    {"staging": staged},
                )
            if i + 1 < len(send_b) and not packed:  # both slots were in use: now they are free
                nxt, sending = outgoing(i + 1, "a")
            if self.on_bucket is not None:
                self.on_bucket()
        return self.received(recv)

    def received(self, recv) -> list[tuple[str, int]]:
        """What a step's receive ``(sender, segment list)`` brought, by link kind (none without one)."""
        if not recv:
            return []
        return [("intra" if self.peers[recv[0]].node == self.my_node else "inter", self.list_bytes(recv[1]))]
