"""Hugging Face safetensors directories: import into any layout, export from any layout.

A directory holds ``model.safetensors``, or several files plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``). Import reads only headers on
the driver (to fail on a bad directory before any traffic); each rank then reads just its own
boxes with ``safe_open(...).get_slice(name)[slices]``, which maps the file and touches only those
bytes. Export writes full tensors cut into files of at most ``max_shard_bytes`` (a larger single
tensor gets a file of its own); a tied head is not written (HF's ``tie_word_embeddings``
convention), and on import either name is accepted for it. A file is laid out as an
:class:`Arena` (its bytes with every tensor at its final place), so the workers of a model group
receive tensors straight into the file they write (``realloc.ckpt.hf_export`` plans who writes
what); :func:`save_hf_dir` writes tensors held in one process the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from safetensors import safe_open

from realloc.boxes import box_index
from realloc.ckpt.files import SAFETENSORS_DTYPES, atomic_write
from realloc.layout import Shard
from realloc.shards import TORCH_DTYPES, ShardStore
from realloc.spec import DTYPE_BYTES, ModelSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's "5GB"
_SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
_SHARD_NAME = re.compile(r"^model-[0-9]{5,}-of-[0-9]{5,}\.safetensors$")


@dataclass(frozen=True)
class HFTensor:
    file: str
    shape: tuple[int, ...]
    dtype: str


def scan_hf_dir(path: "str | Path") -> dict[str, HFTensor]:
    """Every tensor of a HF safetensors directory (headers only).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = save_hf_dir({"w": torch.zeros(2, 3)}, d)
        >>> scan_hf_dir(d)["w"]
        HFTensor(file='model.safetensors', shape=(2, 3), dtype='float32')
    """
    if not isinstance(path, (str, Path)):
        raise ValueError(f"HF checkpoint directory must be a path, got {type(path).__name__}")
    root = Path(path)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ValueError(f"HF checkpoint directory {str(root)!r} {what}")
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index (needs a 'weight_map' object): {exc!r}") from exc
    elif (root / SINGLE_FILE).exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise ValueError(f"{str(root)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    out: dict[str, HFTensor] = {}
    for name in files:
        if not isinstance(name, str) or "/" in name or not (root / name).is_file():
            raise ValueError(f"{index} names file {name!r}, which is not in {str(root)!r}")
        try:
            with safe_open(str(root / name), framework="pt") as f:
                for key in f.keys():
                    if weight_map is not None and weight_map.get(key) != name:
                        continue  # the index is authoritative about which file holds a tensor
                    sl = f.get_slice(key)
                    dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{name}: tensor {key!r} has unsupported dtype {sl.get_dtype()}")
                    out[key] = HFTensor(name, tuple(sl.get_shape()), dtype)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' own error types
            raise ValueError(f"{root / name} is not a readable safetensors file: {exc}") from exc
    if weight_map is not None:
        absent = sorted(k for k in weight_map if k not in out)
        if absent:
            raise ValueError(f"{index} maps {len(absent)} tensors that are not in their files, e.g. {absent[:3]}")
    return out


def match_spec(tensors: Mapping[str, HFTensor], spec: ModelSpec) -> dict[str, str]:
    """Storage parameter -> tensor name to read it from; ``ValueError`` listing every mismatch.

    A tied storage parameter may come from its alias (``lm_head.weight``) when the embedding is
    absent. dtypes may differ (the values are cast to the spec's dtype on import).
    """
    mapping, problems = {}, []
    for p in spec.params:
        names = [p.name] + ([alias] if (alias := spec.tied_head_of(p.name)) else [])
        found = next((n for n in names if n in tensors), None)
        if found is None:
            problems.append(f"{p.name} is missing")
        elif tensors[found].shape != tuple(p.shape):
            problems.append(f"{found} has shape {tensors[found].shape}, the model needs {tuple(p.shape)}")
        else:
            mapping[p.name] = found
    if problems:
        raise ValueError(f"HF checkpoint does not fit model {spec.name!r}: {len(problems)} problems, "
                         f"e.g. {problems[:3]}")
    return mapping


def load_shards(path: "str | Path", tensors: Mapping[str, HFTensor], mapping: Mapping[str, str],
                shards: Iterable[Shard], store: ShardStore) -> int:
    """Read each shard's box from the HF files into ``store``; returns the bytes read.

    Example:
        >>> import tempfile
        >>> from realloc.layout import Layout
        >>> from realloc.shards import allocate_buffers
        >>> from realloc import Topology
        >>> from realloc.synthetic import synthetic_state_dict
        >>> spec, d = ModelSpec.preset("tiny"), tempfile.mkdtemp()
        >>> _ = save_hf_dir(synthetic_state_dict(spec), d)
        >>> lay = Layout(spec, Topology(tp=2))
        >>> st = ShardStore(lay.shards(1), allocate_buffers(lay, 1))
        >>> load_shards(d, scan_hf_dir(d), match_spec(scan_hf_dir(d), spec), lay.shards(1), st) > 0
        True
    """
    by_file: dict[str, list[Shard]] = defaultdict(list)
    for s in shards:
        if s.numel:
            by_file[tensors[mapping[s.param]].file].append(s)
    read = 0
    for name, file_shards in sorted(by_file.items()):
        with safe_open(str(Path(path) / name), framework="pt") as f:
            for s in file_shards:
                box = f.get_slice(mapping[s.param])[box_index(s.offsets, s.sizes)]
                store.write(s.param, s.offsets, s.sizes, box.to(TORCH_DTYPES[s.dtype]))
                read += box.numel() * box.element_size()
    return read


def check_max_shard_bytes(max_shard_bytes: object) -> int:
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    return max_shard_bytes


def split_files(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names cut, in order, into files of at most ``max_shard_bytes`` tensor bytes (a larger
    tensor gets a file of its own), as transformers' ``save_pretrained`` does.

    Example:
        >>> split_files([("a", 6), ("b", 5), ("c", 4), ("d", 20)], 10)
        [['a'], ['b', 'c'], ['d']]
    """
    parts: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not parts or (parts[-1] and used + nbytes > max_shard_bytes):
            parts.append([])
            used = 0
        parts[-1].append(name)
        used += nbytes
    return parts


def file_names(count: int) -> list[str]:
    """HF names of ``count`` weight files: one ``model.safetensors``, or ``model-0000i-of-0000n``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclass(frozen=True)
class FileImage:
    """One safetensors file inside an :class:`Arena`: bytes ``[start, start + nbytes)``."""

    name: str
    start: int
    nbytes: int
    header: bytes  # the 8-byte length and the JSON header, padded to 8 bytes
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Arena:
    """Byte images of safetensors files laid out in one buffer, every tensor at its final place.

    Tensors are received (or copied) straight into the file bytes through :meth:`store`, so the
    buffer *is* the files: writing them is one ``write`` each, with no serialisation copy. Inside
    a file, tensors go by decreasing itemsize (then in the given order), as safetensors orders
    them, so each one is aligned for a typed view of the whole buffer; files start at multiples of 8.

    Example:
        >>> import safetensors.torch
        >>> arena = Arena.plan([("f.safetensors", [("w", (2, 3), "float32"), ("b", (3,), "bfloat16")])])
        >>> data, store = arena.allocate()
        >>> store.write("w", (0, 0), (2, 3), torch.ones(2, 3))
        >>> store.write("b", (0,), (3,), torch.zeros(3, dtype=torch.bfloat16))
        >>> safetensors.torch.load(arena.file_bytes(data, 0).numpy().tobytes())["w"].sum().item()
        6.0
    """

    files: tuple[FileImage, ...]
    shards: tuple[Shard, ...]
    nbytes: int

    @staticmethod
    def plan(files: Sequence[tuple[str, Sequence[tuple[str, tuple[int, ...], str]]]],
             metadata: Mapping[str, str] | None = None) -> "Arena":
        """``files``: ``(file name, [(tensor, shape, dtype), ...])`` in order."""
        images, shards, at = [], [], 0
        for name, entries in files:
            order = sorted(range(len(entries)), key=lambda i: (-DTYPE_BYTES[entries[i][2]], i))
            header: dict = {"__metadata__": dict(metadata if metadata is not None else {"format": "pt"})}
            offset, placed = 0, []
            for i in order:
                tensor, shape, dtype = entries[i]
                nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
                header[tensor] = {"dtype": _SAFETENSORS_CODES[dtype], "shape": list(shape),
                                  "data_offsets": [offset, offset + nbytes]}
                placed.append((tensor, tuple(shape), dtype, offset))
                offset += nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            head = len(text).to_bytes(8, "little") + text
            for tensor, shape, dtype, off in placed:
                byte = at + len(head) + off
                shards.append(Shard(tensor, tensor, (0,) * len(shape), shape, shape, dtype, byte // DTYPE_BYTES[dtype]))
            size = len(head) + offset
            images.append(FileImage(name, at, size, head, tuple(e[0] for e in entries)))
            at += size + (-size % 8)
        return Arena(tuple(images), tuple(shards), at)

    def allocate(self, device: "str | torch.device" = "cpu") -> tuple[torch.Tensor, ShardStore]:
        """The byte buffer (headers filled in) and a store addressing every whole tensor in it."""
        data = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for f in self.files:
            data[f.start:f.start + len(f.header)].copy_(torch.frombuffer(bytearray(f.header), dtype=torch.uint8))
        buffers = {d: data.view(TORCH_DTYPES[d]) for d in {s.dtype for s in self.shards}}
        return data, ShardStore(self.shards, buffers)

    def file_bytes(self, data: torch.Tensor, i: int) -> torch.Tensor:
        f = self.files[i]
        return data[f.start:f.start + f.nbytes]

    def write(self, data: torch.Tensor, root: "str | Path") -> list[dict]:
        """Write every file atomically into ``root``; ``[{name, bytes, sha256, tensors}]``."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        out = []
        for i, f in enumerate(self.files):
            view = self.file_bytes(data, i).cpu().numpy()
            atomic_write(root / f.name, view)
            out.append({"name": f.name, "bytes": f.nbytes, "sha256": hashlib.sha256(view).hexdigest(),
                        "tensors": list(f.tensors)})
        return out


def begin_hf_dir(path: "str | Path") -> Path:
    """Create the directory and drop its index: until the new index is written last, no loader
    pairs it with a mix of old and new files."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / INDEX_FILE).unlink(missing_ok=True)
    return root


def finish_hf_dir(path: "str | Path", files: Sequence[str], weight_map: Mapping[str, str], total_size: int,
                  extra: Mapping[str, Mapping] | None = None) -> list[Path]:
    """Write ``extra`` JSON files (``config.json``...), then the index (several weight files) last;
    drop the other form and weight files of an earlier export, so the directory holds one checkpoint."""
    root = Path(path)
    written = []
    for name, content in (extra or {}).items():
        atomic_write(root / name, (json.dumps(content, indent=2, sort_keys=True) + "\n").encode())
        written.append(root / name)
    keep = set(files)
    if list(files) == [SINGLE_FILE]:
        (root / INDEX_FILE).unlink(missing_ok=True)
    else:
        (root / SINGLE_FILE).unlink(missing_ok=True)
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write(root / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())
        written.append(root / INDEX_FILE)
    for stale in root.glob("model-*-of-*.safetensors"):
        if stale.name not in keep and _SHARD_NAME.match(stale.name):
            stale.unlink(missing_ok=True)
    return written


def save_hf_dir(state: Mapping[str, torch.Tensor], path: "str | Path",
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra: Mapping[str, Mapping] | None = None) -> list[Path]:
    """Write full tensors held here as a HF safetensors directory (index json when several files).

    Tensors go in the given order, each file atomically, ``extra`` JSON files (``config.json``)
    next, the index last. The same file layout and naming as the workers' export
    (``actors.checkpoint.CheckpointManager.export_hf``).
    """
    check_max_shard_bytes(max_shard_bytes)
    if not state:
        raise ValueError("nothing to export: the state dict is empty")
    entries = {}
    for name, t in state.items():
        dtype = next((d for d, td in TORCH_DTYPES.items() if td == t.dtype), None)
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(TORCH_DTYPES)}")
        entries[name] = (tuple(t.shape), dtype)
    parts = split_files([(n, math.prod(s) * DTYPE_BYTES[d]) for n, (s, d) in entries.items()], max_shard_bytes)
    names = file_names(len(parts))
    root = begin_hf_dir(path)
    written = []
    for fname, part in zip(names, parts):
        arena = Arena.plan([(fname, [(n, *entries[n]) for n in part])])
        data, store = arena.allocate()
        for n in part:
            shape = entries[n][0]
            store.write(n, (0,) * len(shape), shape, state[n].detach().cpu())
        arena.write(data, root)
        written.append(root / fname)
    weight_map = {n: fname for fname, part in zip(names, parts) for n in part}
    total = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in entries.values())
    return written + finish_hf_dir(root, names, weight_map, total, extra)


def export_state(full: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors to export: storage parameters in spec order, tied aliases left out."""
    return {p.name: full[p.name] for p in spec.params}
