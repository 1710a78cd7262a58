"""Checkpoint layer without Ray: files, catalog, replication/retrieval plans, resharding, HF dirs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_helpers import reader_stores
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc import Layout, ModelSpec, Placement, Topology, plan_exchange
from realloc.ckpt.catalog import Catalog
from realloc.ckpt.errors import CorruptFileError, MissingShardsError
from realloc.ckpt.files import (
    atomic_write,
    buffers_from_bytes,
    build_rank_file,
    read_manifest,
    read_shard,
    read_verified,
    tensor_name,
    write_rank_file,
)
from realloc.ckpt.hf import INDEX_FILE, SINGLE_FILE, export_state, load_shards, match_spec, save_hf_dir, scan_hf_dir
from realloc.ckpt.local_store import NodeStore
from realloc.ckpt.manifest import CheckpointId, Manifest, ShardRecord, param_table
from realloc.ckpt.replication import cliques, file_table, files_read_by, replication_groups, retrieval_groups
from realloc.ckpt.reshard import assign_readers, box_of_local, reshard_groups, stored_units
from realloc.shards import ShardStore, allocate_buffers, execute_in_process
from realloc.shards.synthetic import synthetic_box, synthetic_state_dict
from realloc.spec import DTYPE_BYTES

TINY = ModelSpec.preset("tiny")
RUN = "run-a"


def synthetic_buffers(layout: Layout, rank: int, seed: int) -> dict[str, torch.Tensor]:
    buffers = allocate_buffers(layout, rank)
    store = ShardStore(layout.shards(rank), buffers)
    for s in layout.shards(rank):
        if s.numel:
            p = TINY.param(s.param)
            store.write(s.param, s.offsets, s.sizes, synthetic_box(s.param, p.shape, s.offsets, s.sizes, s.dtype, seed))
    return buffers


def save_everywhere(
    root: Path,
    layout: Layout,
    placement: Placement,
    iteration: int = 1,
    seed: int = 3,
    run_id: str = RUN,
    extra_nodes: dict[int, list[str]] | None = None,
) -> dict[int, Manifest]:
    """Write every rank's file into its node's directory (and into ``extra_nodes[rank]``)."""
    manifests = {}
    for rank in range(layout.topology.world_size):
        node = placement.nodes[rank]
        data, manifest = build_rank_file(
            CheckpointId(run_id, iteration, rank), layout, synthetic_buffers(layout, rank, seed), node
        )
        for holder in [node] + (extra_nodes or {}).get(rank, []):
            write_rank_file(NodeStore(root, run_id, holder).iteration_dir(iteration), data, manifest)
        manifests[rank] = manifest
    return manifests


def shards_of(manifests: dict[int, Manifest]) -> dict:
    return {r: m.shards for r, m in manifests.items()}


def file_offset(path: Path, tensor: str) -> int:
    """Byte offset of ``tensor``'s data in a safetensors file (from its JSON header)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return 8 + length + json.loads(raw[8 : 8 + length])[tensor]["data_offsets"][0]


def catalog_of(root: Path, nodes, run_id: str = RUN, spec: ModelSpec = TINY) -> Catalog:
    return Catalog((NodeStore(root, run_id, n).list() for n in sorted(set(nodes))), spec)


# -- files ------------------------------------------------------------------------------------


