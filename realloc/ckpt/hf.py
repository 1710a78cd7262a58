"""Hugging Face safetensors directories: import into any layout, export from any layout.

A directory holds ``model.safetensors``, or several files plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``). Import reads only headers on
the driver (to fail on a bad directory before any traffic: shapes, dtype kinds, tied pairs); each
rank then reads just its own boxes with ``safe_open(...).get_slice(name)[slices]``, which maps the
file and touches only those bytes, after checking that the tensor is still what the driver
scanned. Export writes full tensors cut into files of at most ``max_shard_bytes`` (a larger
single tensor gets a file of its own) into a staging directory beside the target, verifies it and
swaps it in whole (:class:`StagedHFDir`): a failed export never destroys the one before. A tied
head is not written (HF's ``tie_word_embeddings`` convention), and on import either name is
accepted for it (both only when their bytes are equal: :func:`check_ties`). A file is laid out as an
:class:`Arena` (its bytes with every tensor at its final place), so the workers of a model group
receive tensors straight into the file they write (``realloc.ckpt.hf_export`` plans who writes
what); :func:`save_hf_dir` writes tensors held in one process the same way.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import re
import shutil
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open

from realloc._checks import check_positive
from realloc.boxes import box_index
from realloc.ckpt.errors import CheckpointError
from realloc.ckpt.files import SAFETENSORS_DTYPES, atomic_write, replace_dir
from realloc.layout import Shard
from realloc.shards import TORCH_DTYPES, ShardStore
from realloc.shards.convert import block_box, dequantize_blocks, write_box
from realloc.spec import DTYPE_BYTES, ModelSpec
from realloc.spec.formats import BLOCK, FP8, hf_weight_format, quantized, scale_name, unformatted

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


def dtype_kind(dtype: str) -> str:
    """``"float"``, ``"int"``, ``"uint"`` or ``"bool"``: what a value of ``dtype`` means.

    Example:
        >>> dtype_kind("bfloat16"), dtype_kind("int8"), dtype_kind("uint8")
        ('float', 'int', 'uint')
    """
    for kind in ("uint", "int", "bool"):
        if dtype.startswith(kind):
            return kind
    return "float"


def match_spec(tensors: Mapping[str, HFTensor], spec: ModelSpec) -> dict[str, str]:
    """Storage parameter -> tensor name to read it from; ``ValueError`` listing every mismatch.

    A tied storage parameter may come from its alias (``lm_head.weight``) when the embedding is
    absent (transformers ties the present one too). Float dtypes may differ (the values are cast
    to the spec's dtype on import, as ``from_pretrained(dtype=...)`` casts); any other change of
    dtype kind is refused: integers cast into float parameters are not weights (an int8 export
    holds quantized values whose scales live elsewhere), nor floats cast into integers. A block-FP8
    weight (``float8_e4m3fn``) needs its ``weight_scale_inv`` beside it; the scales of a weight the
    import quantizes (a block-FP8 layout read from a bf16 checkpoint) map to nothing.

    A checkpoint's tensors are read as the format its own dtypes say: a ``<weight>_scale_inv``
    holds block scales only beside a ``float8_e4m3fn`` weight. One beside a weight of another dtype
    (a bf16 checkpoint that kept the scales of an earlier FP8 export) is refused, naming it: read
    as scales, it would overwrite the scales an FP8 layout computes for that weight.
    """
    stale = sorted(
        n
        for n in tensors
        if n.endswith("_scale_inv") and (w := n[: -len("_scale_inv")]) in tensors and tensors[w].dtype != FP8
    )
    if stale:
        w = stale[0][: -len("_scale_inv")]
        raise ValueError(
            f"HF checkpoint holds {len(stale)} block-scale tensor(s) beside weights that are not float8_e4m3fn, "
            f"e.g. {stale[0]!r} beside {w!r} ({tensors[w].dtype}): block scales belong only to a float8_e4m3fn "
            "weight, so these are stale (left from an earlier FP8 export?) and would be read over the scales "
            "of the weights as the checkpoint holds them. Remove them from the checkpoint, or export the "
            "weights in FP8 with their scales"
        )
    mapping, problems = {}, []
    by_name = spec.by_name
    for p in spec.params:
        names = [p.name] + ([alias] if (alias := spec.tied_head_of(p.name)) else [])
        found = next((n for n in names if n in tensors), None)
        weight = p.name[: -len("_scale_inv")] if p.name.endswith("_scale_inv") else None
        quantizes = weight in by_name and weight in tensors and by_name[weight].dtype == FP8
        if quantizes and tensors[weight].dtype != FP8:
            continue  # the block scales of a weight the import quantizes: written with it, never read
        if found is not None and tensors[found].dtype == FP8:  # a block-FP8 checkpoint's weight
            scales = tensors.get(scale_name(found))
            grid = tuple(-(-n // BLOCK) for n in p.shape)
            if scales is None or scales.shape != grid or dtype_kind(scales.dtype) != "float":
                problems.append(
                    f"{found} is float8_e4m3fn, but {scale_name(found)} (its float scales {grid}, one per "
                    f"{BLOCK} x {BLOCK} block) is {'missing' if scales is None else f'{scales.shape} {scales.dtype}'}: "
                    "only block-FP8 checkpoints (quantization_config weight_block_size [128, 128]) are read"
                )
                continue
        if found is None:
            problems.append(f"{p.name} is missing")
        elif tensors[found].shape != tuple(p.shape):
            problems.append(f"{found} has shape {tensors[found].shape}, the model needs {tuple(p.shape)}")
        elif dtype_kind(tensors[found].dtype) != dtype_kind(p.dtype):
            problems.append(
                f"{found} is {tensors[found].dtype}, the model's {p.name} is {p.dtype}: an import "
                f"casts only between float dtypes, never {dtype_kind(tensors[found].dtype)} values into "
                f"{dtype_kind(p.dtype)} ones (dequantize the checkpoint first)"
            )
        else:
            mapping[p.name] = found
    if problems:
        raise ValueError(
            f"HF checkpoint does not fit model {spec.name!r}: {len(problems)} problems, e.g. {problems[:3]}"
        )
    return mapping


def check_declared_format(path: "str | Path", tensors: Mapping[str, HFTensor], spec: ModelSpec) -> None:
    """``ValueError`` when a checkpoint's ``config.json`` (if it has one) and its tensors' dtypes
    say different formats: a checkpoint is read as the format both say, never as one of them.

    A ``quantization_config`` of block FP8 (:func:`~realloc.spec.formats.hf_weight_format`) with a
    weight it quantizes that is not ``float8_e4m3fn`` (a bf16 re-export that kept the FP8 config),
    or no ``quantization_config`` beside ``float8_e4m3fn`` tensors (transformers would not read them
    as quantized), is refused naming a tensor; so is a quantization this project does not read.
    """
    where = Path(path) / CONFIG_FILE
    if not where.is_file():
        return
    try:
        config = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where} is not a readable JSON config: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{where} is not a JSON object")
    fmt, excluded = hf_weight_format(config)
    fp8 = sorted(n for n, t in tensors.items() if t.dtype == FP8)
    if fmt is None and fp8:
        raise ValueError(
            f"{where} declares no quantization_config, but the checkpoint holds {len(fp8)} float8_e4m3fn "
            f"tensors, e.g. {fp8[0]!r}: the config and the dtypes disagree about the format. Add the block-FP8 "
            "quantization_config (quant_method 'fp8', weight_block_size [128, 128]) or dequantize the weights"
        )
    if fmt is not None:
        wrong = [
            p.name
            for p in unformatted(spec).params
            if quantized(p, excluded) and p.name in tensors and tensors[p.name].dtype != FP8
        ]
        if wrong:
            raise ValueError(
                f"{where} declares {fmt} (quantization_config {config['quantization_config']!r}), but {len(wrong)} "
                f"weights it quantizes are not float8_e4m3fn, e.g. {wrong[0]!r} ({tensors[wrong[0]].dtype}): the "
                "config and the dtypes disagree about the format (a re-export in another dtype that kept the FP8 "
                "config?). Fix config.json or the weights"
            )


def check_ties(
    path: "str | Path", tensors: Mapping[str, HFTensor], spec: ModelSpec, chunk_bytes: int = 64 << 20
) -> None:
    """``ValueError`` when a checkpoint holds both names of a tied pair with different contents.

    transformers disagrees with itself on such a checkpoint: version 5 loads the two untied when
    both are present and differ, whatever ``tie_word_embeddings`` says
    (``src/transformers/modeling_utils.py``, ``PreTrainedModel.tie_weights``: "both are present in
    the checkpoints with different values, so we will NOT tie them"), while 4.x ties the head to
    the embedding after loading. A tied spec holds one tensor, so neither reading is possible
    without silently dropping one; the import is refused. Byte-equal copies (a ``.bin``
    conversion writes both names) are one tensor and import as such. The two tensors are compared
    in chunks of about ``chunk_bytes``, on the driver, before any traffic.
    """
    root = Path(path)
    for p in spec.params:
        alias = spec.tied_head_of(p.name)
        if alias is None or p.name not in tensors or alias not in tensors:
            continue
        a, b = tensors[p.name], tensors[alias]
        same = a.shape == b.shape and a.dtype == b.dtype and _equal_bytes(root, p.name, a, alias, b, chunk_bytes)
        if not same:
            raise ValueError(
                f"HF checkpoint {str(root)!r} holds both {p.name!r} {a.shape} {a.dtype} and {alias!r} {b.shape} "
                f"{b.dtype}, and they differ: it is untied, but model {spec.name!r} ties them and holds one tensor. "
                "transformers 5 would load this checkpoint untied (4.x would keep the embedding), so no choice here "
                f"would match it: import into an untied spec (tie_word_embeddings=False), or drop {alias!r} from "
                "the checkpoint to tie the head to the embedding"
            )


def _equal_bytes(root: Path, name_a: str, a: HFTensor, name_b: str, b: HFTensor, chunk_bytes: int) -> bool:
    rows = a.shape[0] if a.shape else 1
    row_bytes = max(1, math.prod(a.shape[1:]) * DTYPE_BYTES[a.dtype]) if a.shape else DTYPE_BYTES[a.dtype]
    step = max(1, chunk_bytes // row_bytes)
    with safe_open(str(root / a.file), framework="pt") as fa, safe_open(str(root / b.file), framework="pt") as fb:
        if not a.shape:
            return torch.equal(_raw(fa.get_tensor(name_a)), _raw(fb.get_tensor(name_b)))
        sa, sb = fa.get_slice(name_a), fb.get_slice(name_b)
        return all(torch.equal(_raw(sa[i : i + step]), _raw(sb[i : i + step])) for i in range(0, rows, step))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (NaNs compare equal, -0.0 differs from 0.0: a copy, not a value match)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def load_shards(
    path: "str | Path",
    tensors: Mapping[str, HFTensor],
    mapping: Mapping[str, str],
    shards: Iterable[Shard],
    store: ShardStore,
) -> int:
    """Read each shard's box from the HF files into ``store``; returns the bytes read.

    Example:
        >>> import tempfile
        >>> from realloc.layout import Layout
        >>> from realloc.shards import allocate_buffers
        >>> from realloc import Topology
        >>> from realloc.shards.synthetic import synthetic_state_dict
        >>> spec, d = ModelSpec.preset("tiny"), tempfile.mkdtemp()
        >>> _ = save_hf_dir(synthetic_state_dict(spec), d)
        >>> lay = Layout(spec, Topology(tp=2))
        >>> st = ShardStore(lay.shards(1), allocate_buffers(lay, 1))
        >>> load_shards(d, scan_hf_dir(d), match_spec(scan_hf_dir(d), spec), lay.shards(1), st) > 0
        True
    """
    by_file: dict[str, list[Shard]] = defaultdict(list)
    for s in shards:
        if s.numel and s.param in mapping:  # not in it: block scales written with their weight
            by_file[tensors[mapping[s.param]].file].append(s)
    read = 0
    for name, file_shards in sorted(by_file.items()):
        where = Path(path) / name
        with _changed_on_error(where):
            f = safe_open(str(where), framework="pt")
        with f:
            for s in file_shards:
                tensor = mapping[s.param]
                with _changed_on_error(where):
                    sl = f.get_slice(tensor)
                    found = (tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
                scanned = (tensors[tensor].shape, tensors[tensor].dtype)
                if found != scanned:
                    raise CheckpointError(
                        f"{where}: tensor {tensor!r} is {found[0]} {found[1]} now, but was {scanned[0]} {scanned[1]} "
                        "when the directory was scanned: the file changed during the import. Nothing was imported; "
                        "import again once the directory stays as it is"
                    )
                box = sl[box_index(s.offsets, s.sizes)]
                read += box.numel() * box.element_size()
                if box.dtype == torch.float8_e4m3fn and s.dtype != FP8:  # a block-FP8 checkpoint: dequantize
                    held = tensors[scale_name(tensor)]
                    with _changed_on_error(where), safe_open(str(Path(path) / held.file), framework="pt") as g:
                        scale = g.get_slice(scale_name(tensor))[box_index(*block_box(s.offsets, s.sizes))]
                    read += scale.numel() * scale.element_size()
                    box = dequantize_blocks(box, scale, TORCH_DTYPES[s.dtype], s.offsets)
                write_box(store, s.param, s.offsets, s.sizes, box, s.dtype)  # a block-FP8 layout quantizes
    return read


@contextlib.contextmanager
def _changed_on_error(where: Path) -> Iterator[None]:
    """A file the driver scanned that a worker cannot open or find a tensor in has changed since."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types for a missing or damaged file
        raise CheckpointError(
            f"{where} could not be read as scanned ({type(exc).__name__}: {exc}): the directory "
            "changed during the import. Nothing was imported"
        ) from exc


def check_max_shard_bytes(max_shard_bytes: object) -> int:
    return check_positive("max_shard_bytes", max_shard_bytes)


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
    def plan(
        files: Sequence[tuple[str, Sequence[tuple[str, tuple[int, ...], str]]]],
        metadata: Mapping[str, str] | None = None,
    ) -> "Arena":
        """``files``: ``(file name, [(tensor, shape, dtype), ...])`` in order."""
        images, shards, at = [], [], 0
        for name, entries in files:
            order = sorted(range(len(entries)), key=lambda i: (-DTYPE_BYTES[entries[i][2]], i))
            header: dict = {"__metadata__": dict(metadata if metadata is not None else {"format": "pt"})}
            offset, placed = 0, []
            for i in order:
                tensor, shape, dtype = entries[i]
                nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
                header[tensor] = {
                    "dtype": _SAFETENSORS_CODES[dtype],
                    "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes],
                }
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
            data[f.start : f.start + len(f.header)].copy_(torch.frombuffer(bytearray(f.header), dtype=torch.uint8))
        buffers = {d: data.view(TORCH_DTYPES[d]) for d in {s.dtype for s in self.shards}}
        return data, ShardStore(self.shards, buffers)

    def file_bytes(self, data: torch.Tensor, i: int) -> torch.Tensor:
        f = self.files[i]
        return data[f.start : f.start + f.nbytes]

    def write(self, data: torch.Tensor, root: "str | Path") -> list[dict]:
        """Write every file atomically into the existing directory ``root``; ``[{name, bytes, sha256,
        tensors}]`` (the sha256 of the bytes sent to the file)."""
        root = Path(root)
        out = []
        for i, f in enumerate(self.files):
            view = self.file_bytes(data, i).cpu().numpy()
            atomic_write(root / f.name, view)
            out.append(
                {
                    "name": f.name,
                    "bytes": f.nbytes,
                    "sha256": hashlib.sha256(view).hexdigest(),
                    "tensors": list(f.tensors),
                }
            )
        return out


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a file an HF export writes (weights, index, configs): what a new export
    replaces in its directory; every other entry there (a tokenizer, a README) is kept."""
    return name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE) or bool(_SHARD_NAME.match(name))


def check_export_dir(path: object) -> Path:
    """The absolute directory an export goes to; ``ValueError`` for a non-path or an existing non-directory."""
    if not isinstance(path, (str, Path)):
        raise ValueError(f"HF export directory must be a path, got {type(path).__name__}")
    if not str(path).strip():
        raise ValueError(f"HF export directory must be a non-empty path, got {str(path)!r}")
    target = Path(path).absolute()
    if (target.exists() or target.is_symlink()) and not target.is_dir():
        raise ValueError(
            f"HF export path {str(target)!r} exists and is not a directory: pass a directory "
            "(new or holding an earlier export)"
        )
    return target


@dataclass(frozen=True)
class StagedHFDir:
    """A new HF directory written beside ``target`` (``path``, a hidden sibling on the same
    filesystem) and put in its place whole by :func:`finish_hf_dir` once verified: until then the
    directory at ``target`` (an earlier export, say) is untouched, and a failed export leaves it as
    it was."""

    target: Path
    path: Path

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def begin_hf_dir(path: "str | Path") -> StagedHFDir:
    """Make the staging directory of an export to ``path`` (:class:`CheckpointError` naming the
    directory and what to do when it cannot be made)."""
    target = check_export_dir(path)
    staged = StagedHFDir(target, target.with_name(f".{target.name}.export-{uuid.uuid4().hex[:8]}"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.path.mkdir()
    except OSError as exc:
        raise export_io_error(target, exc) from exc
    return staged


def export_io_error(target: Path, exc: OSError) -> CheckpointError:
    """The project's error for a failed file operation of an export to ``target``: the path, the
    cause and what to do; the directory's earlier content is untouched (see :class:`StagedHFDir`)."""
    advice = {
        errno.ENOSPC: "free space on that filesystem or export elsewhere",
        errno.EDQUOT: "free space on that filesystem or export elsewhere",
        errno.EROFS: "choose a writable directory",
        errno.EACCES: "choose a directory whose parent you may write to",
        errno.EPERM: "choose a directory whose parent you may write to",
        errno.ENOENT: "the directory or its parent was removed while the export ran; export again",
    }
    what = advice.get(exc.errno, "check the directory and export again")
    return CheckpointError(
        f"HF export to {str(target)!r} failed: {exc.strerror or exc} ({exc.filename or target}). "
        f"An export is written beside the directory and swapped in whole: {what}. What was there "
        "before is unchanged"
    )


def finish_hf_dir(
    staged: StagedHFDir,
    expected: Mapping[str, tuple[int, Sequence[str]]],
    weight_map: Mapping[str, str],
    total_size: int,
    extra: Mapping[str, Mapping] | None = None,
) -> list[Path]:
    """Complete a staged export and put it in place; the paths written, under the target.

    Writes ``extra`` JSON files (``config.json``...) and the index (several weight files), then
    verifies the staged directory against ``expected`` (weight file -> its size in bytes and its
    tensors, as planned): every file there with that size and a safetensors header naming exactly
    those tensors, the index naming only those files, no other weight file. Only then is the
    directory swapped in (:func:`~realloc.ckpt.files.replace_dir`; other files of the target,
    a tokenizer, stay). Any failure discards the staged directory and raises
    :class:`CheckpointError`, the target untouched.
    """
    root, names = staged.path, list(expected)
    try:
        written = []
        for name, content in (extra or {}).items():
            atomic_write(root / name, (json.dumps(content, indent=2, sort_keys=True) + "\n").encode())
            written.append(name)
        if names != [SINGLE_FILE]:
            index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write(root / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True).encode())
            written.append(INDEX_FILE)
        problems = verify_hf_dir(root, expected, weight_map if names != [SINGLE_FILE] else None)
        if problems:
            raise CheckpointError(
                f"HF export to {str(staged.target)!r} failed verification ({len(problems)} problems, "
                f"e.g. {problems[:3]}). Nothing was put in place: what was there before is unchanged"
            )
        replace_dir(root, staged.target, keep=lambda name: not is_export_file(name))
    except OSError as exc:
        staged.discard()
        raise export_io_error(staged.target, exc) from exc
    except BaseException:
        staged.discard()
        raise
    return [staged.target / n for n in names + written]


def verify_hf_dir(
    root: Path, expected: Mapping[str, tuple[int, Sequence[str]]], weight_map: Mapping[str, str] | None
) -> list[str]:
    """What is wrong with the weight files in ``root`` against ``expected`` (name -> bytes, tensors)."""
    problems = []
    present = {p.name for p in root.iterdir() if p.name == SINGLE_FILE or _SHARD_NAME.match(p.name)}
    problems += [f"unexpected weight file {n}" for n in sorted(present - set(expected))]
    for name, (nbytes, tensors) in expected.items():
        where = root / name
        try:
            size = where.stat().st_size
            with open(where, "rb") as f:
                head = f.read(8)
                length = int.from_bytes(head, "little") if len(head) == 8 else -1
                header = json.loads(f.read(length)) if 0 < length <= size - 8 else None
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        except (OSError, ValueError) as exc:
            problems.append(f"{name} is unreadable ({exc})")
            continue
        if size != nbytes:
            problems.append(f"{name} has {size} bytes, {nbytes} were written")
        elif not isinstance(header, dict) or set(header) - {"__metadata__"} != set(tensors):
            problems.append(f"{name}'s header does not name its tensors {sorted(tensors)[:3]}")
    if weight_map is not None:
        problems += [
            f"the index maps {t} to {n}, not a file of this export"
            for t, n in sorted(weight_map.items())
            if n not in expected
        ]
    return problems


def save_hf_dir(
    state: Mapping[str, torch.Tensor],
    path: "str | Path",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    extra: Mapping[str, Mapping] | None = None,
) -> list[Path]:
    """Write full tensors held here as a HF safetensors directory (index json when several files).

    Staged and swapped in like the workers' export (``actors.driver.checkpoint.CheckpointManager.export_hf``,
    same file layout and naming): tensors go in the given order, each file atomically, ``extra``
    JSON files (``config.json``) next, the index last, all verified before the directory at
    ``path`` is replaced (its other files stay).
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
    staged = begin_hf_dir(path)
    expected = {}
    try:
        for fname, part in zip(names, parts):
            arena = Arena.plan([(fname, [(n, *entries[n]) for n in part])])
            data, store = arena.allocate()
            for n in part:
                shape = entries[n][0]
                store.write(n, (0,) * len(shape), shape, state[n].detach().cpu())
            arena.write(data, staged.path)
            expected[fname] = (arena.files[0].nbytes, part)
    except OSError as exc:
        staged.discard()
        raise export_io_error(staged.target, exc) from exc
    except BaseException:
        staged.discard()
        raise
    weight_map = {n: fname for fname, part in zip(names, parts) for n in part}
    total = sum(math.prod(s) * DTYPE_BYTES[d] for s, d in entries.values())
    return finish_hf_dir(staged, expected, weight_map, total, extra)


def export_state(full: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors to export: storage parameters in spec order, tied aliases left out."""
    return {p.name: full[p.name] for p in spec.params}
