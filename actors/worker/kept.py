"""Resident layouts: a layout's buffers kept after the group moved away from it.

An RL loop moves its weights train layout -> generation layout -> train layout every
iteration, and generation does not change them. With ``group.reallocate(dst, keep=...)`` each
worker keeps the buffers of the layout it leaves, tagged with the group's *weight version*
(a counter the driver bumps at every change of the weights: a fill, a load, a copy into the
group, a replacement, and every ``run``/``call`` unless told ``writes=False``). Then:

* moving back to a kept layout whose version is the current one *adopts* it: every worker swaps
  buffers, no byte travels (from host memory: one local copy back to the device);
* moving to a kept layout whose version is stale *refreshes* it: the plan writes into the kept
  buffers (same memory as before, so modules and CUDA graphs bound to them stay valid).

``keep`` is where the kept buffers live: ``"in_place"`` (the worker's device, as they were) or
``"host"`` (copied to host memory, pinned on GPUs, and the device buffers freed, so generation
gets the device memory back; on CPU workers this is a private copy and buys nothing).

This module holds the worker-side record and copies; the order (:class:`~actors.records.KeepOrder`,
:data:`~actors.records.KEEP_MODES`) and the driver-side record (:class:`~actors.records.ResidentLayout`)
are in :mod:`actors.records`; the protocol steps are ``ShardWorker.op_run``/``op_adopt`` and
``ModelGroup.reallocate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from realloc.layout import RankLayout
from realloc.shards import buffers_nbytes


@dataclass
class Resident:
    """One worker's kept layout: its rank of the layout, its buffers (device or host) and the
    weight version they hold."""

    held: RankLayout
    buffers: dict[str, torch.Tensor]
    version: int
    where: str

    @property
    def nbytes(self) -> int:
        return buffers_nbytes(self.buffers.values())


def to_host(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``buffers`` (pinned when they are on a GPU, so copies back run at full speed)."""
    out = {}
    for dtype, t in buffers.items():
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        out[dtype] = host
    if any(t.is_cuda for t in buffers.values()):
        torch.cuda.synchronize()
    return out


def copy_into(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> int:
    """Copy every buffer of ``src`` into the equal-sized one of ``dst``; returns the bytes copied."""
    for dtype, t in src.items():
        dst[dtype].copy_(t, non_blocking=t.is_pinned())
    if any(t.is_cuda for t in dst.values()):
        torch.cuda.synchronize()
    return buffers_nbytes(src.values())