def test_atomic_write_leaves_old_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    atomic_write(target, b"old")

    def crash(*_):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk went away"):
        atomic_write(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left behind


def test_rank_file_round_trip_and_manifest_json(tmp_path):
    layout = Layout(TINY, Topology(tp=2, pp=2))
    manifests = save_everywhere(tmp_path, layout, Placement.blocks(4, 4))
    m = manifests[3]
    assert Manifest.loads(m.dumps()) == m
    path = NodeStore(tmp_path, RUN, "node-0").paths(m.id)[0]
    data = read_verified(path, m)
    loaded = buffers_from_bytes(data, m)
    for dtype, t in synthetic_buffers(layout, 3, seed=3).items():
        assert torch.equal(loaded[dtype], t)


def test_fsdp_manifest_records_fsdp_and_checks_the_layout(tmp_path):
    layout = Layout(TINY, Topology(dp=2, fsdp=2, tp=2))
    manifests = save_everywhere(tmp_path, layout, Placement.blocks(8, 4))
    m = manifests[5]
    assert m.topology.fsdp == 2 and m.to_json()["topology"]["fsdp"] == 2
    assert Manifest.loads(m.dumps()) == m
    assert m.check_layout(TINY) == layout
    for fsdp_layout in (Layout(TINY, Topology(dp=4, tp=2)), Layout(TINY, Topology(fsdp=4, tp=2))):
        with pytest.raises(ValueError, match="is not the saved"):
            m.check_records(fsdp_layout)
    loaded = buffers_from_bytes(read_verified(NodeStore(tmp_path, RUN, "node-1").paths(m.id)[0], m), m)
    for dtype, t in synthetic_buffers(layout, 5, seed=3).items():
        assert torch.equal(loaded[dtype], t)
    # without fsdp the manifest JSON is as before: no fsdp key
    plain = save_everywhere(tmp_path / "plain", Layout(TINY, Topology(tp=2)), Placement.blocks(2, 2))[0]
    assert "fsdp" not in plain.to_json()["topology"] and plain.topology.fsdp == 1


def test_crash_between_tensors_and_manifest_leaves_file_invisible(tmp_path):
    layout = Layout(TINY, Topology(tp=2))
    data, m = build_rank_file(CheckpointId(RUN, 5, 0), layout, synthetic_buffers(layout, 0, 1), "n0")
    store = NodeStore(tmp_path, RUN, "n0")

    def crash():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        write_rank_file(store.iteration_dir(5), data, m, before_manifest=crash)
    assert store.paths(m.id)[0].exists() and not store.paths(m.id)[1].exists()
    assert store.list().manifests == []


def test_flipped_byte_fails_sha256_and_only_that_shards_crc(tmp_path):
    layout = Layout(TINY, Topology(tp=2))
    manifests = save_everywhere(tmp_path, layout, Placement.blocks(2, 2))
    m = manifests[0]
    path = NodeStore(tmp_path, RUN, "node-0").paths(m.id)[0]
    victim = max(m.shards, key=lambda r: r.local_nbytes)
    at = file_offset(path, tensor_name(victim.dtype)) + victim.buffer_offset * DTYPE_BYTES[victim.dtype] + 5
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="sha256 mismatch"):
        read_verified(path, m)
    with pytest.raises(CorruptFileError, match="crc32 mismatch"):
        read_shard(path, m, victim)
    other = next(r for r in m.shards if r.numel and (r.dtype, r.buffer_offset) != (victim.dtype, victim.buffer_offset))
    local = read_shard(path, m, other)
    p = TINY.param(other.param)
    assert torch.equal(
        box_of_local(local, other), synthetic_box(other.param, p.shape, other.offsets, other.sizes, other.dtype, 3)
    )


def test_truncated_or_missing_file_is_listed_as_unusable(tmp_path):
    layout = Layout(TINY, Topology(tp=2))
    manifests = save_everywhere(tmp_path, layout, Placement.blocks(2, 2))
    store = NodeStore(tmp_path, RUN, "node-0")
    tensors0 = store.paths(manifests[0].id)[0]
    tensors0.write_bytes(tensors0.read_bytes()[:-10])
    store.paths(manifests[1].id)[0].unlink()
    listing = store.list()
    assert listing.manifests == [] and len(listing.problems) == 2
    assert "size" in listing.problems[0] and "size None" in listing.problems[1]


def test_checkpoint_of_another_run_is_never_loaded(tmp_path):
    layout = Layout(TINY, Topology(tp=2))
    save_everywhere(tmp_path, layout, Placement.blocks(2, 2), run_id="run-a")
    other = NodeStore(tmp_path, "run-b", "node-0")
    # Someone copies run-a's directory under run-b: the manifests name run-a, so nothing is usable.
    shutil.copytree(NodeStore(tmp_path, "run-a", "node-0").dir, other.dir)
    listing = other.list()
    assert listing.manifests == [] and all("expected run-b" in p for p in listing.problems)
    # Even with a manifest rewritten to claim run-b, the tensors file still names run-a.
    original = read_manifest(NodeStore(tmp_path, "run-a", "node-0").paths(CheckpointId("run-a", 1, 0))[1])
    forged = dataclasses.replace(original, id=CheckpointId("run-b", 1, 0))
    other.paths(forged.id)[1].write_text(forged.dumps())
    assert [x.id for x in other.list().manifests] == [forged.id]
    with pytest.raises(CorruptFileError, match="belongs to"):
        read_verified(other.paths(forged.id)[0], forged)
    with pytest.raises(CorruptFileError, match="belongs to"):
        read_shard(other.paths(forged.id)[0], forged, forged.shards[0])


