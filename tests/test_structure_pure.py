"""The structure behind the trust guarantees, checked without Ray: the layout value, plan
validation, picklable errors, result detaching, NCCL error handling."""

from __future__ import annotations

import pickle

import pytest
import torch

from actors.errors import GroupBusyError, ReallocationError, StaleOperationError
from actors.wire.transport import process_group_environment
from actors.worker import detach_result
from realloc import Layout, ModelSpec, Placement, Topology, plan_reallocation
from realloc.plan import Plan, Route

TINY = ModelSpec.preset("tiny")


def test_a_layout_is_one_value_with_its_padding():
    a = Layout(TINY, Topology(dp=2, pp=2), 64)
    assert a == Layout(TINY, Topology(dp=2, pp=2), 64) and hash(a) == hash(Layout(TINY, Topology(dp=2, pp=2), 64))
    assert a != Layout(TINY, Topology(dp=2, pp=2))  # the padding is part of the value
    assert a == Layout(TINY, Topology(dp=2, pp=2, layer_split=a.layer_counts), 64)  # same effect, same value
    assert a.with_topology(Topology(dp=4)).vocab_pad_multiple == 64
    copy = pickle.loads(pickle.dumps(a.at(3)))
    assert copy.layout == a and copy.shards() == a.shards(3)
    assert "vocab pad 64" in str(a)


def test_layout_pickles_without_its_shard_tables():
    big = Layout(ModelSpec.preset("llama-70b"), Topology(dp=32, tp=8, pp=8))
    big.shards(0)  # fills the cache
    assert len(pickle.dumps(big)) < 200_000


@pytest.mark.parametrize(
    "error",
    [ReallocationError("boom", ["a"], ["b"], "dp=2,tp=1,pp=1"), GroupBusyError("busy"), StaleOperationError("old")],
)
def test_errors_of_the_ray_layer_pickle(error):
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error) and type(copy) is type(error)
    if isinstance(error, ReallocationError):
        assert (copy.dead, copy.unresponsive, copy.layout) == (error.dead, error.unresponsive, error.layout)


def plan_json() -> dict:
    return plan_reallocation(TINY, Topology(tp=2), Topology(dp=2), Placement.blocks(2, 1)).to_json()


def test_plan_steps_are_named_routes():
    plan = Plan.from_json(plan_json())
    assert all(isinstance(r, Route) for step in plan.steps for r in step)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["steps"].append([[0, 1, 0], [0, 1, 0]]), r"worker\(s\) \[0\] send more than once"),
        (lambda d: d["steps"].append([[0, 1, 0], [1, 1, 0]]), r"worker\(s\) \[1\] receive more than once"),
        (lambda d: d["segments"][0].__setitem__(3, "float8"), r"has dtype 'float8', not one of"),
        (lambda d: d["segments"][0].__setitem__(2, [0, 4]), r"has an invalid box"),
        (lambda d: d["steps"].append([[-1, 1, 0]]), r"names worker\(s\) \['-1'\] that do not exist"),
        (lambda d: d["steps"].append([[0, 1, 99]]), r"names a segment list that does not exist"),
        (lambda d: d.__setitem__("forward_from", 99), r"forward_from 99 is outside"),
        (lambda d: d.__setitem__("bucket_bytes", 3), r"bucket_bytes must be an integer of at least 16"),
    ],
)
def test_malformed_plans_are_refused(edit, message):
    data = plan_json()
    edit(data)
    with pytest.raises(ValueError, match=message):
        Plan.from_json(data)


def test_plans_naming_workers_beyond_the_group_are_refused():
    plan = plan_reallocation(TINY, Topology(tp=2), Topology(dp=2), Placement.blocks(4, 2))
    plan.validate(2)
    plan.steps.append([Route(0, 3, 0)])
    with pytest.raises(ValueError, match=r"worker\(s\) \['3'\] that do not exist .*below 2"):
        plan.validate(2)


