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

from realloc.shards import TORCH_DTYPES, buffers_nbytes

SHM_DIR = "/dev/shm"


class BufferAllocator:
    """Allocates a worker's flat buffers where peers on its node can map them.

    Released buffers are kept as *spares* (one set: the last released) and handed out again for
    the same (dtype, size): an RL loop going train -> generate -> train reuses the pages it
    already touched instead of faulting in fresh ones (fresh /dev/shm pages fill at ~1 GB/s here,
    touched ones at ~10 GB/s). On GPUs torch's caching allocator does this by itself, so no
    spares are kept there (:meth:`release`).
    """

    def __init__(self, device: torch.device, shared: bool, tag: str):
        self.device = device
        self.shared = shared and (device.type == "cuda" or os.path.isdir(SHM_DIR))
        self.tag = tag
        self._paths: dict[int, str] = {}  # data_ptr of a shm-backed buffer -> its file
        self._spares: dict[tuple[str, int], torch.Tensor] = {}
        if self.shared and device.type != "cuda":
            sweep_stale_buffers()

    def allocate(self, numels: dict[str, int], zero: bool = True) -> dict[str, torch.Tensor]:
        """Buffers of the given sizes; zeroed unless ``zero=False`` (then a reused spare keeps old bytes)."""
        out = {}
        for dtype, n in numels.items():
            spare = self._spares.pop((dtype, n), None)
            if spare is not None:
                out[dtype] = spare.zero_() if zero else spare
            elif self.shared and self.device.type != "cuda":
                path = os.path.join(SHM_DIR, f"realloc-p{os.getpid()}-{self.tag}-{uuid.uuid4().hex[:12]}-{dtype}")
                out[dtype] = torch.from_file(path, shared=True, size=n, dtype=TORCH_DTYPES[dtype])
                self._paths[out[dtype].data_ptr()] = path
            else:
                out[dtype] = torch.zeros(n, dtype=TORCH_DTYPES[dtype], device=self.device)
        return out

    def release(self, buffers: dict[str, torch.Tensor] | None, keep: bool = True) -> None:
        """Give buffers back: kept as the spares for the next allocation (older spares are freed).

        GPU buffers are never kept: torch's caching allocator already hands their blocks to the
        next allocation of this process, and a spare set on a GPU that several workers share
        holds a layout per worker that the others cannot use (bench-gpu ran out of memory on
        llama-7b with it; docs/benchmarks.md, "GPU")."""
        if buffers is None:
            return
        self.drop_spares()
        keep = keep and self.device.type != "cuda"
        for dtype, t in buffers.items():
            if keep:
                self._spares[dtype, t.numel()] = t
            else:
                self._free(t)

    def drop_spares(self) -> int:
        """Free the spare set (before keeping a rollback copy, so memory stays two layouts);
        returns its bytes."""
        freed = buffers_nbytes(self._spares.values())
        for t in self._spares.values():
            self._free(t)
        self._spares = {}
        return freed

    def release_all(self) -> None:
        self._spares.clear()
        for path in self._paths.values():
            _unlink(path)
        self._paths.clear()

    def _free(self, t: torch.Tensor) -> None:
        """Unlink the file behind ``t``; the mapping lives until the last tensor view dies."""
        path = self._paths.pop(t.data_ptr(), None)
        if path is not None:
            _unlink(path)

    def export(self, buffers: dict[str, torch.Tensor]) -> dict[str, Any] | None:
        """Picklable handles a peer on this node opens with :func:`open_handles`."""
        if not self.shared:
            return None
        if self.device.type == "cuda":
            return {d: ("cuda", reduce_tensor(t)) for d, t in buffers.items()}
        return {d: ("shm", self._paths[t.data_ptr()], t.numel()) for d, t in buffers.items()}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_stale_buffers() -> int:
    """Unlink buffer files of dead processes on this node (workers killed with SIGKILL, or by
    Ray when a node is lost, cannot clean up after themselves); returns how many were removed."""
    removed = 0
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else ():
        if not name.startswith("realloc-p"):
            continue
        pid_text = name[len("realloc-p") :].split("-", 1)[0]
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


def handle_identity(handle: tuple) -> tuple:
    """What names the memory behind an exported buffer, the same for every export of it: the
    file and size (shm), or the CUDA IPC handle, offset and size of its storage plus the tensor's
    element offset and size (``reduce_tensor``'s arguments; the event and reference count
    differ per export)."""
    if handle[0] == "shm":
        return handle[1], handle[2]
    args = handle[1][1]
    return args[7], args[9], args[8], args[3], tuple(args[1])


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