def test_remove_iterations_keeps_the_saved_one_and_removes_a_failed_one(tmp_path):
    layout = Layout(TINY, Topology(tp=2))
    for it in (1, 2, 3, 9):  # 9: left over from before a rollback
        save_everywhere(tmp_path, layout, Placement.blocks(2, 2), iteration=it)
    store = NodeStore(tmp_path, RUN, "node-0")
    (store.iteration_dir(3) / ".tmp-dead-rank_00000.safetensors").write_bytes(b"x")
    assert store.remove_iterations(keep=3) == [1, 2, 9]
    assert store.iterations() == [3] and not list(store.iteration_dir(3).glob(".tmp-*"))
    assert store.remove_iterations(only=3) == [3] and store.iterations() == []
    with pytest.raises(ValueError, match="exactly one"):
        store.remove_iterations()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(run_id="../x"), "run id"),
        (dict(run_id=""), "run id"),
        (dict(iteration=-1), "iteration"),
        (dict(iteration=True), "iteration"),
        (dict(iteration=2**63), "iteration"),
        (dict(rank=-2), "rank"),
    ],
)
def test_checkpoint_id_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        CheckpointId(**{**dict(run_id="r", iteration=1, rank=0), **bad})


# -- catalog ----------------------------------------------------------------------------------


def test_latest_complete_skips_partial_iteration_and_uses_dp_twins(tmp_path):
    layout = Layout(TINY, Topology(dp=2, tp=2))
    placement = Placement.blocks(4, 2)
    save_everywhere(tmp_path, layout, placement, iteration=1)
    save_everywhere(tmp_path, layout, placement, iteration=2)
    store = NodeStore(tmp_path, RUN, "node-0")
    # rank 1 (dp 0, tp 1) of iteration 2 is lost; its dp twin rank 3 (on node-1) stores the same boxes.
    for p in store.paths(CheckpointId(RUN, 2, 1)):
        p.unlink()
    catalog = catalog_of(tmp_path, placement.nodes)
    assert catalog.missing(2, TINY) == [] and catalog.latest_complete(TINY) == 2
    for p in NodeStore(tmp_path, RUN, "node-1").paths(CheckpointId(RUN, 2, 3)):
        p.unlink()
    catalog = catalog_of(tmp_path, placement.nodes)
    missing = catalog.missing(2, TINY)
    assert missing and all("stored by ranks [1, 3]" in m for m in missing)
    assert any(m.startswith("model.layers.0.self_attn.q_proj.weight offsets=(48, 0)") for m in missing)
    assert catalog.latest_complete(TINY) == 1


def test_catalog_rejects_a_model_with_other_parameters(tmp_path):
    layout = Layout(TINY, Topology(tp=2))
    save_everywhere(tmp_path, layout, Placement.blocks(2, 2))
    catalog = catalog_of(tmp_path, ["node-0"], spec=ModelSpec.preset("llama-7b"))
    assert catalog.latest_complete() is None and len(catalog.problems) == 2
    assert all("parameters differ" in p for p in catalog.problems)
    with pytest.raises(ValueError, match="parameters differ"):
        catalog_of(tmp_path, ["node-0"]).latest_complete(ModelSpec.preset("llama-7b"))


# -- replication and retrieval ----------------------------------------------------------------


@pytest.mark.parametrize("world, jump, factor", [(8, 3, 2), (8, 4, 3), (6, 4, 1)])
def test_cliques_reject_sizes_that_do_not_divide(world, jump, factor):
    with pytest.raises(ValueError, match=f"world size {world} is not divisible by jump\\*factor"):
        cliques(world, jump, factor)


@pytest.mark.parametrize("jump, factor", [(0, 2), (2, 0), (-1, 2), (2.0, 2), (True, 2)])
def test_cliques_reject_non_positive_integers(jump, factor):
    with pytest.raises(ValueError, match="must be a positive integer"):
        cliques(8, jump, factor)


def test_cliques_cover_every_rank_once():
    groups = cliques(24, jump=4, factor=3)
    assert sorted(r for g in groups for r in g) == list(range(24))
    assert groups[0] == (0, 4, 8) and groups[4] == (12, 16, 20)


def test_replication_crosses_each_node_once_and_balances_egress():
    placement = Placement.blocks(12, 4)
    sizes = {r: 1000 + r for r in range(12)}
    holdings, needs = replication_groups(sizes, placement, jump=4, factor=3)
    plan = plan_exchange(holdings, needs, placement, file_table(sizes))
    assert plan.stats["bytes_inter_node"] == 2 * sum(sizes.values())  # two other nodes per file
    assert plan.stats["bytes_intra_node"] == 0 and plan.local_copies == []
    egress = plan.stats["node_egress_bytes"]
    assert max(egress.values()) - min(egress.values()) <= 2 * (max(sizes.values()) - min(sizes.values())) * 4


