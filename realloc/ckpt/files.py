"""Rank files on disk: safetensors for the buffers, JSON for the manifest, both written atomically.

Write order makes a half-written checkpoint invisible: tensors go to a temp file in the same
directory, are fsynced and renamed into place; the manifest follows the same way, last. A
reader only trusts a rank file whose manifest exists, names the expected run/iteration/rank and
whose bytes match the recorded size and sha256 (whole file) or crc32 (one shard).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import safetensors.torch
import torch
from safetensors import safe_open

from realloc.atomic_files import TEMP_PREFIX, atomic_write, fsync_dir
from realloc.ckpt.errors import CorruptFileError
from realloc.ckpt.manifest import FORMAT, CheckpointId, Manifest, ShardRecord
from realloc.layout import Layout, Topology
from realloc.shards import TORCH_DTYPES

SAFETENSORS_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "F8_E4M3": "float8_e4m3fn",
}
_CHUNK = 16 << 20


def tensor_name(dtype: str) -> str:
    """Name of a rank's flat buffer of ``dtype`` inside its safetensors file."""
    return f"buffer.{dtype}"


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, without a copy (bf16 included)."""
    return t.contiguous().view(torch.uint8).numpy()


def replace_dir(new: Path, target: Path, keep: Callable[[str], bool] = lambda name: True) -> None:
    """Put the complete directory ``new`` at ``target`` (a sibling on the same filesystem) in one step.

    Entries of an existing ``target`` for which ``keep(name)`` is true and that ``new`` lacks are
    carried over first (hard links where the filesystem allows, else copies), so files a user keeps
    there (a tokenizer, a README) stay. Then the two directories are exchanged atomically
    (``renameat2(RENAME_EXCHANGE)``: a reader sees the old directory or the new one, never neither)
    and the old one is removed; where the kernel or filesystem cannot exchange, ``target`` is
    renamed aside, ``new`` renamed in, and the old one put back if that fails. Until the exchange
    ``target`` is untouched, so a failure before it leaves what was there as it was.
    """
    new, target = Path(new), Path(target)
    if not (target.exists() or target.is_symlink()):
        os.rename(new, target)
        fsync_dir(target.parent)
        return
    if target.is_symlink() or not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(target))
    for entry in sorted(target.iterdir()):
        if not keep(entry.name) or (new / entry.name).exists() or entry.name.startswith(TEMP_PREFIX):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)
    if _exchange(new, target):
        old = new  # the exchange left the previous directory at ``new``'s path
    else:
        old = target.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex[:8]}-{target.name}")
        os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old, target)
            raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: "str | Path", dst: "str | Path") -> None:
    if Path(src).is_symlink():
        os.symlink(os.readlink(src), dst)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's ``renameat2(RENAME_EXCHANGE)``; False where that is
    not available (another OS, an old kernel or libc, a filesystem without it)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def build_rank_file(
    ckpt_id: CheckpointId, layout: Layout, buffers: Mapping[str, torch.Tensor], node: str
) -> tuple[bytes, Manifest]:
    """Serialize one rank's buffers and describe them (no I/O).

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> from realloc.shards import allocate_buffers
        >>> lay = Layout(ModelSpec.preset("tiny"), Topology(tp=2))
        >>> data, man = build_rank_file(CheckpointId("r", 1, 0), lay, allocate_buffers(lay, 0), "n0")
        >>> man.file_bytes == len(data), len(man.sha256)
        (True, 64)
    """
    rank = ckpt_id.rank
    expected = layout.buffer_numels(rank)
    cpu = {d: t.detach().cpu().contiguous() for d, t in buffers.items()}
    if {d: t.numel() for d, t in cpu.items()} != expected:
        raise ValueError(
            f"buffers of rank {rank} have sizes { ({d: t.numel() for d, t in cpu.items()}) }, "
            f"layout {layout.topology} expects {expected}"
        )
    records = []
    for s in layout.shards(rank):
        local = byte_view(cpu[s.dtype][s.buffer_offset : s.buffer_offset + s.local_numel])
        records.append(ShardRecord.of(s, zlib.crc32(local)))
    metadata = {"format": FORMAT, "run_id": ckpt_id.run_id, "iteration": str(ckpt_id.iteration), "rank": str(rank)}
    data = safetensors.torch.save({tensor_name(d): t for d, t in cpu.items()}, metadata=metadata)
    spec = layout.spec
    manifest = Manifest(
        id=ckpt_id,
        world_size=layout.topology.world_size,
        topology=saved_topology(layout),
        vocab_pad_multiple=layout.vocab_pad_multiple,
        spec_name=spec.name,
        params={p.name: (tuple(p.shape), p.dtype) for p in spec.params},
        buffers=expected,
        shards=tuple(records),
        file_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        written_on=node,
        vocab_pad_rule=layout.vocab_pad_rule,
        qkv_order=layout.qkv_order,
        expert_order=layout.expert_order,
    )
    return data, manifest


def saved_topology(layout: Layout) -> Topology:
    """The topology a manifest records: the layers of every stage spelled out, so the saved layout
    never depends on which rule computed the split (rules and defaults may change; files stay)."""
    t = layout.topology
    return Topology(
        t.dp,
        t.tp,
        t.pp,
        layer_split=layout.layer_counts if t.pp > 1 else None,
        fsdp=t.fsdp,
        fsdp_split=t.fsdp_split,
        ep=t.ep,
        etp=t.etp,
    )


def rank_paths(directory: Path, ckpt_id: CheckpointId) -> tuple[Path, Path]:
    """``(tensors, manifest)`` paths of a rank file inside an iteration directory."""
    return directory / f"{ckpt_id.stem}.safetensors", directory / f"{ckpt_id.stem}.json"


def write_rank_file(
    directory: Path, data: "bytes | np.ndarray", manifest: Manifest, before_manifest: Callable[[], None] | None = None
) -> Path:
    """Write tensors then manifest atomically into ``directory``; returns the tensors path.

    ``before_manifest`` runs between the two writes (tests inject crashes there).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, meta = rank_paths(directory, manifest.id)
    atomic_write(tensors, data)
    if before_manifest is not None:
        before_manifest()
    atomic_write(meta, manifest.dumps().encode())
    return tensors


