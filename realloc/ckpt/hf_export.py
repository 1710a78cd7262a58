"""HF export from a model group: which worker assembles and writes which whole tensors.

Every storage parameter (a tied head is not written: HF ties it to the embedding) is assembled
once, whole, on one *writer* worker, which writes it into its own safetensors files; the driver
never holds a tensor. The driver then runs one :func:`~realloc.plan.plan_exchange` with the
group's current layout as holdings and the writers' whole tensors as needs, so the bytes a writer
lacks move node-aware and balanced like any other plan (a part a writer holds is a local copy).

Assignment (:func:`assign_writers`), deterministic:

* **How many writers.** As many as the files a single writer would cut the model into
  (``ceil(total / max_shard_bytes)``, so the directory looks like ``save_pretrained``'s), at most
  the group's workers; ``writers=`` overrides it.
* **Which tensor where.** Tensors go largest first (then in spec order). A worker is *eligible*
  for a tensor when its bytes after taking it stay within ``max(total / writers, least load +
  tensor)``: that keeps every writer within ``total / writers + largest tensor`` (the list-
  scheduling bound of LPT). Among eligible workers (only the opened writers once there are
  ``writers`` of them) the choice is: most bytes of the tensor already held (less traffic), then
  the least-loaded node (writes spread over nodes, dp twins on other nodes), then the least-loaded
  worker, then the lowest rank.
* **Files.** Each writer's tensors, in spec order, are cut into files of at most
  ``max_shard_bytes`` (:func:`~realloc.ckpt.hf.split_files`); files are numbered by the spec
  position of their first tensor and named as HF does (:func:`~realloc.ckpt.hf.file_names`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from realloc._checks import check_positive
from realloc.ckpt.errors import CheckpointError
from realloc.ckpt.hf import Arena, check_max_shard_bytes, file_names, split_files
from realloc.layout import Group, Layout
from realloc.plan import Placement


@dataclass(frozen=True)
class WriterFile:
    """One weight file: its name, its writer and its tensors (in spec order)."""

    name: str
    writer: int
    tensors: tuple[str, ...]
    nbytes: int  # tensor bytes (the file adds its header)


@dataclass(frozen=True)
class ExportAssignment:
    """Writers of one export: every storage tensor is in exactly one file of one writer."""

    layout: Layout
    files: tuple[WriterFile, ...]

    @property
    def writer_of(self) -> dict[str, int]:
        return {t: f.writer for f in self.files for t in f.tensors}

    @property
    def writers(self) -> list[int]:
        return sorted({f.writer for f in self.files})

    def loads(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for f in self.files:
            out[f.writer] = out.get(f.writer, 0) + f.nbytes
        return out

    def files_of(self, writer: int) -> list[WriterFile]:
        return [f for f in self.files if f.writer == writer]

    def weight_map(self) -> dict[str, str]:
        return {t: f.name for f in self.files for t in f.tensors}

    def needs(self) -> list[Group]:
        """Planner input: each writer needs its tensors whole."""
        spec = self.layout.spec.by_name
        return [
            Group(
                (w,),
                tuple(
                    sorted(
                        (t, (0,) * len(spec[t].shape), tuple(spec[t].shape))
                        for f in self.files_of(w)
                        for t in f.tensors
                    )
                ),
            )
            for w in self.writers
        ]

    def arena(self, writer: int, metadata: dict[str, str] | None = None) -> Arena:
        """The byte layout of ``writer``'s files (what it receives into and writes)."""
        spec = self.layout.spec.by_name
        return Arena.plan(
            [(f.name, [(t, tuple(spec[t].shape), spec[t].dtype) for t in f.tensors]) for f in self.files_of(writer)],
            metadata,
        )


def assign_writers(
    layout: Layout, placement: Placement, max_shard_bytes: int, writers: int | None = None
) -> ExportAssignment:
    """Writers and files of an HF export of ``layout`` (see the module docstring for the rules).

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> lay = Layout(ModelSpec.preset("tiny"), Topology(tp=2, pp=2))
        >>> a = assign_writers(lay, Placement.blocks(4, 2), max_shard_bytes=300_000)
        >>> len(a.writers), len(a.files), sorted(a.writer_of) == sorted(p.name for p in lay.spec.params)
        (3, 3, True)
    """
    check_max_shard_bytes(max_shard_bytes)
    world = layout.topology.world_size
    if placement.num_workers < world:
        raise ValueError(f"placement has {placement.num_workers} workers, layout {layout.topology} needs {world}")
    if writers is not None:
        check_positive("writers", writers)
    spec = layout.spec
    total = spec.total_bytes()
    count = min(world, writers if writers is not None else max(1, math.ceil(total / max_shard_bytes)))
    held = _held_bytes(layout)
    node_names = sorted(set(placement.nodes[:world]))
    node_of = np.array([node_names.index(placement.nodes[w]) for w in range(world)])
    load = np.zeros(world, dtype=np.int64)
    node_load = np.zeros(len(node_names), dtype=np.int64)
    opened = np.zeros(world, dtype=bool)
    ids = np.arange(world)
    cap = total / count
    position = {p.name: i for i, p in enumerate(spec.params)}
    chosen: dict[str, int] = {}
    for p in sorted(spec.params, key=lambda p: (-p.nbytes, position[p.name])):
        pool = opened if opened.sum() >= count else np.ones(world, dtype=bool)
        n = p.nbytes
        limit = max(cap, load[pool].min() + n)
        eligible = np.flatnonzero(pool & (load + n <= limit))
        have = np.zeros(world, dtype=np.int64)
        for w, b in held.get(p.name, ()):
            have[w] = b
        e = eligible
        best = e[np.lexsort((ids[e], load[e], node_load[node_of[e]], -have[e]))[0]]
        chosen[p.name] = int(best)
        load[best] += n
        node_load[node_of[best]] += n
        opened[best] = True
    per_writer: dict[int, list[str]] = {}
    for p in spec.params:  # spec order inside a writer
        per_writer.setdefault(chosen[p.name], []).append(p.name)
    parts = sorted(
        (
            (w, part)
            for w, names in per_writer.items()
            for part in split_files([(t, spec.by_name[t].nbytes) for t in names], max_shard_bytes)
        ),
        key=lambda wp: position[wp[1][0]],
    )
    names = file_names(len(parts))
    files = tuple(
        WriterFile(name, w, tuple(part), sum(spec.by_name[t].nbytes for t in part))
        for name, (w, part) in zip(names, parts)
    )
    return ExportAssignment(layout, files)


def _held_bytes(layout: Layout) -> dict[str, list[tuple[int, int]]]:
    """Per parameter, ``(worker, bytes of it held)`` for every worker holding some of it."""
    out: dict[str, dict[int, int]] = {}
    item = {p.name: p.itemsize for p in layout.spec.params}
    for group in layout.groups():
        for param, _, sizes in group.pieces:
            nbytes = math.prod(sizes) * item[param]
            per = out.setdefault(param, {})
            for w in group.workers:
                per[w] = per.get(w, 0) + nbytes
    return {p: sorted(ws.items()) for p, ws in out.items()}


def check_reported(assignment: ExportAssignment, reports: Sequence[dict]) -> None:
    """:class:`CheckpointError` unless the writers reported exactly the assigned files and tensors."""
    expected = {f.name: (f.writer, list(f.tensors)) for f in assignment.files}
    got = {r["name"]: (r["writer"], list(r["tensors"])) for r in reports}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        raise CheckpointError(
            f"HF export: writers reported files {sorted(got)[:5]}, expected {sorted(expected)[:5]} "
            f"(missing {missing[:5]})"
        )