def test_replication_skips_clique_members_on_the_writers_node():
    placement = Placement.blocks(8, 4)
    holdings, needs = replication_groups({r: 10 for r in range(8)}, placement, jump=2, factor=2)
    assert needs == []  # cliques (0, 2), (1, 3), ... live on one node: nothing to send


def test_retrieval_reads_local_copies_first():
    placement = Placement.blocks(8, 4)
    sizes = {r: 4096 for r in range(8)}
    copies = {r: {placement.nodes[r], placement.nodes[(r + 4) % 8]} for r in range(8)}
    holdings, needs = retrieval_groups(copies, sizes, placement, range(8))
    plan = plan_exchange(holdings, needs, placement, file_table(sizes))
    assert plan.stats["bytes_inter_node"] == 0 and plan.stats["bytes_intra_node"] == 0
    assert plan.stats["bytes_local_copy"] == sum(sizes.values())
    assert files_read_by(plan) == {r: {r} for r in range(8)}


def test_retrieval_after_node_loss_balances_senders():
    # node-0 was lost; its ranks 0..3 now run on node-2 with empty storage; node-1 holds replicas.
    placement = Placement(("node-2",) * 4 + ("node-1",) * 4)
    sizes = {r: 4096 for r in range(8)}
    copies = {r: {"node-1"} for r in range(8)}
    holdings, needs = retrieval_groups(copies, sizes, placement, range(8))
    plan = plan_exchange(holdings, needs, placement, file_table(sizes))
    assert plan.stats["bytes_inter_node"] == 4 * 4096
    assert plan.stats["bytes_local_copy"] == 4 * 4096
    senders = {int(w): b for w, b in plan.stats["rank_send_bytes"].items()}
    assert sorted(senders) == [4, 5, 6, 7] and set(senders.values()) == {4096}  # one file per node-1 worker


def test_retrieval_pulls_parts_from_every_replica_node():
    placement = Placement(("new",) * 2 + ("b",) * 2 + ("c",) * 2)
    sizes = {r: 6000 for r in range(6)}
    copies = {0: {"b", "c"}, 1: {"b", "c"}, 2: {"b"}, 3: {"b"}, 4: {"c"}, 5: {"c"}}
    holdings, needs = retrieval_groups(copies, sizes, placement, range(6))
    plan = plan_exchange(holdings, needs, placement, file_table(sizes))
    egress = plan.stats["node_egress_bytes"]
    assert egress == {"b": 6000, "c": 6000}  # each lost file split between the two holders


def test_retrieval_names_ranks_without_copies():
    with pytest.raises(ValueError, match=r"ranks \[1\] have no usable copy"):
        retrieval_groups({0: {"a"}}, {0: 1, 1: 1}, Placement(("a", "a")), [0, 1])


# -- resharding -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst",
    [
        (Topology(dp=2, tp=2, pp=2), Topology(dp=1, tp=4, pp=2)),
        (Topology(dp=2, tp=2, pp=2), Topology(dp=8)),
        (Topology(tp=4, pp=2), Topology(dp=2, tp=2, pp=2)),
        (Topology(fsdp=4, pp=2, fsdp_split="zero3"), Topology(dp=2, tp=2, pp=2)),
        (Topology(tp=4, pp=2), Topology(dp=2, fsdp=4, fsdp_split="zero3")),
    ],
)
def test_reshard_load_reads_each_stored_box_once_and_is_bit_exact(tmp_path, src, dst):
    placement = Placement.blocks(8, 4)
    a, b = Layout(TINY, src), Layout(TINY, dst)
    replicas = {r: [placement.nodes[(r + 4) % 8]] for r in range(8)}
    manifests = save_everywhere(tmp_path, a, placement, extra_nodes=replicas)
    catalog = catalog_of(tmp_path, placement.nodes)
    assignment = assign_readers(shards_of(catalog.manifests(1)), catalog.copies(1), placement)
    units = stored_units(shards_of(manifests))
    keys = [t.key for t in assignment.all()]
    assert sorted(keys) == sorted(units) and len(keys) == len(set(keys))  # every stored box read exactly once
    loads = assignment.loads()
    sizes = [recs[0][1].local_nbytes for recs in units.values()]
    assert max(loads.values()) <= sum(sizes) / 8 + max(sizes)  # list-scheduling bound
    holdings, needs = reshard_groups(assignment, b)
    plan = plan_exchange(holdings, needs, placement, param_table(TINY))
    src_stores = reader_stores(tmp_path, RUN, assignment, manifests)
    dst_stores = {r: ShardStore(b.shards(r), allocate_buffers(b, r)) for r in range(8)}
    execute_in_process(plan, src_stores, dst_stores)
    for r in range(8):
        for dtype, t in synthetic_buffers(b, r, seed=3).items():
            assert torch.equal(dst_stores[r].buffers[dtype], t), (r, dtype)


