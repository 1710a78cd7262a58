"""Checkpoint identities and the per-rank metadata file (JSON, never pickle).

A rank file ``rank_<r>.safetensors`` holds the rank's flat per-dtype buffers (padding included);
its manifest ``rank_<r>.json`` says whose they are (run id, iteration, rank), in which layout
(topology, vocabulary padding, the spec's parameter table), where every shard sits in the buffers,
and how to check the bytes: the file's sha256 and a crc32 per shard (so a resharding load that
reads single shards verifies exactly what it reads). The shard table itself is trusted only as far
as :meth:`Manifest.check_layout` confirms it: exactly what the recorded layout gives the rank.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from realloc._checks import check_int, check_nonneg
from realloc.ckpt.errors import CorruptFileError
from realloc.layout import Layout, Shard, Topology
from realloc.layout.topology import DEFAULT_FSDP_SPLIT
from realloc.spec import DTYPE_BYTES, ModelSpec, describe_difference

FORMAT = "realloc-ckpt/1"
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Largest iteration: what a signed 64-bit integer (JSON readers, safetensors metadata) can carry.
MAX_ITERATION = 2**63 - 1
_ITERATION_DIR = re.compile(r"^iter_([0-9]{8,19})$")

ParamTable = dict[str, tuple[tuple[int, ...], str]]


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise ValueError(
            f"run id {run_id!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run_id


def check_iteration(iteration: object) -> int:
    """``iteration`` if it is an integer in ``0..MAX_ITERATION``, else ``ValueError``."""
    return check_int(
        "iteration",
        iteration,
        0,
        MAX_ITERATION,
        allowed=f"a non-negative integer no larger than MAX_ITERATION = 2**63 - 1 = {MAX_ITERATION}",
    )


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
        check_nonneg("rank", self.rank)

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
        return ShardRecord(
            shard.param,
            shard.slot,
            tuple(shard.offsets),
            tuple(shard.sizes),
            tuple(shard.local_shape),
            shard.dtype,
            shard.buffer_offset,
            crc32,
        )


_SHARD_FIELDS = ("param", "slot", "offsets", "sizes", "local_shape", "dtype", "buffer_offset")


def _same(recorded: Any, wanted: Any) -> bool:
    """Equal and of the same types all the way down (JSON's ``48.0`` or ``true`` is not ``48`` or ``1``)."""
    if type(recorded) is not type(wanted):
        return False
    if isinstance(wanted, (tuple, list)):
        return len(recorded) == len(wanted) and all(_same(a, b) for a, b in zip(recorded, wanted))
    if isinstance(wanted, dict):
        return recorded.keys() == wanted.keys() and all(_same(recorded[k], wanted[k]) for k in wanted)
    return recorded == wanted


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
    vocab_pad_rule: str = "megatron"  # engine conventions (realloc.layout.conventions); in JSON only when not
    qkv_order: str = "hf"  # the default, so manifests of default layouts are unchanged
    expert_order: str = "hf"

    # -- layout ---------------------------------------------------------------------------
    @property
    def layout_options(self) -> dict:
        """The saved layout's options: ``Layout(spec, topology, **options)`` (see ``Layout.options``)."""
        return {
            "vocab_pad_multiple": self.vocab_pad_multiple,
            "vocab_pad_rule": self.vocab_pad_rule,
            "qkv_order": self.qkv_order,
            "expert_order": self.expert_order,
        }

    def layout(self, spec: ModelSpec) -> Layout:
        """The saved layout, over ``spec`` (which must have this manifest's parameters)."""
        self.check_spec(spec)
        return Layout(spec, self.topology, **self.layout_options)

    def check_layout(self, spec: ModelSpec) -> Layout:
        """The saved layout over ``spec``, after checking that this manifest is what a save of that
        layout writes for its rank (so a shard table edited by hand cannot misplace rows).

        ``ValueError`` (from :meth:`check_spec`) if ``spec`` is another model;
        :class:`CorruptFileError` naming the first field that differs otherwise: world size or rank
        against the topology, a topology the model cannot take, the buffer sizes, or any field of
        a shard record but its crc32 (which only the file's bytes can confirm).

        Example:
            >>> import dataclasses
            >>> from realloc.ckpt.files import build_rank_file
            >>> from realloc.shards import allocate_buffers
            >>> spec = ModelSpec.preset("tiny")
            >>> lay = Layout(spec, Topology(tp=2))
            >>> man = build_rank_file(CheckpointId("r", 1, 0), lay, allocate_buffers(lay, 0), "n0")[1]
            >>> str(man.check_layout(spec).topology)
            'dp=1,tp=2,pp=1'
            >>> bad = dataclasses.replace(man, buffers={"bfloat16": 1})
            >>> bad.check_layout(spec)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            realloc.ckpt.errors.CorruptFileError: r/iter_1/rank_0: buffers: recorded {'bfloat16': 1}, layout says ...
        """
        self.check_spec(spec)
        self._check_world()
        try:
            layout = Layout(spec, self.topology, **self.layout_options)
        except ValueError as exc:
            raise CorruptFileError(
                str(self.id), f"model {spec.name!r} cannot be laid out in the recorded topology {self.topology}: {exc}"
            ) from exc
        self.check_records(layout)
        return layout

    def check_records(self, layout: Layout) -> None:
        """:meth:`check_layout` but for the model, with the saved layout already built (callers
        checking many manifests of one save build it once and call :meth:`check_spec` themselves);
        ``ValueError`` if ``layout`` is not the saved one."""
        if Layout(layout.spec, self.topology, **self.layout_options) != layout:
            raise ValueError(
                f"layout {layout.topology} ({_options_text(layout.options)}) is not "
                f"the saved {self.topology} ({_options_text(self.layout_options)}) of {self.id}"
            )
        self._check_world()
        rank = self.id.rank
        expected = layout.buffer_numels(rank)
        if not _same(self.buffers, expected):
            self._corrupt(f"buffers: recorded {self.buffers}, layout says {expected}")
        shards = layout.shards(rank)
        if len(self.shards) != len(shards):
            self._corrupt(f"{len(self.shards)} shard records, layout says {len(shards)}")
        for i, (record, shard) in enumerate(zip(self.shards, shards)):
            for name in _SHARD_FIELDS:
                recorded, wanted = getattr(record, name), getattr(shard, name)
                if not _same(recorded, wanted):
                    self._corrupt(
                        f"shard record {i} ({shard.slot}) field {name}: recorded {recorded!r}, layout says {wanted!r}"
                    )

    def _check_world(self) -> None:
        if self.world_size != self.topology.world_size or not 0 <= self.id.rank < self.topology.world_size:
            self._corrupt(
                f"world size {self.world_size} and rank {self.id.rank}: recorded, topology {self.topology} "
                f"says world size {self.topology.world_size}"
            )

    def _corrupt(self, reason: str) -> None:
        raise CorruptFileError(str(self.id), reason)

    def check_spec(self, spec: ModelSpec) -> None:
        """``ValueError`` unless ``spec`` has exactly the saved parameters (names, shapes, dtypes)."""
        difference = describe_difference(self.params, param_table(spec), "checkpoint", "model")
        if difference:
            raise ValueError(
                f"checkpoint {self.id} was saved from model {self.spec_name!r} whose parameters "
                f"differ from {spec.name!r}: {difference}"
            )

    def layout_key(self) -> tuple:
        """Equal for every rank file of one consistent save."""
        return (
            self.id.run_id,
            self.id.iteration,
            self.world_size,
            self.topology,
            self.vocab_pad_multiple,
            tuple(sorted((k, v) for k, v in self.params.items())),
            self.vocab_pad_rule,
            self.qkv_order,
            self.expert_order,
        )

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        t = self.topology
        topology = {"dp": t.dp, "tp": t.tp, "pp": t.pp, "layer_split": list(t.layer_split) if t.layer_split else None}
        if t.fsdp > 1:  # written only when sharded, so manifests without FSDP are unchanged
            topology["fsdp"] = t.fsdp
        if t.fsdp_split != DEFAULT_FSDP_SPLIT:  # likewise: only for ZeRO-3 flat partitions
            topology["fsdp_split"] = t.fsdp_split
        if t.ep != 1:  # likewise: only with expert parallelism
            topology["ep"] = t.ep
        if t.etp is not None:
            topology["etp"] = t.etp
        data = {
            "format": FORMAT,
            "run_id": self.id.run_id,
            "iteration": self.id.iteration,
            "rank": self.id.rank,
            "world_size": self.world_size,
            "topology": topology,
            "vocab_pad_multiple": self.vocab_pad_multiple,
            "spec": {"name": self.spec_name, "params": {k: [list(s), d] for k, (s, d) in self.params.items()}},
            "buffers": dict(self.buffers),
            "shards": [
                [
                    s.param,
                    s.slot,
                    list(s.offsets),
                    list(s.sizes),
                    list(s.local_shape),
                    s.dtype,
                    s.buffer_offset,
                    s.crc32,
                ]
                for s in self.shards
            ],
            "file": {"bytes": self.file_bytes, "sha256": self.sha256},
            "written_on": self.written_on,
        }
        for name, default in (("vocab_pad_rule", "megatron"), ("qkv_order", "hf"), ("expert_order", "hf")):
            if getattr(self, name) != default:  # written only when not the default
                data[name] = getattr(self, name)
        return data

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
                topology=Topology(
                    topo["dp"],
                    topo["tp"],
                    topo["pp"],
                    tuple(split) if split else None,
                    fsdp=topo.get("fsdp", 1),
                    fsdp_split=topo.get("fsdp_split", DEFAULT_FSDP_SPLIT),
                    ep=topo.get("ep", 1),
                    etp=topo.get("etp"),
                ),
                vocab_pad_multiple=int(data["vocab_pad_multiple"]),
                spec_name=str(data["spec"]["name"]),
                params={k: (tuple(int(x) for x in s), str(d)) for k, (s, d) in data["spec"]["params"].items()},
                buffers={str(k): int(v) for k, v in data["buffers"].items()},
                shards=tuple(
                    ShardRecord(p, sl, tuple(o), tuple(z), tuple(ls), d, int(bo), int(c))
                    for p, sl, o, z, ls, d, bo, c in data["shards"]
                ),
                file_bytes=int(data["file"]["bytes"]),
                sha256=str(data["file"]["sha256"]),
                written_on=str(data["written_on"]),
                vocab_pad_rule=str(data.get("vocab_pad_rule", "megatron")),
                qkv_order=str(data.get("qkv_order", "hf")),
                expert_order=str(data.get("expert_order", "hf")),
            )
        # a missing key, a value of the wrong kind (a list where an object belongs: AttributeError)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
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


def _options_text(options: dict) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in options.items())