def test_returned_views_carry_only_their_own_bytes():
    flat = torch.arange(1000.0)
    out = detach_result({"a": [flat[:10], flat[10:20]], "b": (flat[5:7],), "c": 3, "d": torch.ones(4)})
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in out["a"] + list(out["b"]))
    assert torch.equal(out["a"][1], flat[10:20]) and out["c"] == 3


def test_nccl_timeouts_raise_instead_of_killing_the_survivors():
    # torch's default (SkipCleanUp) would tear every survivor of a failed peer down.
    assert process_group_environment("nccl")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert process_group_environment("nccl")["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert process_group_environment("gloo") == {}


def test_group_config_resolves_the_transport_and_the_gpu_share():
    from actors.config import GroupConfig

    assert GroupConfig().backend == "gloo" and GroupConfig().num_gpus == 0
    assert GroupConfig(use_gpu=True).backend == "nccl" and GroupConfig(use_gpu=True).bundle()["GPU"] == 1
    shared = GroupConfig(use_gpu=True, gpus_per_worker=0.125)
    assert shared.backend == "gloo" and shared.num_gpus == 0.125 and shared.bundle() == {"CPU": 1, "GPU": 0.125}
    assert GroupConfig(use_gpu=True, transport="gloo").backend == "gloo"
    assert GroupConfig(use_gpu=True, gpus_per_worker=2).bundle()["GPU"] == 2


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda j: j["steps"][0].__setitem__(0, [0, 5, j["steps"][0][0][2]]),
            "uses worker 5 as a destination, but only workers \\[0, 1\\]",
        ),
        (lambda j: j["local_copies"].__setitem__(0, [7, 0]), "uses worker 7 as a source"),
        (lambda j: j["segments"][0].__setitem__(0, "bogus"), "does not fit worker 0's .*no shard of 'bogus'"),
        (lambda j: j["segments"][0].__setitem__(1, [400, 0]), "does not fit worker 0's .*offsets=\\(400, 0\\)"),
        (
            lambda j: j["segments"][0].__setitem__(3, "float32"),
            "as float32, but worker 0's source store holds it as bfloat16",
        ),
    ],
)
def test_the_in_process_executor_refuses_an_edited_plan_before_writing(edit, message):
    """A plan read back from JSON after someone edited it fails with a ValueError naming what does
    not fit, and nothing is written (it used to raise a bare KeyError mid-copy, or run a wrong dtype)."""
    from realloc.shards import ShardStore, allocate_buffers, execute_in_process

    spec = ModelSpec.preset("tiny")
    a, b = Layout(spec, Topology(tp=2)), Layout(spec, Topology(dp=2))
    data = plan_reallocation(spec, a, b, Placement.blocks(2, 1)).to_json()
    edit(data)
    src = {r: ShardStore(a.shards(r), {d: t.fill_(1) for d, t in allocate_buffers(a, r).items()}) for r in range(2)}
    dst = {r: ShardStore(b.shards(r), allocate_buffers(b, r)) for r in range(2)}
    with pytest.raises(ValueError, match=message):
        execute_in_process(Plan.from_json(data), src, dst)
    assert all(not t.any() for store in dst.values() for t in store.buffers.values())


def test_an_actor_killed_for_memory_counts_as_dead(monkeypatch):
    """Ray answers every call to an actor its memory monitor killed with ``OutOfMemoryError``:
    the diagnosis must call it dead (so ``replace_dead_workers`` replaces it), not a live worker
    whose call failed."""
    import ray

    from actors import remote

    errors = {
        "oom": ray.exceptions.OutOfMemoryError("killed by the memory monitor"),
        "died": ray.exceptions.ActorDiedError(),
        "raised": ray.exceptions.RayTaskError("f", "tb", ValueError()),
    }

    def get(ref, **_):
        if ref in errors:
            raise errors[ref]
        return ref

    monkeypatch.setattr(remote.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(remote.ray, "get", get)
    workers = remote.Workers(("a0", "a1", "a2", "a3"), ("w0", "w1", "w2", "w3"))
    found = remote.settle(workers, ["oom", "died", "raised", "fine"], 1.0)
    assert (found.dead, found.failed, found.unresponsive) == (("w0", "w1"), ("w2",), ())