def test_reshard_assignment_avoids_excluded_copies_and_names_missing_shards(tmp_path):
    placement = Placement.blocks(4, 2)
    layout = Layout(TINY, Topology(tp=2, pp=2))
    manifests = save_everywhere(tmp_path, layout, placement, extra_nodes={0: ["node-1"]})
    copies = catalog_of(tmp_path, placement.nodes).copies(1)
    assignment = assign_readers(shards_of(manifests), copies, placement, exclude={("node-0", 0)})
    assert all(t.node == "node-1" for t in assignment.all() if t.rank == 0)
    with pytest.raises(MissingShardsError, match="stored by ranks \\[0\\]") as err:
        assign_readers(shards_of(manifests), copies, placement, exclude={("node-0", 0), ("node-1", 0)})
    assert any(m.startswith("model.layers.0.self_attn.q_proj.weight") for m in err.value.missing)
    # The tied head on the last stage (rank 2) stores the same embedding rows: those are not lost.
    assert not any(m.startswith("model.embed_tokens.weight") for m in err.value.missing)


@settings(max_examples=25, deadline=None)
@given(
    dp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2]),
    per_node=st.sampled_from([1, 2, 4]),
    spread=st.booleans(),
)
def test_reader_assignment_reads_once_within_the_greedy_bound(dp, tp, pp, per_node, spread):
    topo = Topology(dp=dp, tp=tp, pp=pp)
    world = topo.world_size
    layout = Layout(TINY, topo)
    placement = Placement.blocks(world, per_node)
    stored = {r: tuple(ShardRecord.of(s, 0) for s in layout.shards(r)) for r in range(world)}
    nodes = sorted(set(placement.nodes))
    copies = {r: set(nodes) if spread else {placement.nodes[r]} for r in range(world)}
    assignment = assign_readers(stored, copies, placement)
    units = stored_units(stored)
    keys = [t.key for t in assignment.all()]
    assert sorted(keys) == sorted(units)
    for t in assignment.all():
        assert t.node == placement.nodes[t.worker] and t.node in copies[t.rank]
    if spread:  # every worker can read every box: the list-scheduling bound holds
        sizes = [recs[0][1].local_nbytes for recs in units.values()]
        assert max(assignment.loads().values()) <= sum(sizes) / world + max(sizes)


# -- Hugging Face -----------------------------------------------------------------------------


def test_hf_round_trip_multi_file_into_any_layout(tmp_path):
    full = synthetic_state_dict(TINY, seed=9)
    files = save_hf_dir(export_state(full, TINY), tmp_path, max_shard_bytes=200_000)
    assert len(files) > 2 and (tmp_path / INDEX_FILE).exists() and not (tmp_path / SINGLE_FILE).exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied head is not written
    tensors = scan_hf_dir(tmp_path)
    mapping = match_spec(tensors, TINY)
    layout = Layout(TINY, Topology(dp=1, tp=4, pp=2))
    for r in range(layout.topology.world_size):
        buffers = allocate_buffers(layout, r)
        read = load_shards(tmp_path, tensors, mapping, layout.shards(r), ShardStore(layout.shards(r), buffers))
        assert read == sum(s.nbytes for s in layout.shards(r))  # only this rank's slices
        for dtype, t in synthetic_buffers(layout, r, seed=9).items():
            assert torch.equal(buffers[dtype], t)


def test_hf_single_file_and_tied_head_under_alias(tmp_path):
    full = synthetic_state_dict(TINY, seed=2)
    state = export_state(full, TINY)
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_hf_dir(state, tmp_path)
    assert (tmp_path / SINGLE_FILE).exists() and not (tmp_path / INDEX_FILE).exists()
    mapping = match_spec(scan_hf_dir(tmp_path), TINY)
    assert mapping["model.embed_tokens.weight"] == "lm_head.weight"


def test_hf_bad_directories_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        scan_hf_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        scan_hf_dir(tmp_path)
    state = export_state(synthetic_state_dict(TINY), TINY)
    state["model.norm.weight"] = torch.zeros(3)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_hf_dir(state, tmp_path)
    with pytest.raises(ValueError, match="2 problems.*model.layers.0.mlp.up_proj.weight is missing"):
        match_spec(scan_hf_dir(tmp_path), TINY)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "../escape.safetensors"}}))
    with pytest.raises(ValueError, match="names file"):
        scan_hf_dir(tmp_path)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_hf_dir(state, tmp_path, max_shard_bytes=0)
