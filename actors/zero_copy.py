"""Zero-copy access to a peer's buffers inside one node.

CPU workers allocate their flat buffers in shared memory files (``/dev/shm``), so a peer on
the same node maps them and copies the boxes it needs straight into its own buffers: one
strided memcpy instead of pack + socket + unpack. GPU workers share buffers with CUDA IPC
(``torch.multiprocessing.reductions.reduce_tensor``) and copy device to device over NVLink.
A handle is small and picklable; the bytes never pass through Ray.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from realloc.shards import TORCH_DTYPES

SHM_DIR = "/dev/shm"


class BufferAllocator:
    """Allocates a worker's flat buffers where peers on its node can map them."""

    def __init__(self, device: torch.device, shared: bool, tag: str):
        self.device = device
        self.shared = shared and (device.type == "cuda" or os.path.isdir(SHM_DIR))
        self.tag = tag
        self.files: dict[int, list[str]] = {}  # id(buffers dict) -> files
        if self.shared and device.type != "cuda":
            sweep_stale_buffers()

    def allocate(self, numels: dict[str, int]) -> dict[str, torch.Tensor]:
        if not self.shared or self.device.type == "cuda":
            return {d: torch.zeros(n, dtype=TORCH_DTYPES[d], device=self.device) for d, n in numels.items()}
        out, files = {}, []
        for dtype, n in numels.items():
            path = os.path.join(SHM_DIR, f"realloc-p{os.getpid()}-{self.tag}-{uuid.uuid4().hex[:12]}-{dtype}")
            out[dtype] = torch.from_file(path, shared=True, size=n, dtype=TORCH_DTYPES[dtype])
            files.append(path)
        self.files[id(out)] = files
        return out

    def release(self, buffers: dict[str, torch.Tensor] | None) -> None:
        """Unlink the files behind ``buffers`` (mappings stay valid until the tensors die)."""
        if buffers is None:
            return
        for path in self.files.pop(id(buffers), []):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def release_all(self) -> None:
        for files in self.files.values():
            for path in files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self.files.clear()

    def export(self, buffers: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """Picklable handles a peer on this node opens with :func:`open_handles`."""
        if not self.shared:
            return None
        if self.device.type == "cuda":
            return {d: ("cuda", reduce_tensor(t)) for d, t in buffers.items()}
        paths = {p.rsplit("-", 1)[1]: p for p in self.files.get(id(buffers), [])}
        return {d: ("shm", paths[d], t.numel()) for d, t in buffers.items()}


def sweep_stale_buffers() -> int:
    """Unlink buffer files of dead processes on this node (workers killed with SIGKILL, or by
    Ray when a node is lost, cannot clean up after themselves); returns how many were removed."""
    removed = 0
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else ():
        if not name.startswith("realloc-p"):
            continue
        pid_text = name[len("realloc-p"):].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_handles(handles: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for dtype, handle in handles.items():
        if handle[0] == "cuda":
            rebuild, args = handle[1]
            out[dtype] = rebuild(*args)
        else:
            _, path, numel = handle
            out[dtype] = torch.from_file(path, shared=True, size=numel, dtype=TORCH_DTYPES[dtype])
    return out
