"""Trust: no silent wrong weights, no torn state, every failure clean. Real Ray actors, real gloo
process groups, simulated nodes; faults are real (processes killed, stopped, nodes removed).

One test per defect of the trust issue (each fails on the code before its fix), plus the fault
matrix of docs/architecture.md (a kill between transfer and commit, a kill during commit,
concurrent calls, a stopped worker, a node removed mid-save, corrupt and edited manifests, huge
iteration numbers).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from simulated import KeptGroups, simulated_cluster

from actors import ModelGroup, ReallocationError
from actors.errors import StaleOperationError
from actors.lanes import MOVE
from realloc import ModelSpec, Topology
from realloc.ckpt.errors import CheckpointError, CorruptFileError, MissingShardsError
from realloc.shards.synthetic import synthetic_state_dict

pytestmark = pytest.mark.slow

TINY = ModelSpec.preset("tiny")  # 4 layers, 12 heads, 2 kv heads, tied embedding, vocab 1001


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=4, cpus_per_node=2) as c:
        yield c


def make(name: str, topology: str, seed: int | None = 1, **kwargs) -> ModelGroup:
    kwargs.setdefault("timeout_s", 30)
    g = ModelGroup.create(TINY, Topology.parse(topology), name=name, **kwargs)
    if seed is not None:
        g.init_synthetic(seed)
    return g


#: Groups of 2 ("pair-a", "pair-b", "pair-c") and 4 workers ("quad") the tests that kill, stop
#: and patch nothing share (tests/simulated.py); a test making its own group frees their slots first.
KEPT = KeptGroups(make)


@pytest.fixture(scope="module")
def kept_groups(cluster):
    yield KEPT
    KEPT.close()


def own(name: str, topology: str, seed: int | None = 1, **kwargs) -> ModelGroup:
    """A group of the test's own (the cluster's 8 slots are shared with the kept groups)."""
    KEPT.close()
    return make(name, topology, seed, **kwargs)


def boxes_of(group: ModelGroup, ranks) -> dict:
    """Every box of ``ranks`` (each rank asked directly: works with dead peers)."""
    out = {}
    for r in ranks:
        out[r] = ray.get(group.actors[r].get_boxes.remote(), timeout=60)
    return out


def assert_exact(group: ModelGroup, seed: int, ranks=None) -> None:
    reference = synthetic_state_dict(TINY, seed)
    ranks = range(group.num_workers) if ranks is None else ranks
    for r, boxes in boxes_of(group, ranks).items():
        for param, offsets, sizes, tensor in boxes:
            expected = reference[param][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            assert torch.equal(tensor, expected), f"rank {r} {param} {offsets}"


def worker_layouts(group: ModelGroup) -> list[str]:
    return [p["layout"] for p in ray.get([a.ping.remote() for a in group.actors], timeout=30)]


def expected_layouts(group: ModelGroup) -> list[str]:
    return [str(group.layout.at(r)) for r in range(group.num_workers)]


# -- defect 1: the layout travels as one value (vocabulary padding included) ------------------


def test_vocab_padding_survives_reallocation_and_copy(cluster):
    padded = own("pad64", "dp=2,pp=2", vocab_pad_multiple=64)
    plain = own("pad1", "tp=2", seed=None)
    try:
        padded.reallocate(Topology(dp=4))  # zero-copy peers used to rebuild the layout without its pad
        assert padded.verify_synthetic(1) == {}
        padded.reallocate(Topology(dp=2, tp=2))
        padded.reallocate(Topology(tp=4))  # used to raise KeyError
        assert padded.verify_synthetic(1) == {}
        assert padded.layout.vocab_pad_multiple == 64
        padded.copy_to(plain)  # pad-64 group into a pad-1 group ...
        assert plain.verify_synthetic(1) == {}
        plain.init_synthetic(2)
        plain.copy_to(padded)  # ... and back: the destination keeps its own pad (used to KeyError)
        assert padded.verify_synthetic(2) == {} and padded.layout.vocab_pad_multiple == 64
    finally:
        padded.shutdown()
        plain.shutdown()


def test_reallocate_accepts_strings_and_equivalent_explicit_splits(kept_groups):
    g = kept_groups.take("quad", "dp=2,pp=2")
    g.reallocate("dp=4", src="dp=2,tp=1,pp=2")  # used to refuse: "is in layout X, not X"
    g.reallocate(Topology(dp=2, pp=2), src=Topology(dp=4))
    g.reallocate("dp=4", src=Topology(dp=2, pp=2, layer_split=(2, 2)))  # the effective split
    with pytest.raises(ValueError, match=r"holds layout dp=4,tp=1,pp=1, but src says dp=2,tp=1,pp=2"):
        g.reallocate("dp=2,pp=2", src="dp=2,pp=2")
    assert g.verify_synthetic(1) == {}


# -- defect 2 and the fault matrix: a worker dies between transfer and commit, or during it -----


@pytest.mark.parametrize("fault", ["exit_in_commit", "exit_after_commit"])
def test_a_worker_dying_at_commit_leaves_every_survivor_in_the_old_layout(cluster, tmp_path, fault):
    g = own(
        f"commit-{fault.replace('_', '-')}", "dp=2,tp=2", timeout_s=8
    )  # survivors of the death wait in gloo until it (ShardWorker's timeout): short
    try:
        manager = g.checkpoint_manager(root=str(tmp_path), run_id="commit", factor=2)
        manager.save(1)
        before = g.layout
        victim = 1
        ray.get(g.actors[victim].inject_fault.remote(fault, 0))
        with pytest.raises(ReallocationError) as err:
            g.reallocate(Topology(dp=4))
        message = str(err.value)
        assert g.actor_names[victim] in message and err.value.dead == [g.actor_names[victim]]
        assert "stays in layout dp=2,tp=2,pp=1" in message and "replace_dead_workers()" in message
        assert g.layout == before  # the driver knows the truth ...
        survivors = [r for r in range(4) if r != victim]
        assert [worker_layouts_of(g, r) for r in survivors] == [str(before.at(r)) for r in survivors]  # ... and it is
        assert_exact(g, 1, survivors)  # old weights, untouched
        # The documented recovery works: replace, restore from the checkpoint, move on.
        assert g.replace_dead_workers() == [victim]
        manager.load()
        assert g.verify_synthetic(1) == {}
        g.reallocate(Topology(dp=4))
        assert g.verify_synthetic(1) == {} and worker_layouts(g) == expected_layouts(g)
    finally:
        g.shutdown()


def test_a_replacement_that_failed_midway_is_set_up_by_the_next_call(cluster, monkeypatch):
    """``replace_dead_workers`` failing after it started the replacements (here: a replacement not
    up within ``start_timeout_s``; Ray counts a pending actor as alive) moves the version on (the
    weights changed) and leaves the group to the next call, which sets the replacement up. The
    next call used to see nobody dead and return ``[]``: the replacement held no shards while the
    group's layout said it did, and the version had not moved (found in review, 2026-11-28)."""
    import actors.driver.group as driver_group

    g = own("replace-midway", "dp=2", timeout_s=20)
    try:
        victim, before = 1, g.version
        ray.kill(g.actors[victim])
        while victim not in g.dead_workers():
            time.sleep(0.1)
        real = driver_group.call_all

        def slow_start(workers, method, *args, **kwargs):
            if method == "info":
                raise ReallocationError("start replacement workers: not up within start_timeout_s (the test's)")
            return real(workers, method, *args, **kwargs)

        monkeypatch.setattr(driver_group, "call_all", slow_start)
        with pytest.raises(ReallocationError, match="not up within"):
            g.replace_dead_workers()
        assert g.version > before  # the replaced rank's weights are not the ones of `before`
        monkeypatch.undo()
        assert g.dead_workers() == [] and g.replace_dead_workers() == [victim]
        assert worker_layouts(g) == expected_layouts(g)
        g.init_synthetic(4)
        g.reallocate(Topology(tp=2))
        assert g.verify_synthetic(4) == {}
    finally:
        g.shutdown()


