"""Checkpoint identities and the per-rank metadata file (JSON, never pickle).

A rank file ``rank_<r>.safetensors`` holds the rank's flat per-dtype buffers (padding included);
its manifest ``rank_<r>.json`` says whose they are (run id, iteration, rank), in which layout
(topology, vocabulary padding, the spec's parameter table), where every shard sits in the buffers,
and how to check the bytes: the file's sha256 and a crc32 per shard (so a resharding load that
reads single shards verifies exactly what it reads).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from realloc.layout import Layout, Shard
from realloc.spec import DTYPE_BYTES, ModelSpec, describe_difference
from realloc.topology import Topology

FORMAT = "realloc-ckpt/1"
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Largest iteration: what a signed 64-bit integer (JSON readers, safetensors metadata) can carry.
MAX_ITERATION = 2**63 - 1
_ITERATION_DIR = re.compile(r"^iter_([0-9]{8,19})$")

ParamTable = dict[str, tuple[tuple[int, ...], str]]


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise ValueError(f"run id {run_id!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return run_id


def check_iteration(iteration: object) -> int:
    """``iteration`` if it is an integer in ``0..MAX_ITERATION``, else ``ValueError``."""
    if not isinstance(iteration, int) or isinstance(iteration, bool) or not 0 <= iteration <= MAX_ITERATION:
        raise ValueError(f"iteration must be an integer from 0 to MAX_ITERATION = 2**63 - 1 = {MAX_ITERATION}, "
                         f"got {iteration!r}")
    return iteration


def iteration_dir_name(iteration: int) -> str:
    """The directory name of ``iteration``: ``iter_`` and at least 8 digits.

    Example:
        >>> iteration_dir_name(12), iteration_dir_name(100_000_000)
        ('iter_00000012', 'iter_100000000')
    """
    return f"iter_{check_iteration(iteration):08d}"


def parse_iteration_dir(name: str) -> int | None:
    """The iteration whose directory is named ``name``, or ``None`` if :func:`iteration_dir_name`
    never writes that name (too few digits, extra leading zeros, beyond ``MAX_ITERATION``).

    Example:
        >>> parse_iteration_dir("iter_100000000"), parse_iteration_dir("iter_000000012")
        (100000000, None)
    """
    match = _ITERATION_DIR.match(name)
    if not match:
        return None
    iteration = int(match.group(1))
    if iteration > MAX_ITERATION or iteration_dir_name(iteration) != name:
        return None
    return iteration


@dataclass(frozen=True, order=True)
class CheckpointId:
    """Which run, iteration and rank a rank file belongs to.

    Example:
        >>> cid = CheckpointId("run-a", 12, 3)
        >>> cid.iteration_dir, cid.stem, str(cid)
        ('iter_00000012', 'rank_00003', 'run-a/iter_12/rank_3')
    """

    run_id: str
    iteration: int
    rank: int

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_iteration(self.iteration)
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"rank must be a non-negative integer, got {self.rank!r}")

    @property
    def iteration_dir(self) -> str:
        return iteration_dir_name(self.iteration)

    @property
    def stem(self) -> str:
        return f"rank_{self.rank:05d}"

    def __str__(self) -> str:
        return f"{self.run_id}/iter_{self.iteration}/rank_{self.rank}"


@dataclass(frozen=True)
class ShardRecord(Shard):
    """A layout :class:`Shard` as stored in a rank file, with the crc32 of its local bytes."""

    crc32: int = 0

    @property
    def local_nbytes(self) -> int:
        return self.local_numel * DTYPE_BYTES[self.dtype]

    @property
    def key(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """The stored box (same key in every file that stores it: dp replicas, tied copies)."""
        return self.param, self.offsets, self.sizes

    @staticmethod
    def of(shard: Shard, crc32: int) -> "ShardRecord":
        return ShardRecord(shard.param, shard.slot, tuple(shard.offsets), tuple(shard.sizes),
                           tuple(shard.local_shape), shard.dtype, shard.buffer_offset, crc32)


def param_table(spec: ModelSpec) -> ParamTable:
    return {p.name: (tuple(p.shape), p.dtype) for p in spec.params}


@dataclass(frozen=True)
class Manifest:
    """Metadata of one rank file. ``to_json``/``from_json`` round-trip it exactly."""

    id: CheckpointId
    world_size: int
    topology: Topology
    vocab_pad_multiple: int
    spec_name: str
    params: ParamTable
    buffers: dict[str, int]  # dtype -> elements of that flat buffer
    shards: tuple[ShardRecord, ...]
    file_bytes: int
    sha256: str
    written_on: str  # the node the rank ran on when it saved

    # -- layout ---------------------------------------------------------------------------
    def layout(self, spec: ModelSpec) -> Layout:
        """The saved layout, over ``spec`` (which must have this manifest's parameters)."""
        self.check_spec(spec)
        return Layout(spec, self.topology, self.vocab_pad_multiple)

    def same_layout(self, layout: Layout) -> bool:
        return layout.topology == self.topology and layout.vocab_pad_multiple == self.vocab_pad_multiple

    def check_spec(self, spec: ModelSpec) -> None:
        """``ValueError`` unless ``spec`` has exactly the saved parameters (names, shapes, dtypes)."""
        difference = describe_difference(self.params, param_table(spec), "checkpoint", "model")
        if difference:
            raise ValueError(f"checkpoint {self.id} was saved from model {self.spec_name!r} whose parameters "
                             f"differ from {spec.name!r}: {difference}")

    def layout_key(self) -> tuple:
        """Equal for every rank file of one consistent save."""
        return (self.id.run_id, self.id.iteration, self.world_size, self.topology, self.vocab_pad_multiple,
                tuple(sorted((k, v) for k, v in self.params.items())))

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        t = self.topology
        return {
            "format": FORMAT,
            "run_id": self.id.run_id, "iteration": self.id.iteration, "rank": self.id.rank,
            "world_size": self.world_size,
            "topology": {"dp": t.dp, "tp": t.tp, "pp": t.pp,
                         "layer_split": list(t.layer_split) if t.layer_split else None},
            "vocab_pad_multiple": self.vocab_pad_multiple,
            "spec": {"name": self.spec_name, "params": {k: [list(s), d] for k, (s, d) in self.params.items()}},
            "buffers": dict(self.buffers),
            "shards": [[s.param, s.slot, list(s.offsets), list(s.sizes), list(s.local_shape), s.dtype,
                        s.buffer_offset, s.crc32] for s in self.shards],
            "file": {"bytes": self.file_bytes, "sha256": self.sha256},
            "written_on": self.written_on,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(data: Any) -> "Manifest":
        """Parse a manifest; ``ValueError`` naming the first thing that is wrong."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a {FORMAT} manifest (format {found!r})")
        try:
            topo = data["topology"]
            split = topo.get("layer_split")
            manifest = Manifest(
                id=CheckpointId(data["run_id"], data["iteration"], data["rank"]),
                world_size=int(data["world_size"]),
                topology=Topology(topo["dp"], topo["tp"], topo["pp"], tuple(split) if split else None),
                vocab_pad_multiple=int(data["vocab_pad_multiple"]),
                spec_name=str(data["spec"]["name"]),
                params={k: (tuple(int(x) for x in s), str(d)) for k, (s, d) in data["spec"]["params"].items()},
                buffers={str(k): int(v) for k, v in data["buffers"].items()},
                shards=tuple(ShardRecord(p, sl, tuple(o), tuple(z), tuple(ls), d, int(bo), int(c))
                             for p, sl, o, z, ls, d, bo, c in data["shards"]),
                file_bytes=int(data["file"]["bytes"]),
                sha256=str(data["file"]["sha256"]),
                written_on=str(data["written_on"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"manifest is missing or has a malformed field: {exc!r}") from exc
        if manifest.world_size != manifest.topology.world_size or not manifest.id.rank < manifest.world_size:
            raise ValueError(f"manifest of {manifest.id}: rank/world size do not fit topology {manifest.topology}")
        for dtype in manifest.buffers:
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"manifest of {manifest.id}: unknown dtype {dtype!r}")
        return manifest

    @staticmethod
    def loads(text: str) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"manifest is not valid JSON: {exc}") from exc
        return Manifest.from_json(data)
