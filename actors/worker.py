"""The Ray actor that owns one worker's shards and runs its part of every plan."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
import torch

from actors import metrics
from actors.transport import Transport, host_store
from actors.zero_copy import BufferAllocator, open_handles
from realloc.layout import Layout
from actors.executor import PeerView, Staging, StepRunner
from actors.ckpt_worker import CheckpointMixin
from realloc.boxes import box_index
from realloc.plan import Plan
from realloc.shards import ShardStore, copy_local, zero_padding
from realloc.spec import ModelSpec
from realloc.synthetic import synthetic_box
from realloc.topology import Topology


@dataclass
class ShardContext:
    """What a user function sees on a worker (``group.run(fn)`` calls ``fn(ctx, ...)``).

    ``tensors`` maps slot names (``model.layers.3.mlp.up_proj.weight``, ``lm_head.weight``) to the
    worker's local shards, padding included; writing into them updates the worker's weights.
    """

    rank: int
    topology: Topology
    dp_rank: int
    tp_rank: int
    pp_rank: int
    device: torch.device
    tensors: dict[str, torch.Tensor]
    shards: tuple  # realloc.layout.Shard per slot, for global offsets


class _Background(threading.Thread):
    """Runs ``fn`` in a thread; ``join()`` returns its result or raises its exception."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in join
            self.error = err

    def join(self, timeout: float | None = None) -> Any:
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return self.result