def worker_layouts_of(group: ModelGroup, rank: int) -> str:
    return ray.get(group.actors[rank].ping.remote(), timeout=30)["layout"]


def test_a_kill_mid_transfer_rolls_back_and_names_the_dead_worker(cluster):
    g = own(
        "killed", "tp=4", bucket_bytes=4096, zero_copy=False, timeout_s=8
    )  # survivors of the death wait in gloo until it (ShardWorker's timeout): short
    try:
        g.reallocate(Topology(dp=2, tp=2))
        ray.get(g.actors[2].inject_fault.remote("exit_after_buckets", 3))
        with pytest.raises(ReallocationError, match=r"killed:rank2") as err:
            g.reallocate(Topology(dp=4))
        assert err.value.dead == [g.actor_names[2]] and "Rolled back" in str(err.value)
        assert_exact(g, 1, [0, 1, 3])
        assert g.layout.topology == Topology(dp=2, tp=2)
    finally:
        g.shutdown()


# -- defect 3: one operation at a time per group -----------------------------------------------


def test_concurrent_calls_never_interleave(kept_groups):
    g = kept_groups.take("quad", "dp=2,tp=2")
    targets = ["dp=4", "tp=4", "dp=2,tp=2", "dp=4"]
    results, errors = [], []

    def move(dst: str) -> None:
        try:
            results.append((dst, g.reallocate(dst)))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=move, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(results) == len(targets)  # every call did its move, one after the other
    assert g.verify_synthetic(1) == {}
    assert worker_layouts(g) == expected_layouts(g)
    assert str(g.layout.topology) == Topology.parse(results[-1][0]).__str__()


