"""What the checkpoint layer trusts, without Ray: picklable errors, iteration names, manifests
checked against their layout, and disagreeing copies judged by their bytes, not by vote."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from ckpt_helpers import reader_stores

from realloc import Layout, ModelSpec, Placement, Topology, plan_exchange
from realloc.ckpt.catalog import Catalog
from realloc.ckpt.errors import CheckpointError, CorruptFileError, MissingShardsError
from realloc.ckpt.files import buffers_from_bytes, build_rank_file, read_verified, write_rank_file
from realloc.ckpt.local_store import NodeStore
from realloc.ckpt.manifest import CheckpointId, Manifest, param_table
from realloc.ckpt.reshard import assign_readers, reshard_groups
from realloc.shards import ShardStore, allocate_buffers, execute_in_process
from realloc.shards.synthetic import synthetic_box

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
        data, manifest = build_rank_file(
            CheckpointId(RUN, iteration, rank), layout, synthetic_buffers(layout, rank), nodes[0]
        )
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


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("save of iteration 3 failed"),
        MissingShardsError("2 stored shards have no usable copy", ["w offsets=(0,) sizes=(4,) (stored by ranks [1])"]),
        CorruptFileError("/ckpt/run/n0/iter_00000001/rank_00000.safetensors", "sha256 mismatch"),
    ],
    ids=lambda e: type(e).__name__,
)
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
    assert catalog_of(tmp_path, ["n0"]).iterations() == ITERATIONS
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
        with pytest.raises(ValueError, match=r"non-negative integer no larger than MAX_ITERATION = 2\*\*63 - 1"):
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


# -- 3. shard tables are checked against the layout ---------------------------------------------


@pytest.mark.parametrize(
    "topology",
    [
        Topology(),
        Topology(dp=2, tp=2, pp=2),
        Topology(tp=4),
        Topology(dp=4),
        Topology(tp=2, pp=4),
        Topology(pp=2, layer_split=(1, 3)),
    ],
    ids=str,
)
@pytest.mark.parametrize("vocab_pad_multiple", [1, 64])
def test_check_layout_accepts_every_manifest_a_save_writes(topology, vocab_pad_multiple):
    layout = Layout(TINY, topology, vocab_pad_multiple)
    for rank in range(topology.world_size):
        _, manifest = build_rank_file(CheckpointId(RUN, 1, rank), layout, allocate_buffers(layout, rank), "n0")
        assert manifest.check_layout(TINY).shards(rank) == layout.shards(rank)
        Manifest.loads(manifest.dumps()).check_layout(TINY)  # and as read back from JSON


def _record(data: dict, slot: str) -> list:
    return next(r for r in data["shards"] if r[1] == slot)


Q = "model.layers.0.self_attn.q_proj.weight"
E = "model.embed_tokens.weight"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: _record(d, Q).__setitem__(2, [48, 0]), r"field offsets: recorded \(48, 0\), layout says \(0, 0\)"),
        (lambda d: _record(d, Q).__setitem__(3, [47, 96]), "field sizes"),
        (lambda d: _record(d, Q).__setitem__(6, _record(d, Q)[6] + 96), "field buffer_offset"),
        (lambda d: _record(d, Q).__setitem__(4, [96, 48]), "field local_shape"),
        (lambda d: _record(d, Q).__setitem__(1, "lm_head.weight"), "field slot"),
        (lambda d: _record(d, Q).__setitem__(2, [0.0, 0]), r"field offsets: recorded \(0.0, 0\)"),
        (lambda d: d["shards"].pop(), "shard records, layout says"),
        (lambda d: d["buffers"].update(bfloat16=d["buffers"]["bfloat16"] + 1), "buffers: recorded"),
        (lambda d: d["topology"].update(pp=2, tp=1), "buffers|shard record"),  # same world size, another layout
        (lambda d: d["topology"].update(tp=5, dp=1, pp=1) or d.update(world_size=5), "cannot be laid out"),
    ],
)
def test_check_layout_names_the_edited_field(tmp_path, edit, match):
    save(tmp_path, TP2, ["a"])
    edit_manifest(tmp_path, "a", 0, edit)
    (manifest,) = [m for m in NodeStore(tmp_path, RUN, "a").list().manifests if m.id.rank == 0]
    with pytest.raises(CorruptFileError, match=match) as err:
        manifest.check_layout(TINY)
    assert err.value.path == str(manifest.id)


def test_check_layout_ignores_crc32_and_refuses_another_model(tmp_path):
    _, manifest = save(tmp_path, TP2, ["a"])[0]
    recs = (dataclasses.replace(manifest.shards[0], crc32=manifest.shards[0].crc32 ^ 1),) + manifest.shards[1:]
    dataclasses.replace(manifest, shards=recs).check_layout(TINY)  # only the bytes can confirm a crc32
    with pytest.raises(CorruptFileError, match="world size"):
        dataclasses.replace(manifest, world_size=4).check_layout(TINY)
    with pytest.raises(ValueError, match="parameters differ"):
        manifest.check_layout(ModelSpec.preset("small"))


def test_an_edited_shard_table_is_a_problem_not_a_copy(tmp_path):
    files = save(tmp_path, TP2, ["a", "b"])
    edit_manifest(tmp_path, "a", 0, lambda d: _record(d, Q).__setitem__(2, [48, 0]))
    catalog = catalog_of(tmp_path, ["a", "b"])
    assert len(catalog.problems) == 1 and catalog.problems[0].startswith(f"a: {RUN}/iter_1/rank_0: shard record")
    assert "field offsets" in catalog.problems[0]
    assert catalog.copies(1) == {0: {"b"}, 1: {"a", "b"}}
    assert catalog.manifests(1)[0] == files[0][1] and catalog.latest_complete() == 1
    # The resharding load now reads rank 0's boxes from b only, and gets the right rows.
    assert_reshard_is_exact(tmp_path, catalog, Layout(TINY, Topology(dp=2)), Placement(("a", "b")))
    edit_manifest(tmp_path, "b", 0, lambda d: _record(d, Q).__setitem__(2, [48, 0]))
    catalog = catalog_of(tmp_path, ["a", "b"])
    assert len(catalog.problems) == 2 and 0 not in catalog.copies(1)
    missing = catalog.missing(1)
    assert f"{Q} offsets=(0, 0) sizes=(48, 96) (stored by ranks [0])" in missing
    assert all(m.endswith("(stored by ranks [0])") for m in missing)
    assert catalog.latest_complete() is None


def test_a_shifted_box_no_longer_gives_a_resharding_load_wrong_rows(tmp_path):
    # Rank 1 stores embedding rows 501..1000 in a 501-row local tensor (vocab padding). A manifest
    # claiming rows 500..1000 still passes its crc32 (same bytes), and used to be read as such:
    # every row of the second half came out shifted by one, without an error.
    save(tmp_path, TP2, ["a", "b"])
    edit_manifest(
        tmp_path, "a", 1, lambda d: _record(d, E).__setitem__(2, [500, 0]) or _record(d, E).__setitem__(3, [501, 96])
    )
    catalog = catalog_of(tmp_path, ["a", "b"])
    assert catalog.copies(1) == {0: {"a", "b"}, 1: {"b"}}
    assert catalog.problems == [
        f"a: {RUN}/iter_1/rank_1: shard record 0 ({E}) field offsets: recorded (500, 0), layout says (501, 0)"
    ]
    assert_reshard_is_exact(tmp_path, catalog, Layout(TINY, Topology(dp=2)), Placement(("a", "b")))


def assert_reshard_is_exact(root: Path, catalog: Catalog, target: Layout, placement: Placement) -> None:
    manifests = catalog.manifests(1)
    assignment = assign_readers({r: m.shards for r, m in manifests.items()}, catalog.copies(1), placement)
    stores = reader_stores(root, RUN, assignment, manifests)
    holdings, needs = reshard_groups(assignment, target)
    plan = plan_exchange(holdings, needs, placement, param_table(TINY))
    world = target.topology.world_size
    dst = {r: ShardStore(target.shards(r), allocate_buffers(target, r)) for r in range(world)}
    execute_in_process(plan, stores, dst)
    for r in range(world):
        for dtype, t in synthetic_buffers(target, r).items():
            assert torch.equal(dst[r].buffers[dtype], t), (r, dtype)


def test_catalog_of_another_model_lists_every_file_as_a_problem(tmp_path):
    save(tmp_path, TP2, ["a"])
    catalog = catalog_of(tmp_path, ["a"], spec=ModelSpec.preset("small"))
    assert catalog.iterations() == [] and catalog.latest_complete() is None
    assert len(catalog.problems) == 2 and all("parameters differ" in p for p in catalog.problems)
    with pytest.raises(ValueError, match="built for model 'tiny'"):
        catalog_of(tmp_path, ["a"]).missing(1, ModelSpec.preset("small"))
    with pytest.raises(ValueError, match="needs the model's ModelSpec"):
        Catalog([], "tiny")
    with pytest.raises(ValueError, match="spec must be a ModelSpec or None"):
        catalog.latest_complete("tiny")


def test_a_stray_file_of_another_layout_is_not_a_copy(tmp_path):
    save(tmp_path, TP2, ["a", "b"])
    save(tmp_path, Layout(TINY, Topology()), ["c"])  # same run and iteration, world size 1
    catalog = catalog_of(tmp_path, ["a", "b", "c"])
    assert catalog.problems == [f"c: {RUN}/iter_1/rank_0 has another layout than the other files of iteration 1"]
    assert catalog.copies(1) == {0: {"a", "b"}, 1: {"a", "b"}} and catalog.latest_complete() == 1


# -- 4. disagreeing copies are judged by their bytes --------------------------------------------


def _sha_edit(order: str):
    """Edit one hex digit of the recorded sha256 so that it sorts before or after the true one."""

    def edit(data: dict) -> None:
        sha = data["file"]["sha256"]
        extreme = "0" if order == "edited sorts first" else "f"
        at = next(i for i, c in enumerate(sha) if c != extreme)
        data["file"]["sha256"] = sha[:at] + extreme + sha[at + 1 :]

    return edit


def read_usable(root: Path, catalog: Catalog, rank: int) -> tuple[str, torch.Tensor, set[tuple[str, int]]]:
    """What the driver does: read the usable candidate, exclude copies found corrupt, ask again."""
    excluded: set[tuple[str, int]] = set()
    while True:
        usable = catalog.usable(1, excluded)
        assert rank in usable, f"rank {rank}: no candidate left after excluding {excluded}"
        candidate = usable[rank]
        node = min(candidate.nodes)
        try:
            return (
                node,
                read_verified(NodeStore(root, RUN, node).paths(candidate.manifest.id)[0], candidate.manifest),
                excluded,
            )
        except CorruptFileError:
            excluded.add((node, rank))


@pytest.mark.parametrize("order", ["edited sorts first", "intact sorts first"])
@pytest.mark.parametrize("victim", ["a", "b"])
def test_one_edited_sha256_does_not_discard_the_intact_copy(tmp_path, victim, order):
    files = save(tmp_path, TP2, ["a", "b"])
    edit_manifest(tmp_path, victim, 0, _sha_edit(order))
    intact = "b" if victim == "a" else "a"
    catalog = catalog_of(tmp_path, ["a", "b"])
    assert catalog.problems == [] and catalog.missing(1) == [] and catalog.latest_complete() == 1
    candidates = catalog.candidates(1)
    assert [c.nodes for c in candidates[1]] == [frozenset("ab")]
    assert len(candidates[0]) == 2 and {c.nodes for c in candidates[0]} == {frozenset("a"), frozenset("b")}
    first = catalog.usable(1)[0]
    assert first.nodes == frozenset(victim if order == "edited sorts first" else intact)
    assert catalog.manifests(1)[0] == first.manifest and catalog.copies(1)[0] == set(first.nodes)
    node, data, excluded = read_usable(tmp_path, catalog, 0)
    assert node == intact and excluded == ({(victim, 0)} if order == "edited sorts first" else set())
    assert bytes(data.numpy()) == files[0][0]
    for dtype, t in buffers_from_bytes(data, files[0][1]).items():
        assert torch.equal(t, synthetic_buffers(TP2, 0)[dtype])
    # With both copies of rank 0 found corrupt, nothing is left to offer.
    gone = {("a", 0), ("b", 0)}
    assert sorted(catalog.usable(1, gone)) == [1]
    assert catalog.missing(1, excluded=gone) and all("[0]" in m for m in catalog.missing(1, excluded=gone))


def test_boxes_read_before_every_copy_of_their_file_failed_are_not_missing(tmp_path):
    """A resharding load reads a file's boxes one by one: boxes read (and crc-checked) in an
    earlier round stay with the load when later reads of the same file fail. ``missing`` counts
    them as held, so only the boxes nobody has are lost (the driver's check between rounds)."""
    files = save(tmp_path, TP2, ["a", "b"])
    catalog = catalog_of(tmp_path, ["a", "b"])
    gone = {("a", 0), ("b", 0)}
    lost = catalog.missing(1, TINY, excluded=gone)
    assert lost and all(m.endswith("(stored by ranks [0])") for m in lost)
    # rank 0's own boxes (the ones rank 1 does not store too)
    read = [
        r.key
        for r in files[0][1].shards
        if r.numel and any(m.startswith(f"{r.param} offsets={r.offsets} ") for m in lost)
    ]
    assert read and catalog.missing(1, TINY, excluded=gone, read=read[:1]) == [
        m for m in lost if not m.startswith(f"{read[0][0]} offsets={read[0][1]} ")
    ]
    assert catalog.missing(1, TINY, excluded=gone, read=read) == []
    everything = {("a", 0), ("b", 0), ("a", 1), ("b", 1)}
    assert catalog.missing(1, excluded=everything) == ["every rank file of iteration 1"]
    assert catalog.missing(1, excluded=everything, read=read) != []  # rank 1's boxes: no copy, not read


def test_a_majority_of_bad_manifests_falls_back_to_the_intact_minority(tmp_path):
    files = save(tmp_path, TP2, ["a", "b", "c"])
    for node in ("a", "b"):  # the same bad manifest on two nodes outvotes c's intact one
        edit_manifest(tmp_path, node, 0, _sha_edit("intact sorts first"))
    catalog = catalog_of(tmp_path, ["a", "b", "c"])
    assert [c.nodes for c in catalog.candidates(1)[0]] == [frozenset("ab"), frozenset("c")]
    assert catalog.usable(1, {("a", 0)})[0].nodes == frozenset("b")  # nodes shrink before falling back
    node, data, excluded = read_usable(tmp_path, catalog, 0)
    assert node == "c" and excluded == {("a", 0), ("b", 0)} and bytes(data.numpy()) == files[0][0]


def test_identical_copies_are_one_candidate(tmp_path):
    save(tmp_path, TP2, ["a", "b"])
    catalog = catalog_of(tmp_path, ["a", "b"])
    assert {r: [c.nodes for c in cs] for r, cs in catalog.candidates(1).items()} == {
        0: [frozenset("ab")],
        1: [frozenset("ab")],
    }
    assert catalog.usable(1, {("a", 1)})[1].nodes == frozenset("b")
    assert catalog.any_manifest(1).id.rank == 0 and catalog.any_manifest(2) is None
    assert catalog.candidates(2) == {} and catalog.usable(2) == {}


@pytest.mark.parametrize("field", ["buffers", "topology", "spec"])
def test_a_manifest_with_a_list_where_an_object_belongs_is_a_listed_problem(tmp_path, field):
    """A rank manifest that is valid JSON but holds a list where an object belongs is one damaged
    file: the node's listing names it among its problems and keeps the other ranks (their copies
    elsewhere still load). It raised ``AttributeError`` out of the listing, failing every load and
    ``find_latest`` of the run (found in review, 2026-11-28)."""
    save(tmp_path, TP2, ["a"])
    edit_manifest(tmp_path, "a", 1, lambda d: d.__setitem__(field, []))
    listing = NodeStore(tmp_path, RUN, "a").list()
    assert [m.id.rank for m in listing.manifests] == [0]
    assert len(listing.problems) == 1 and "malformed field" in listing.problems[0], listing.problems
