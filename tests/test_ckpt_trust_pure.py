"""What the checkpoint layer trusts, without Ray: picklable errors, iteration names, manifests
checked against their layout, and disagreeing copies judged by their bytes, not by vote."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

from realloc import Layout, ModelSpec, Placement, Topology, plan_exchange
from realloc.ckpt.catalog import Catalog
from realloc.ckpt.errors import CheckpointError, CorruptFileError, MissingShardsError
from realloc.ckpt.files import build_rank_file, buffers_from_bytes, read_shard, read_verified, write_rank_file
from realloc.ckpt.local_store import NodeStore
from realloc.ckpt.manifest import CheckpointId, Manifest, param_table
from realloc.ckpt.reshard import assign_readers, box_of_local, boxes_store, reshard_groups
from realloc.local_executor import execute_in_process
from realloc.shards import ShardStore, allocate_buffers
from realloc.synthetic import synthetic_box

TINY = ModelSpec.preset("tiny")
RUN = "run-t"
TP2 = Layout(TINY, Topology(tp=2))


def synthetic_buffers(layout: Layout, rank: int, seed: int = 5) -> dict[str, torch.Tensor]:
    buffers = allocate_buffers(layout, rank)
    store = ShardStore(layout.shards(rank), buffers)
    for s in layout.shards(rank):
        if s.numel:
            p = layout.spec.param(s.param)
            store.write(s.param, s.offsets, s.sizes, synthetic_box(s.param, p.shape, s.offsets, s.sizes, s.dtype, seed))
    return buffers


def save(root: Path, layout: Layout, nodes: list[str], iteration: int = 1) -> dict[int, tuple[bytes, Manifest]]:
    """Every rank's file of ``layout``, written by node ``nodes[0]`` and copied verbatim to the others."""
    files = {}
    for rank in range(layout.topology.world_size):
        data, manifest = build_rank_file(CheckpointId(RUN, iteration, rank), layout,
                                         synthetic_buffers(layout, rank), nodes[0])
        for node in nodes:
            write_rank_file(NodeStore(root, RUN, node).iteration_dir(iteration), data, manifest)
        files[rank] = data, manifest
    return files


def catalog_of(root: Path, nodes, spec: ModelSpec = TINY) -> Catalog:
    return Catalog([NodeStore(root, RUN, n).list() for n in nodes], spec)


def edit_manifest(root: Path, node: str, rank: int, edit, iteration: int = 1) -> None:
    """Rewrite ``node``'s manifest of ``rank`` through ``edit(json_dict)``: still valid JSON."""
    path = NodeStore(root, RUN, node).paths(CheckpointId(RUN, iteration, rank))[1]
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# -- 1. errors cross process boundaries ---------------------------------------------------------


@pytest.mark.parametrize("error", [
    CheckpointError("save of iteration 3 failed"),
    MissingShardsError("2 stored shards have no usable copy", ["w offsets=(0,) sizes=(4,) (stored by ranks [1])"]),
    CorruptFileError("/ckpt/run/n0/iter_00000001/rank_00000.safetensors", "sha256 mismatch"),
], ids=lambda e: type(e).__name__)
def test_every_checkpoint_error_round_trips_through_pickle(error):
    error.add_note("raised on worker 3")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)  # missing, path, reason, notes
    if isinstance(error, MissingShardsError):
        assert copy.missing == error.missing
    if isinstance(error, CorruptFileError):
        assert (copy.path, copy.reason) == (error.path, error.reason)


# -- 2. iteration directories -------------------------------------------------------------------

ITERATIONS = [7, 99_999_999, 100_000_000, 2**40]


def test_iterations_past_eight_digits_are_listed_and_removable(tmp_path):
    layout = Layout(TINY, Topology())
    for it in ITERATIONS:
        save(tmp_path, layout, ["n0"], iteration=it)
    store = NodeStore(tmp_path, RUN, "n0")
    # Names iteration_dir never writes are not iterations (and must not crash the listing).
    for stray in ("iter_000000007", "iter_0100000000", "iter_1234567", f"iter_{2**63}", "iter_\u0661" + "0" * 7):
        (store.dir / stray).mkdir()
    assert store.iterations() == ITERATIONS
    assert [m.id.iteration for m in store.list().manifests] == ITERATIONS
    assert store.remove_iterations(keep=2**40) == ITERATIONS[:-1]
    assert store.iterations() == [2**40]
    assert store.remove_iterations(only=2**40) == [2**40] and store.iterations() == []
    assert len(list(store.dir.iterdir())) == 5  # the strays are not ours to delete


def test_iterations_are_bounded_by_max_iteration(tmp_path):
    from realloc.ckpt.manifest import MAX_ITERATION

    assert MAX_ITERATION == 2**63 - 1
    store = NodeStore(tmp_path, RUN, "n0")
    save(tmp_path, Layout(TINY, Topology()), ["n0"], iteration=MAX_ITERATION)
    assert store.iterations() == [MAX_ITERATION] and store.list().manifests[0].id.iteration == MAX_ITERATION
    for bad in (2**63, -1):
        with pytest.raises(ValueError, match=r"iteration must be an integer from 0 to MAX_ITERATION = 2\*\*63 - 1"):
            CheckpointId(RUN, bad, 0)
        with pytest.raises(ValueError, match="MAX_ITERATION"):
            store.iteration_dir(bad)


def test_rank_files_past_five_digits_are_listed(tmp_path):
    store = NodeStore(tmp_path, RUN, "n0")
    layout = Layout(TINY, Topology(dp=100_001))  # one shard coordinate: cheap
    for rank in (0, 100_000):
        data, manifest = build_rank_file(CheckpointId(RUN, 1, rank), layout, allocate_buffers(layout, rank), "n0")
        write_rank_file(store.iteration_dir(1), data, manifest)
    assert store.paths(manifest.id)[1].name == "rank_100000.json"
    (store.iteration_dir(1) / "rank_000000.json").write_text(manifest.dumps())  # not a name a save writes
    assert [m.id.rank for m in store.list().manifests] == [0, 100_000]