# -- defect 12: a stopped worker is named ------------------------------------------------------


def test_a_stopped_worker_is_named_and_the_group_recovers(cluster):
    g = own("stopped", "dp=2,tp=2", timeout_s=8)
    pid = ray.get(g.actors[3].info.remote())["pid"]
    try:
        g.reallocate(Topology(dp=4))
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ReallocationError) as err:
            g.reallocate(Topology(dp=2, tp=2))
        assert time.monotonic() - started < 60
        assert err.value.unresponsive == [g.actor_names[3]] and err.value.dead == []
        assert "stopped:rank3" in str(err.value) and "did not answer" in str(err.value)
        assert g.layout.topology == Topology(dp=4)
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        # Once it runs again it drops the aborted operation; the group is whole and usable.
        deadline = time.monotonic() + 60
        while worker_layouts(g) != expected_layouts(g):
            assert time.monotonic() < deadline
            time.sleep(1)
        assert g.verify_synthetic(1) == {}
        g.reallocate(Topology(dp=2, tp=2))
        assert g.verify_synthetic(1) == {}
    finally:
        g.shutdown()


# -- defects 8, 13, 15 and pickling across Ray --------------------------------------------------


def test_blend_with_a_bool_is_refused_and_the_destination_untouched(kept_groups):
    a, b = kept_groups.take("pair-a", "tp=2"), kept_groups.take("pair-b", "dp=2", seed=5)
    with pytest.raises(ValueError, match=r"eta must be a number within \[0, 1\], got True"):
        a.copy_to(b, eta=True)  # used to zero b, then fail
    assert b.verify_synthetic(5) == {}
    a.copy_to(b, eta=1.0)
    assert b.verify_synthetic(1) == {}


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda runs: setattr(runs, "names", [("model.nope.weight",) * len(n) for n in runs.names]), "param"),
        (lambda runs: setattr(runs, "dtypes", ["float64" for _ in runs.dtypes]), "dtype"),
        (lambda runs: runs.sizes.__iadd__(1000), "box"),
    ],
    ids=["unknown parameter", "dtype", "box larger than its tensor"],
)
def test_a_malformed_slice_is_refused_by_its_worker_before_any_traffic(cluster, monkeypatch, change, words):
    """Issue 36: a plan slice naming an unknown parameter, another dtype than the layout's or a
    box larger than its tensor reached a real worker, which failed mid-transfer with the shard
    store's bare ``KeyError`` (or, for the dtype, moved bytes as another dtype). Each worker now
    refuses its slice as it receives it (``actors.executor.received_share``), with a
    ``ValueError`` naming the field, and every worker still holds its old shards, exactly."""
    import actors.driver.protocol as protocol

    cut = protocol.worker_shares

    def malformed(plan, peers):
        shares = cut(plan, peers)
        parts = {id(part): part for piece, _ in shares for part in piece.parts}
        for part in parts.values():
            change(part.runs)
        return shares

    g = own("bad-slice", "tp=2", seed=4)  # its own: a kept group has this move's slices cut already
    try:
        before, layout = boxes_of(g, range(2)), g.layout
        with monkeypatch.context() as patch:
            patch.setattr(protocol, "worker_shares", malformed)
            with pytest.raises(ReallocationError, match=rf"ValueError: plan slice segment list \d+: segment {words}"):
                g.reallocate("dp=2")
        assert g.layout == layout and worker_layouts(g) == expected_layouts(g)
        after = boxes_of(g, range(2))
        for r in range(2):
            assert [(p, o, s) for p, o, s, _ in after[r]] == [(p, o, s) for p, o, s, _ in before[r]]
            assert all(torch.equal(a[3], b[3]) for a, b in zip(after[r], before[r]))
        g.reallocate("dp=2")  # the same move, cut right: it runs
        assert g.verify_synthetic(4) == {}
    finally:
        g.shutdown()