class ShardWorker(CheckpointMixin):
    """One worker of a model group: its flat buffers, its process-group membership, its plans."""

    def __init__(self, group: str, spec: ModelSpec, zero_copy: bool, device: str | None = None):
        torch.set_num_threads(max(1, int(os.environ.get("REALLOC_TORCH_THREADS", "1"))))
        self.group, self.spec = group, spec
        if device is None:
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.allocator = BufferAllocator(self.device, zero_copy, group)
        self.layout: Layout | None = None
        self.rank: int | None = None
        self.buffers: dict[str, torch.Tensor] | None = None
        self.pending: tuple[Layout, int, dict[str, torch.Tensor]] | None = None
        self.transport: Transport | None = None
        self._store = None
        self._fault: tuple[str, float] | None = None
        self.staging = Staging(self.device)

    # -- identity and collective set-up ----------------------------------------------------
    def info(self) -> dict:
        return {
            "node_id": self.node_id, "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "device": str(self.device), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "zero_copy": self.allocator.shared,
        }

    def open_store(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        addr = ray.util.get_node_ip_address()
        self._store = host_store(addr, world_size, timeout_s)
        return addr, self._store.port

    def join(self, addr: str, port: int, world_rank: int, world_size: int, timeout_s: float) -> str:
        store, self._store = self._store, None
        if self.transport is not None:
            self.transport.close()
        self.transport = Transport(addr, port, world_rank, world_size, self.device, timeout_s, store=store)
        return self.transport.backend

    # -- weights -------------------------------------------------------------------------
    def set_layout(self, topology: Topology, rank: int, vocab_pad_multiple: int = 1) -> int:
        """Adopt an (empty, zeroed) layout; returns the bytes of this worker's buffers."""
        old = self.buffers
        self.layout = Layout(self.spec, topology, vocab_pad_multiple)
        self.rank = rank
        self.buffers = self.allocator.allocate(self.layout.buffer_numels(rank))
        self.allocator.release(old)
        return self.layout.rank_bytes(rank)

    def _store_now(self) -> ShardStore:
        if self.layout is None or self.buffers is None:
            raise RuntimeError(f"worker of {self.group} has no layout yet")
        return ShardStore(self.layout.shards(self.rank), self.buffers)

    def init_synthetic(self, seed: int) -> None:
        store = self._store_now()
        for s in self.layout.shards(self.rank):
            if s.numel:
                p = self.spec.param(s.param)
                store.write(s.param, s.offsets, s.sizes,
                            synthetic_box(s.param, p.shape, s.offsets, s.sizes, s.dtype, seed).to(self.device))

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Slice this worker's boxes out of full tensors (aliases like ``lm_head.weight`` accepted)."""
        store = self._store_now()
        for s in self.layout.shards(self.rank):
            if not s.numel:
                continue
            full = state.get(s.param)
            if full is None:
                full = state[s.slot]
            store.write(s.param, s.offsets, s.sizes, full[box_index(s.offsets, s.sizes)].to(self.device))

    def get_boxes(self) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
        """``(param, offsets, sizes, tensor)`` of every held box, on CPU (padding excluded)."""
        store = self._store_now()
        return [(s.param, s.offsets, s.sizes, store.view(s.param, s.offsets, s.sizes).cpu().clone())
                for s in self.layout.shards(self.rank) if s.numel]

    def verify_synthetic(self, seed: int) -> list[str]:
        """Names of slots whose values differ from the synthetic weights (padding must be zero)."""
        bad = []
        store = self._store_now()
        for s, local in ((s, t) for entries in store.by_param.values() for s, t in entries):
            expected = torch.zeros(s.local_shape, dtype=local.dtype)
            if s.numel:
                index = tuple(slice(0, n) for n in s.sizes)
                expected[index] = synthetic_box(s.param, self.spec.param(s.param).shape, s.offsets, s.sizes,
                                                s.dtype, seed)
            if not torch.equal(local.cpu(), expected):
                bad.append(s.slot)
        return bad

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        dp_rank, tp_rank, pp_rank = self.layout.topology.coords(self.rank)
        store = self._store_now()
        ctx = ShardContext(self.rank, self.layout.topology, dp_rank, tp_rank, pp_rank, self.device,
                           store.shard_tensors(), self.layout.shards(self.rank))
        return fn(ctx, *args, **kwargs)

    def source_digest(self) -> dict[str, float]:
        """A cheap fingerprint of the current buffers (tests: sources untouched after a failure)."""
        return {d: float(t.double().sum()) + float((t.double() ** 2).sum()) for d, t in (self.buffers or {}).items()}

    def inject_fault(self, kind: str, value: float) -> None:
        """Fault injection for tests of the failure path: ``("stall", seconds)`` sleeps at the start
        of the next plan phase; ``("exit_after_buckets", n)`` kills this process after ``n`` buckets."""
        if kind not in ("stall", "exit_after_buckets"):
            raise ValueError(f"unknown fault {kind!r}; allowed: 'stall', 'exit_after_buckets'")
        self._fault = (kind, value)

    def _after_bucket(self) -> None:
        if self._fault and self._fault[0] == "exit_after_buckets":
            remaining = self._fault[1] - 1
            self._fault = ("exit_after_buckets", remaining)
            if remaining <= 0:
                os._exit(1)

    # -- plans ---------------------------------------------------------------------------
    def prepare(self, dst: tuple[Topology, int] | None, vocab_pad_multiple: int = 1):
        """Allocate destination buffers for the coming plan; returns their zero-copy handles."""
        self.abort()
        if dst is None:
            return None
        layout = Layout(self.spec, dst[0], vocab_pad_multiple)
        # Every real element is written by the plan: only padding needs zeros in a reused buffer.
        buffers = self.allocator.allocate(layout.buffer_numels(dst[1]), zero=False)
        zero_padding(ShardStore(layout.shards(dst[1]), buffers))
        self.pending = (layout, dst[1], buffers)
        return self.allocator.export(buffers)

    def export_source(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # peers read these bytes from other processes
        return self.allocator.export(self.buffers) if self.buffers is not None else None

    def execute(self, plan: Plan, me: int, peers: list[PeerView], phase: int, tags: dict) -> dict:
        """Run phase ``phase`` (0: local copies and routes from holders, 1: intra-node fan-out)."""
        started = time.perf_counter()
        metrics.in_flight(tags, +1)
        try:
            return self._execute(plan, me, peers, phase, tags, started)
        finally:
            metrics.in_flight(tags, -1)

    def _execute(self, plan: Plan, me: int, peers: list[PeerView], phase: int, tags: dict, started: float) -> dict:
        src = self._store_now() if peers[me].src is not None else None
        dst = ShardStore(self.pending[0].shards(self.pending[1]), self.pending[2]) if self.pending else None
        moved = {"local": 0, "intra": 0, "inter": 0}
        local_copies = None
        if phase == 0:
            # Local copies write boxes no route writes, and torch copies release the GIL: run
            # them beside the transfers instead of before them.
            mine = [j for worker, j in plan.local_copies if worker == me]
            local_copies = _Background(lambda: sum(copy_local(src, dst, plan.segment_list(j)) for j in mine))
        if self._fault and self._fault[0] == "stall":
            seconds, self._fault = self._fault[1], None
            time.sleep(seconds)
        executor = StepRunner(self.transport, self.device, plan, me, peers, src, dst, self._peer_store,
                              on_bucket=self._after_bucket, staging=self.staging)
        steps = range(plan.forward_from) if phase == 0 else range(plan.forward_from, len(plan.steps))
        try:
            for s in steps:
                for kind, nbytes in executor.run_step(s):
                    moved[kind] += nbytes
        finally:  # never leave a thread writing into buffers an abort is about to recycle
            if local_copies is not None:
                moved["local"] += local_copies.join()
        staging = self.staging.nbytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        metrics.record(tags, moved, seconds)
        return {"bytes": moved, "seconds": seconds, "staging_bytes": staging,
                "dst_bytes": sum(t.numel() * t.element_size() for t in self.pending[2].values()) if self.pending else 0}

    def _peer_store(self, peer: PeerView, forward: bool) -> ShardStore:
        topology, rank = peer.dst if forward else peer.src
        handles = peer.dst_handles if forward else peer.src_handles
        return ShardStore(Layout(self.spec, topology).shards(rank), open_handles(handles))

    def commit(self, blend: float | None = None) -> None:
        """Adopt the destination buffers (or blend them into the current ones) and free the old."""
        if self.pending is None:
            return
        layout, rank, buffers = self.pending
        self.pending = None
        if blend is not None:
            from realloc.shards import blend_into

            blend_into(self.buffers, buffers, blend)
            self.allocator.release(buffers)
            return
        old = self.buffers
        self.layout, self.rank, self.buffers = layout, rank, buffers
        self.allocator.release(old)

    def abort(self) -> None:
        if self.pending is not None:
            self.allocator.release(self.pending[2])
            self.pending = None

    def shutdown(self) -> None:
        self.abort()
        self.allocator.release_all()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
