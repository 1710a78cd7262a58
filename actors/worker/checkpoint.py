"""Checkpoint methods of a :class:`~actors.worker.ShardWorker` (mixed into the actor class).

Every method takes the checkpoint root and run id from the driver, so a replacement worker on
a fresh node needs no set-up. A worker only ever touches its own node's directory; bytes for
other nodes go over the group's process group, as plans from the one planner.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from actors.lanes import SAVE_GROUP
from actors.records import CheckpointFault, ExchangeReport
from actors.wire.executor import StepRunner, received_share
from realloc.ckpt.errors import CorruptFileError
from realloc.ckpt.files import (
    buffers_from_bytes,
    build_rank_file,
    check_bytes,
    read_shard,
    read_verified,
    write_rank_file,
)
from realloc.ckpt.local_store import Listing, NodeStore
from realloc.ckpt.manifest import CheckpointId, Manifest
from realloc.ckpt.replication import file_param
from realloc.ckpt.reshard import Key, ReadTask, box_of_local, boxes_store
from realloc.shards import ShardStore, copy_local


@dataclass
class _SaveJob:
    thread: threading.Thread | None = None
    manifest: Manifest | None = None
    data: torch.Tensor | None = None  # the file's bytes, kept for replication
    error: BaseException | None = None
    seconds: float = 0.0


@dataclass
class _CheckpointState:
    saves: dict[int, _SaveJob] = field(default_factory=dict)
    sources: dict[Key, torch.Tensor] = field(default_factory=dict)  # read for the coming exchange
    #: the load whose reads ``sources`` holds (``ckpt_read_*``'s ``load_id``): a box's key names
    #: no checkpoint, so the boxes of one load are never taken for another's
    load_id: str | None = None


class CheckpointMixin:
    """Runs inside a ShardWorker: uses ``spec, layout, rank, buffers, device, transport, allocator, node_id``
    of the worker's state (``self._realloc``, never the subclass's own attributes)."""

    def _ckpt(self) -> _CheckpointState:
        state = getattr(self._realloc, "ckpt_state", None)
        if state is None:
            state = self._realloc.ckpt_state = _CheckpointState()
        return state

    def _node_store(self, root: str, run_id: str) -> NodeStore:
        return NodeStore(root, run_id, self._realloc.node_id)

    # -- save --------------------------------------------------------------------------------
    def ckpt_save(
        self, root: str, run_id: str, iteration: int, is_async: bool, fault: CheckpointFault | None = None
    ) -> dict:
        """Write this rank's file; with ``is_async`` snapshot the buffers and write in a thread."""
        if self._realloc.layout is None or self._realloc.buffers is None:
            raise RuntimeError("worker has no layout yet")
        layout, rank, node = self._realloc.layout, self._realloc.rank, self._realloc.node_id
        if self._realloc.device.type == "cuda":
            torch.cuda.synchronize(self._realloc.device)
        # A synchronous save serialises straight from the buffers (that is the copy); an async one
        # must copy first, because training writes into the buffers while the thread serialises.
        buffers = self._realloc.buffers
        snapshot = {d: t.detach().to("cpu", copy=True) for d, t in buffers.items()} if is_async else buffers
        job = _SaveJob()
        self._ckpt().saves[iteration] = job
        directory = self._node_store(root, run_id).iteration_dir(iteration)

        def write() -> None:
            started = time.perf_counter()
            try:
                data, manifest = build_rank_file(CheckpointId(run_id, iteration, rank), layout, snapshot, node)
                view = np.frombuffer(data, dtype=np.uint8)
                write_rank_file(directory, view, manifest, fault.trigger if fault is not None else None)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only bytes; the exchange only reads them
                    job.data = torch.from_numpy(view)
                job.manifest = manifest
            except BaseException as exc:  # noqa: BLE001 - reported to the driver by ckpt_save_result
                job.error = exc
            job.seconds = time.perf_counter() - started

        if is_async:
            job.thread = threading.Thread(target=write, name=f"ckpt-save-{iteration}", daemon=True)
            job.thread.start()
            return {"rank": rank, "async": True}
        write()
        return self.ckpt_save_result(iteration)

    @ray.method(concurrency_group=SAVE_GROUP)
    def ckpt_save_result(self, iteration: int) -> dict:
        """Wait for this rank's write of ``iteration``; its manifest, or the write's exception.

        Remote calls run on the save thread (:data:`~actors.lanes.SAVE_GROUP`): the driver calls
        it as soon as an async save's snapshots are taken, and its answer is the end of the write
        (``SaveHandle.done``), while the default thread runs the user's calls."""
        job = self._ckpt().saves.get(iteration)
        if job is None:
            raise RuntimeError(f"no save of iteration {iteration} was started on this worker")
        if job.thread is not None:
            job.thread.join()
        if job.error is not None:
            self._ckpt().saves.pop(iteration, None)
            raise job.error
        return {
            "rank": self._realloc.rank,
            "manifest": job.manifest,
            "seconds": job.seconds,
            "node": self._realloc.node_id,
        }

    # -- listing and clean-up ----------------------------------------------------------------
    def ckpt_list(self, root: str, run_id: str, iterations: list[int] | None = None) -> Listing:
        return self._node_store(root, run_id).list(set(iterations) if iterations is not None else None)

    def ckpt_cleanup(self, root: str, run_id: str, keep: int | None = None, only: int | None = None) -> list[int]:
        return self._node_store(root, run_id).remove_iterations(keep=keep, only=only)

    def ckpt_forget(self) -> None:
        """Drop every cached checkpoint byte (after a failure, or when a save is final)."""
        state = self._ckpt()
        state.sources.clear()
        state.load_id = None
        state.saves = {i: j for i, j in state.saves.items() if j.thread is not None and j.thread.is_alive()}

    # -- reading for an exchange -------------------------------------------------------------
    def _sources_of(self, load_id: str) -> dict[Key, torch.Tensor]:
        """The cache of what load ``load_id`` read here: emptied first if it holds another load's
        reads (a load that failed on the driver after its reads leaves them behind)."""
        state = self._ckpt()
        if state.load_id != load_id:
            state.sources.clear()
            state.load_id = load_id
        return state.sources

    def ckpt_read_files(self, root: str, run_id: str, manifests: dict[int, Manifest], load_id: str) -> dict:
        """Read and sha256-check whole rank files of this node for the coming exchange.

        Returns ``{"bad": {rank: reason}, "bytes": read, "seconds": ...}``; good files stay cached
        for the next rounds of the same load (``load_id``; another load's cached bytes are dropped).
        """
        started, read, bad = time.perf_counter(), 0, {}
        store, sources = self._node_store(root, run_id), self._sources_of(load_id)
        for rank, manifest in sorted(manifests.items()):
            key = (file_param(rank), (0,), (manifest.file_bytes,))
            if key in sources:
                continue
            try:
                sources[key] = read_verified(store.paths(manifest.id)[0], manifest)
                read += manifest.file_bytes
            except CorruptFileError as exc:
                bad[rank] = exc.reason
        return {"bad": bad, "bytes": read, "seconds": time.perf_counter() - started}

    def ckpt_read_boxes(
        self, root: str, run_id: str, tasks: list[ReadTask], manifests: dict[int, Manifest], load_id: str
    ) -> dict:
        """Read (and crc-check) single stored shards of this node's files; returns the failed tasks.
        Boxes already read by the same load (``load_id``: its earlier rounds) are not read again."""
        started, read, bad = time.perf_counter(), 0, []
        store, sources = self._node_store(root, run_id), self._sources_of(load_id)
        for task in tasks:
            if task.key in sources:
                continue
            manifest = manifests[task.rank]
            try:
                local = read_shard(store.paths(manifest.id)[0], manifest, task.record)
            except CorruptFileError as exc:
                bad.append((task, exc.reason))
                continue
            box = box_of_local(local, task.record)
            sources[task.key] = box.clone() if box.numel() != local.numel() else box
            read += task.nbytes
        return {"bad": bad, "bytes": read, "seconds": time.perf_counter() - started}

    # -- exchange ----------------------------------------------------------------------------
    def ckpt_exchange(
        self,
        op_id: str | None,
        world_id: str,
        share: list,
        me: int,
        mode: str,
        payload: dict[str, Any],
    ) -> ExchangeReport:
        """Run my part of a checkpoint plan, then finish it (what it did: an
        :class:`~actors.records.ExchangeReport`). ``share``: ``[ObjectRef of my
        (PlanSlice, PeerTable)]``, my share of the plan alone (realloc/plan/slices.py).

        ``mode``: ``"replicate"`` (send my new file, write the files I receive to my node; no
        operation: the save's own clean-up undoes a failure), ``"restore"`` (receive my own rank
        file, check it and unpack it into the destination buffers of operation ``op_id``),
        ``"reshard"`` (receive my shards of the current layout into those buffers) or ``"export"``
        (send from my current weights; a writer of a HF export receives its whole tensors straight
        into the bytes of its safetensors files, ``payload["arena"]``, and writes them atomically
        into ``payload["root"]``; no operation: the weights are only read). Restore and reshard
        never touch the current weights: the driver commits or aborts ``op_id`` afterwards.
        """
        started = time.perf_counter()
        state = self._ckpt()
        move = self._check_world(world_id)
        plan, peers = received_share(share, me)
        op = self._current_op(op_id) if mode in ("restore", "reshard") else None
        try:
            if mode == "replicate":
                job = state.saves[payload["iteration"]]
                src = boxes_store({(file_param(self._realloc.rank), (0,), (job.data.numel(),)): job.data})
            elif mode == "export":
                src = self._store_now()
            else:
                src = boxes_store(state.sources) if state.sources else None
            incoming: dict[int, Manifest] = payload.get("incoming", {})
            arena = payload.get("arena")
            if mode == "reshard":
                dst = op.store()
            elif mode == "export":
                data, dst = arena.allocate(self._realloc.device) if arena is not None else (None, None)
            else:
                dst = (
                    boxes_store(
                        {
                            (file_param(r), (0,), (m.file_bytes,)): torch.zeros(m.file_bytes, dtype=torch.uint8)
                            for r, m in incoming.items()
                        }
                    )
                    if incoming
                    else None
                )
            moved = {"local": 0, "intra": 0, "inter": 0}
            for j in plan.local:
                moved["local"] += copy_local(src, dst, plan.segment_list(j))
            runner = StepRunner(move.transport, self._realloc.device, plan, me, peers, src, dst, None)
            for s, routes in plan.routes_by_step().items():
                for kind, nbytes in runner.run_step(s, routes):
                    moved[kind] += nbytes
            if self._realloc.device.type == "cuda":
                torch.cuda.synchronize(self._realloc.device)
            exchanged = time.perf_counter()
            local = bool(plan.local)
            files, replicas = [], 0
            if mode == "export":
                if arena is not None:
                    files = [
                        {**f, "writer": self._realloc.rank, "node": self._realloc.node_id}
                        for f in arena.write(data, payload["root"])
                    ]
            else:
                replicas = self._finish_exchange(mode, payload, incoming, dst, op, local)
        finally:
            state.sources.clear()
            if mode == "replicate":
                state.saves.pop(payload["iteration"], None)
        return ExchangeReport(
            moved,
            seconds=exchanged - started,
            finish_seconds=time.perf_counter() - exchanged,
            files=files,
            replicas=replicas,
        )

    def _finish_exchange(
        self, mode: str, payload: dict, incoming: dict[int, Manifest], dst: ShardStore | None, op, local: bool
    ) -> int:
        if mode == "reshard":
            return 0
        files = {r: dst.view(file_param(r), (0,), (m.file_bytes,)) for r, m in incoming.items()}
        if mode == "replicate":
            store = self._node_store(payload["root"], payload["run_id"])
            for r, m in files.items():
                check_bytes(m, incoming[r], f"replica of rank {r} on {self._realloc.node_id}")
                write_rank_file(store.iteration_dir(payload["iteration"]), m.numpy(), incoming[r])
            return len(files)
        if mode == "restore":
            manifest = incoming[self._realloc.rank]
            data = files[self._realloc.rank]
            if not local:  # bytes from a peer: verify end to end (a local copy was verified as it was read)
                check_bytes(data, manifest, f"rank {self._realloc.rank} file received on {self._realloc.node_id}")
            loaded = buffers_from_bytes(data, manifest)
            expected = op.dst.buffer_numels()
            if {d: t.numel() for d, t in loaded.items()} != expected:
                raise CorruptFileError(str(manifest.id), f"buffers do not fit {op.dst}")
            for d, t in loaded.items():
                op.buffers[d].copy_(t)
            return 0
        raise ValueError(f"unknown checkpoint exchange mode {mode!r}")

    def _ckpt_forget_sources(self) -> None:
        self._ckpt().sources.clear()