def test_a_name_is_free_when_shutdown_returns(cluster, monkeypatch):
    """``ray.kill`` returns before the cluster marks the actor dead (late under load: CI's group of
    the same name was refused as "already running" right after a shutdown): here every kill lands
    a second late, and the name is still free when ``shutdown`` returns."""
    g = own("renamed", "dp=2", seed=None)
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: threading.Timer(1.0, kill, (actor,), kw).start())
    g.shutdown()
    monkeypatch.undo()
    again = make("renamed", "dp=2", seed=None)
    again.shutdown()


def test_run_returns_views_as_their_own_bytes(kept_groups):
    g = kept_groups.take("pair-a", "tp=2")
    returned = g.run(lambda ctx: list(ctx.tensors.values()))  # views of the worker's flat buffers
    for tensors in returned:
        for t in tensors:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # not the whole buffer


def test_a_world_is_left_when_its_actors_join_another(kept_groups):
    a, b, c = (
        kept_groups.take("pair-a", "tp=2"),
        kept_groups.take("pair-b", "tp=2", seed=None),
        kept_groups.take("pair-c", "dp=2", seed=None),
    )
    a.copy_to(b)
    ab = b.worlds[MOVE]
    a.copy_to(c)
    assert not ab.alive  # a's actors left the a+b world: b must not reuse it
    with pytest.raises(StaleOperationError, match=r"is in world .*, not " + ab.id):  # a worker refuses it too
        ray.get(a.actors[0].op_execute.remote("x", ab.id, None, 0, 0, {}))
    b.init_synthetic(3)
    b.copy_to(a)
    b.reallocate(Topology(dp=2))
    assert a.verify_synthetic(3) == {} and b.verify_synthetic(3) == {}
    assert c.verify_synthetic(1) == {}


def test_checkpoint_errors_raised_on_workers_reach_the_driver(kept_groups):
    def _raise_corrupt(ctx):  # nested: pickled by value, the workers cannot import this module
        raise CorruptFileError("some/path", "sha256 mismatch")

    def _raise_missing(ctx):
        raise MissingShardsError("lost", ["w offsets=(0,) sizes=(4,)"])

    g = kept_groups.take("pair-a", "tp=2")
    for fn, name in ((_raise_corrupt, "CorruptFileError"), (_raise_missing, "MissingShardsError")):
        with pytest.raises(ReallocationError) as err:
            g.run(fn)
        assert name in str(err.value) and "Unserializable" not in str(err.value)
    assert pickle.loads(pickle.dumps(err.value)).dead == []
    assert g.verify_synthetic(1) == {}


