"""Zero-copy between same-node workers, the worker's side: the handles of its buffers sent to the
peers that read them, the peers' buffers it maps (kept mapped across operations), and the
"phase 0 done" messages of fan-out steps. Functions of the worker's state
(:class:`~actors.worker.state.WorkerState`), called from ``ShardWorker.op_run``."""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import torch

from actors.wire import communicator
from actors.wire.shares import PeerView
from actors.wire.transport import Transport
from actors.wire.zero_copy import handle_identity, open_handles
from actors.worker.state import PendingOp, WorkerPlan, WorkerState
from realloc.shards import ShardStore

#: Bytes of one zero-copy handle message (length + pickle), and the message tags of handles and
#: readiness (plan steps use tag 0).
HANDLE_BYTES = 1 << 14
HANDLES_TAG, READY_TAG = 1, 2
#: How many operations a peer's mapped buffer stays mapped without being read.
MAPPINGS_KEPT_OPS = 2


def swap_handles(
    st: WorkerState,
    wp: WorkerPlan,
    op: PendingOp,
    transport: Transport,
    source: "dict[str, torch.Tensor] | None" = None,
) -> dict[tuple[int, bool], ShardStore]:
    """Send each peer that maps my buffers the handles of exactly the buffers it reads, made
    for it alone; receive mine and open each once. Returns the opened stores by (the peer's
    world rank, forward). ``source``: the buffers this worker sends from (default: the serving
    set; a fleet update's relay sends from a staged set).

    One export per reader and buffer, each opened exactly once: a CUDA IPC export carries a
    reference count that the producer's freed block waits on (torch keeps it allocated, in
    its IPC limbo, until the count drops). An export nobody opens never drops it (every
    freed layout leaked: bench-gpu ran out of memory on llama-7b after a few moves); one
    opened by two readers drops it twice and frees the block under the second."""
    outs = []
    for p, sides in wp.read_by.items():
        mine = {
            "src": st.allocator.export(st.buffers if source is None else source) if False in sides else None,
            "dst": st.allocator.export(op.buffers) if True in sides else None,
        }
        outs.append((wp.peers[p].world_rank, handle_message(mine, st.wire)))
    ins = {p: torch.empty(HANDLE_BYTES, dtype=torch.uint8, device=st.wire) for p in wp.read_from}
    for work in communicator.post(
        transport.pg,
        st.wire,
        outs,
        [(wp.peers[p].world_rank, t) for p, t in ins.items()],
        HANDLES_TAG,
    ):
        work.wait()
    opened = {}
    for p, t in ins.items():
        raw = t.cpu().numpy().tobytes()
        h = pickle.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        view = replace(wp.peers[p], src_handles=h["src"], dst_handles=h["dst"])
        for forward in wp.read_from[p]:
            opened[view.world_rank, forward] = mapped_peer_store(st, view, forward)
    return opened


def post_ready(
    st: WorkerState, wp: WorkerPlan, peers: list[PeerView], transport: Transport
) -> tuple[list, dict[int, Any]]:
    """Post "phase 0 done" to my fan-out readers and the receives of my fan-out senders' ones."""
    senders = sorted({p for ps in wp.wait_ready.values() for p in ps})
    if not senders and not wp.notify:
        return [], {}
    if wp.notify and st.device.type == "cuda":
        torch.cuda.synchronize(st.device)  # my phase-0 writes land before a reader in another process
    wire = st.wire
    one = torch.ones(1, dtype=torch.uint8, device=wire)
    works = communicator.post(
        transport.pg,
        wire,
        [(peers[p].world_rank, one) for p in wp.notify],
        [(peers[p].world_rank, torch.empty(1, dtype=torch.uint8, device=wire)) for p in senders],
        READY_TAG,
    )
    if len(works) == len(wp.notify) + len(senders):  # one Work per message (gloo)
        return works[: len(wp.notify)], dict(zip(senders, works[len(wp.notify) :]))
    # one coalesced Work for all (NCCL): the first fan-out read waits for every message
    return list(works), {p: works[0] for p in senders} if works else {}


def mapped_peer_store(st: WorkerState, peer: PeerView, forward: bool) -> ShardStore:
    """A same-node peer's buffers as a store, kept mapped across operations: an RL loop
    alternating two layouts reads the same files every time (no page-table faults per op).

    CUDA handles are opened every time (each export carries a fresh IPC reference count that
    only opening releases), but the open storage kept here makes torch's IPC cache answer
    them without ``cudaIpcOpenMemHandle`` (0.16 s for a first open on an H100). A sender that
    converts as it sends is mapped as what its buffers hold (``peer.held``): the reader
    converts what it reads (``StepRunner``)."""
    held = peer.dst if forward else (peer.held or peer.src)
    handles = peer.dst_handles if forward else peer.src_handles
    key = (held, tuple(sorted((d, *handle_identity(h)) for d, h in handles.items())))
    entry = st.mapped.get(key)
    if entry is not None and all(h[0] == "shm" for h in handles.values()):
        store = entry[1]
    else:
        store = ShardStore(held.shards(), open_handles(handles))
    st.mapped[key] = (st.runs, store, forward)
    return store


def evict_mappings(st: WorkerState) -> None:
    mapped, runs = st.mapped, st.runs
    for key in [k for k, (last, _, _) in mapped.items() if last < runs - MAPPINGS_KEPT_OPS]:
        del mapped[key]


def unmap_device_sources(st: WorkerState) -> None:
    """After a move on a GPU, let go of the peers' source buffers it read: they are those
    peers' rollback now, freed at the next operation, and a block another process still
    maps stays allocated (torch keeps it in its IPC limbo) instead of serving the next
    allocation. Their destination buffers, which they hold now, stay mapped: the next move
    reads them as sources without opening them again."""
    if st.device.type != "cuda":
        return
    mapped, runs = st.mapped, st.runs
    for key in [k for k, (last, _, forward) in mapped.items() if not (forward and last == runs)]:
        del mapped[key]


def handle_message(handles: dict, device: torch.device) -> torch.Tensor:
    """Pickled zero-copy handles as a fixed-size byte tensor on ``device`` (8-byte length first)."""
    raw = pickle.dumps(handles)
    if len(raw) + 8 > HANDLE_BYTES:
        raise RuntimeError(f"zero-copy handles of {len(raw)} bytes exceed the {HANDLE_BYTES}-byte message")
    out = torch.frombuffer(
        bytearray(len(raw).to_bytes(8, "little") + raw + bytes(HANDLE_BYTES - 8 - len(raw))), dtype=torch.uint8
    )
    return out.to(device)
