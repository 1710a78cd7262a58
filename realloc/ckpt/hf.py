"""Hugging Face safetensors directories: import into any layout, export from any layout.

A directory holds ``model.safetensors``, or several files plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``). Import reads only headers on
the driver (to fail on a bad directory before any traffic); each rank then reads just its own
boxes with ``safe_open(...).get_slice(name)[slices]``, which maps the file and touches only those
bytes. Export writes full tensors in spec order, cut into files of at most ``max_shard_bytes``
(a larger single tensor gets a file of its own); a tied head is not written (HF's
``tie_word_embeddings`` convention), and on import either name is accepted for it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import safetensors.torch
import torch
from safetensors import safe_open

from realloc.boxes import box_index
from realloc.ckpt.files import SAFETENSORS_DTYPES, atomic_write
from realloc.layout import Shard
from realloc.shards import TORCH_DTYPES, ShardStore
from realloc.spec import ModelSpec

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's "5GB"


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


def save_hf_dir(state: Mapping[str, torch.Tensor], path: "str | Path",
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write full tensors as a HF safetensors directory (index json when several files).

    Tensors go in the given order; the index is written last, each file atomically.
    """
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    if not state:
        raise ValueError("nothing to export: the state dict is empty")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if parts[-1] and used + nbytes > max_shard_bytes:
            parts.append({})
            used = 0
        parts[-1][name] = t.detach().cpu().contiguous()
        used += nbytes
    if len(parts) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    written = []
    for name, part in zip(names, parts):
        atomic_write(root / name, safetensors.torch.save(part, metadata={"format": "pt"}))
        written.append(root / name)
    # A directory holds one checkpoint: drop the other form so loaders cannot pick a stale one.
    if len(parts) == 1:
        (root / INDEX_FILE).unlink(missing_ok=True)
    else:
        (root / SINGLE_FILE).unlink(missing_ok=True)
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: n for n, part in zip(names, parts) for k in part}}
        atomic_write(root / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())
        written.append(root / INDEX_FILE)
    return written


def export_state(full: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors to export: storage parameters in spec order, tied aliases left out."""
    return {p.name: full[p.name] for p in spec.params}