# -- checkpoints: huge iterations, edited and corrupt manifests, a node lost mid-save ------------


def _manifest(manager, node: str, iteration: int, rank: int) -> Path:
    return manager.node_dir(node) / f"iter_{iteration:08d}" / f"rank_{rank:05d}.json"


def test_huge_iteration_numbers_are_saved_found_and_loaded(kept_groups, tmp_path):
    g = kept_groups.take("quad", "dp=2,tp=2")
    manager = g.checkpoint_manager(root=str(tmp_path), run_id="huge", factor=2)
    manager.save(99_999_999)
    manager.save(100_000_000)  # used to report success, delete 99_999_999 and be invisible
    assert manager.find_latest() == 100_000_000
    g.init_synthetic(7)
    manager.load()
    assert g.verify_synthetic(1) == {}
    with pytest.raises(ValueError, match=r"iteration must be a non-negative integer"):
        manager.save(2**63)


@pytest.mark.parametrize("node_index", [0, 1])
def test_an_edited_checksum_on_one_node_does_not_discard_the_intact_copy(kept_groups, tmp_path, node_index):
    g = kept_groups.take("quad", "tp=2,pp=2")  # dp=1: each rank file exists once per node
    manager = g.checkpoint_manager(root=str(tmp_path), run_id="sha", factor=2)
    manager.save(1)
    nodes = sorted(set(g.placement.nodes))
    path = _manifest(manager, nodes[node_index], 1, 0)
    data = json.loads(path.read_text())
    sha = data["file"]["sha256"]
    data["file"]["sha256"] = ("0" if sha[0] != "0" else "1") + sha[1:]
    path.write_text(json.dumps(data))
    g.init_synthetic(9)
    stats = manager.load()  # used to raise MissingShardsError
    assert g.verify_synthetic(1) == {}
    assert all("rank 0" in c for c in stats.corrupt_copies)


def test_an_edited_shard_table_is_refused_and_the_other_copy_used(kept_groups, tmp_path):
    g = kept_groups.take("quad", "dp=2,tp=2")
    manager = g.checkpoint_manager(root=str(tmp_path), run_id="table", factor=2)
    manager.save(1)
    node = g.placement.nodes[0]
    path = _manifest(manager, node, 1, 0)
    data = json.loads(path.read_text())
    for record in data["shards"]:
        if record[0].endswith("q_proj.weight"):
            record[2][0] += 48  # shift the box by 4 heads: valid JSON, checksums untouched
            break
    path.write_text(json.dumps(data))
    assert any("rank_00000" in p or "rank 0" in p or "shard record" in p for p in manager.catalog([1]).problems)
    g.reallocate(Topology(tp=4))
    g.init_synthetic(9)
    manager.load()  # a resharding load: used to return wrong q_proj rows on four ranks
    assert g.verify_synthetic(1) == {}


def test_a_node_removed_mid_save_keeps_the_previous_iteration(cluster, tmp_path):
    c = cluster.cluster
    spare = c.add_node(num_cpus=2)  # room for the replacements
    c.wait_for_nodes()
    g = own("midsave", "dp=2,tp=2", timeout_s=20)
    try:
        manager = g.checkpoint_manager(root=str(tmp_path), run_id="midsave", factor=2)
        manager.save(1)
        g.init_synthetic(4)
        handle = manager.save(2, is_async=True)
        lost = g.placement.nodes[0]
        c.remove_node(next(n for n in c.list_all_nodes() if n.node_id == lost))
        with pytest.raises(CheckpointError, match=r"save of iteration 2 .* failed.*iteration 1 stays loadable"):
            handle.wait()
        deadline = time.monotonic() + 60
        while not g.dead_workers():
            assert time.monotonic() < deadline
            time.sleep(0.5)
        replaced = g.replace_dead_workers()
        assert replaced and all(g.placement.nodes[r] != lost for r in replaced)
        assert manager.find_latest() == 1
        manager.load()
        assert g.verify_synthetic(1) == {}
    finally:
        g.shutdown()
        del spare