def read_manifest(path: Path, expect: CheckpointId | None = None) -> Manifest:
    """Parse a manifest file; ``CorruptFileError`` if unreadable or not the expected id."""
    try:
        manifest = Manifest.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptFileError(str(path), f"unreadable manifest ({exc})") from exc
    if expect is not None and manifest.id != expect:
        raise CorruptFileError(str(path), f"manifest is for {manifest.id}, expected {expect}")
    return manifest


def read_verified(path: Path, manifest: Manifest) -> torch.Tensor:
    """The whole rank file as a uint8 tensor, after checking its size and sha256 in the same pass."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CorruptFileError(str(path), f"missing ({exc.strerror})") from exc
    if size != manifest.file_bytes:
        raise CorruptFileError(str(path), f"size {size} != recorded {manifest.file_bytes}")
    out = torch.empty(size, dtype=torch.uint8)
    view = out.numpy()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        at = 0
        while at < size:
            n = f.readinto(memoryview(view[at : at + _CHUNK]))
            if not n:
                raise CorruptFileError(str(path), f"truncated while reading at byte {at}")
            digest.update(view[at : at + n])
            at += n
    if digest.hexdigest() != manifest.sha256:
        raise CorruptFileError(str(path), "sha256 mismatch")
    _check_identity(header_metadata(out), manifest, str(path))
    return out


def check_bytes(data: torch.Tensor, manifest: Manifest, what: str) -> None:
    """Checksum a rank file received over the network before trusting it."""
    if data.numel() != manifest.file_bytes or hashlib.sha256(data.numpy()).hexdigest() != manifest.sha256:
        raise CorruptFileError(what, f"received bytes of {manifest.id} do not match its sha256")


def _header(data: torch.Tensor) -> tuple[dict, int]:
    """The JSON header of safetensors bytes and where the data starts (8-byte little-endian length,
    then JSON: the format is that simple, and parsing it here lets tensors stay views of ``data``)."""
    raw = data[:8].numpy().tobytes()
    length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 0 < length <= data.numel() - 8:
        raise CorruptFileError("safetensors header", f"header length {length} does not fit {data.numel()} bytes")
    try:
        header = json.loads(data[8 : 8 + length].numpy().tobytes())
    except ValueError as exc:
        raise CorruptFileError("safetensors header", f"not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CorruptFileError("safetensors header", "not a JSON object")
    return header, 8 + length


def header_metadata(data: torch.Tensor) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes."""
    meta = _header(data)[0].get("__metadata__")
    return meta if isinstance(meta, dict) else {}


def _check_identity(meta: Mapping[str, str], manifest: Manifest, where: str) -> None:
    # The manifest could be a stray copy from another run; the tensors file names its own run.
    found = (meta.get("run_id"), meta.get("iteration"), meta.get("rank"))
    if found != (manifest.id.run_id, str(manifest.id.iteration), str(manifest.id.rank)):
        raise CorruptFileError(where, f"tensors file belongs to {found}, not {manifest.id}")


def buffers_from_bytes(data: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The flat buffers inside verified rank-file bytes (views, no copy), checked against the manifest."""
    header, start = _header(data)
    _check_identity(header.get("__metadata__") or {}, manifest, str(manifest.id))
    out = {}
    for dtype, numel in manifest.buffers.items():
        entry = header.get(tensor_name(dtype))
        nbytes = numel * TORCH_DTYPES[dtype].itemsize
        try:
            begin, end = (start + int(x) for x in entry["data_offsets"])
            ok = SAFETENSORS_DTYPES.get(entry["dtype"]) == dtype and list(entry["shape"]) == [numel]
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or end - begin != nbytes or end > data.numel():
            raise CorruptFileError(str(manifest.id), f"buffer {dtype} missing or of the wrong size")
        raw = data[begin:end]
        # Views need aligned addresses; safetensors aligns its tensors, but never trust a file.
        aligned = raw.data_ptr() % TORCH_DTYPES[dtype].itemsize == 0
        out[dtype] = (raw if aligned else raw.clone()).view(TORCH_DTYPES[dtype])
    return out


def read_shard(path: Path, manifest: Manifest, record: ShardRecord) -> torch.Tensor:
    """One shard's local tensor (padding included), read lazily and crc-checked.

    Only this shard's byte range is read from disk (safetensors slices are mmap-backed).
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            _check_identity(f.metadata() or {}, manifest, str(path))
            flat = f.get_slice(tensor_name(record.dtype))[
                record.buffer_offset : record.buffer_offset + record.local_numel
            ]
    except CorruptFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise CorruptFileError(str(path), f"unreadable ({exc})") from exc
    if flat.numel() != record.local_numel or zlib.crc32(byte_view(flat)) != record.crc32:
        raise CorruptFileError(str(path), f"crc32 mismatch in shard {record.slot} {record.offsets}")
    return flat.view(record.local_shape)
