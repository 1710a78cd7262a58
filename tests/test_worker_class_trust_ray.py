"""Your worker class, trusted with nothing: its own attribute names, its ``__init__``, its calls.

What must hold (issue 22): a subclass of ``ShardWorker`` may name its own state ``group``,
``device``, ``spec``, ``layout``, ``rank``, ``buffers``, ``transport``... (the library's state
lives under ``self._realloc`` alone) and every move, verification, fill and checkpoint keeps
working with the user's values intact; an ``__init__`` that cannot take the workers' arguments
is a ``ValueError`` at ``create`` before anything starts; bad arguments of ``call``, ``run`` and
``release_resident`` are ``ValueError``s on the driver before any traffic, with no state change.

Real Ray actors on two simulated nodes (one cluster for the module).
"""

from __future__ import annotations

import sys
import threading

import pytest
import ray
from simulated import simulated_cluster

from actors import ModelGroup, ReallocationError, ShardWorker
from realloc import ModelSpec, Topology

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

TINY = ModelSpec.preset("tiny")
TRAIN, GEN = "dp=2,tp=2", "tp=4"
#: What the user's worker keeps under the library's old attribute names.
MINE = {
    "group": "my group",
    "device": "my device",
    "spec": {"my": "spec"},
    "layout": "my layout",
    "rank": -7,
    "buffers": ["my", "buffers"],
}
LATER = {
    "transport": "my transport",
    "node_id": "my node",
    "allocator": "my allocator",
    "held": "my held",
    "op": "my op",
    "communicators": "my communicators",
    "backend": "my backend",
    "wire": "my wire",
    "counters": "my counters",
    "phases": "my phases",
    "staging": "my staging",
    "world_id": "my world",
    "_kept": "my kept",
    "_store": "my store",
    "_fault": "my fault",
    "_bundles": "my bundles",
    "_mapped": "my mapped",
    "_copier": "my copier",
    "_runs": "my runs",
    "_ckpt_state": "my ckpt",
}


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=2) as c:
        yield c


class Caller(ShardWorker):
    """A user's worker with methods to call (and a hook that reads its context)."""

    def on_shards_changed(self, ctx, change) -> None:
        self.__dict__.setdefault("changes", []).append(change.kind)
        assert ctx.rank in range(4) and ctx.device.type == "cpu" and self.context().rank == ctx.rank

    def shard_sum(self) -> float:
        ctx = self.context()  # the library's view, whatever the user's names hold
        return float(sum(t.double().sum() for t in ctx.tensors.values()))

    def echo(self, value, *, twice: bool = False):
        return (value, value) if twice else value

    @staticmethod
    def static_echo(value):
        return value

    @classmethod
    def class_echo(cls, value):
        return cls.__name__, value

    def shadow(self, name: str) -> None:
        setattr(self, name, 1)


class Policy(Caller):
    """A user's worker whose state uses the natural names, set in __init__, in the hook and in a
    called method."""

    def __init__(self, *args, note: str = "mine", **kwargs):
        super().__init__(*args, **kwargs)
        for name, value in MINE.items():
            setattr(self, name, value)
        self.note = note

    def on_shards_changed(self, ctx, change) -> None:
        self.device = MINE["device"]  # again, in the hook
        super().on_shards_changed(ctx, change)

    def take_more_names(self) -> None:
        for name, value in LATER.items():
            setattr(self, name, value)
        self.spec = MINE["spec"]

    def mine(self) -> dict:
        names = [*MINE, *LATER, "note"]
        return {n: self.__dict__[n] for n in names if n in self.__dict__}


def test_worker_class_may_use_the_natural_attribute_names(cluster, tmp_path):
    g = ModelGroup.create(TINY, TRAIN, name="natural", worker_cls=Policy, timeout_s=60)
    try:
        g.init_synthetic(1)
        assert g.verify_synthetic(1) == {}
        g.call("take_more_names")
        sums = g.call("shard_sum", writes=False)
        g.reallocate(GEN, keep="in_place")
        assert g.verify_synthetic(1) == {}
        assert g.reallocate(TRAIN, keep="in_place").resident_use == "adopted"
        assert g.verify_synthetic(1) == {} and g.call("shard_sum", writes=False) == sums
        assert [r.fresh for r in g.resident_layouts()] == [True]
        g.release_resident()
        g.trim_memory()
        m = g.checkpoint_manager(root=str(tmp_path), run_id="natural")
        m.save(1).wait()
        g.init_synthetic(2)
        assert g.verify_synthetic(1) != {}
        m.load()
        assert g.verify_synthetic(1) == {}
        assert g.run(lambda ctx: ctx.rank, writes=False) == [0, 1, 2, 3]
        for rank, state in enumerate(g.call("mine", writes=False)):
            assert state == {**MINE, **LATER, "note": "mine"}, rank
        assert g.call("echo", 5, ranks=[2]) == [5]
    finally:
        g.shutdown()


def test_init_signature_is_checked_before_anything_starts(cluster):
    class NeedsFoo(ShardWorker):
        def __init__(self, foo):
            super().__init__()

    class KeywordOnly(ShardWorker):
        def __init__(self, *args, foo, **kwargs):
            super().__init__(*args, **kwargs)

    class TooFew(ShardWorker):
        def __init__(self, group, spec):
            super().__init__(group, spec, True)

    groups = len(ray.util.placement_group_table())
    for cls in (NeedsFoo, KeywordOnly, TooFew):
        with pytest.raises(
            ValueError,
            match=rf"worker_cls {cls.__name__}\.__init__\(.*\) cannot take what every "
            r"worker is started with.*allowed: no __init__ of your own, or def "
            r"__init__\(self, \*args, \*\*kwargs\)",
        ):
            ModelGroup.create(TINY, "tp=2", name="badinit", worker_cls=cls)
    assert len(ray.util.placement_group_table()) == groups  # no placement group was made
    with pytest.raises(ValueError):
        ray.get_actor("realloc:badinit:rank0")

    class StateAttribute(ShardWorker):
        _realloc = None

    with pytest.raises(ValueError, match=r"redefines methods the protocol relies on: \['_realloc'\]"):
        ModelGroup.create(TINY, "tp=2", name="badinit", worker_cls=StateAttribute)


def test_init_without_super_is_named_and_cleaned_up(cluster):
    class NoSuper(ShardWorker):
        def __init__(self, *args, **kwargs):
            self.ready = True

    with pytest.raises(
        ReallocationError,
        match=r"NoSuper: ShardWorker\.__init__ did not run; an __init__ of your "
        r"own must call super\(\)\.__init__\(\*args, \*\*kwargs\)",
    ):
        ModelGroup.create(TINY, "tp=2", name="nosuper", worker_cls=NoSuper, timeout_s=60)
    with pytest.raises(ValueError):
        ray.get_actor("realloc:nosuper:rank0")
    # the name is free again: a good class starts under it
    ModelGroup.create(TINY, "tp=2", name="nosuper", worker_cls=Caller, timeout_s=60).shutdown()


@pytest.fixture(scope="module")
def kept(cluster):
    """A group keeping its generation layout (fresh: the version did not move since)."""
    g = ModelGroup.create(TINY, GEN, name="kept", worker_cls=Caller, timeout_s=60)
    try:
        g.init_synthetic(3)
        g.reallocate(TRAIN, keep="in_place")
        yield g
    finally:
        g.shutdown()


def unchanged(g: ModelGroup):
    """The group's observable state: worker activity, layout, kept layouts and their freshness."""
    return g.activity(), str(g.layout), g.version, [(str(r.layout), r.fresh) for r in g.resident_layouts()]


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (
            (),
            {},
            r"Caller\.echo\(self, value, \*, twice: '?bool'? = False\) cannot take these arguments: missing a "
            r"required argument: 'value'",
        ),
        ((1, 2), {}, r"Caller\.echo.*too many positional arguments"),
        ((1,), {"thrice": True}, r"Caller\.echo.*unexpected keyword argument 'thrice'"),
        (
            (threading.Lock(),),
            {},
            r"the arguments of call\('echo'\) cannot be sent to the workers, they must pickle: "
            r"TypeError",
        ),
    ],
)
def test_call_arguments_are_checked_on_the_driver(kept, args, kwargs, match):
    before = unchanged(kept)
    with pytest.raises(ValueError, match=match):
        kept.call("echo", *args, **kwargs)
    assert unchanged(kept) == before


def test_run_arguments_are_checked_on_the_driver(kept):
    lock = threading.Lock()
    before = unchanged(kept)
    with pytest.raises(
        ValueError,
        match=r"run: <lambda>\(ctx, scale\) cannot take these arguments: missing a "
        r"required argument: 'scale'",
    ):
        kept.run(lambda ctx, scale: scale)
    with pytest.raises(ValueError, match=r"the arguments of run cannot be sent to the workers, they must pickle"):
        kept.run(lambda ctx: lock.locked())
    assert unchanged(kept) == before
    assert kept.run(lambda ctx, scale: scale * ctx.rank, 2, writes=False) == [0, 2, 4, 6]


def test_call_edge_values(kept):
    before = unchanged(kept)
    assert kept.call("echo", 1, ranks=[]) == []  # nobody runs it: nothing sent, the kept layout stays fresh
    for ranks in (0, "0", [True], [0, 0], [4], (-1,)):
        with pytest.raises(ValueError, match="ranks"):
            kept.call("echo", 1, ranks=ranks)
    for name in ("op_commit", "_drop_op", "rank", "note", "on_shards_changed", "shutdown"):
        with pytest.raises(ValueError, match=rf"'{name}' is not a method of worker class Caller"):
            kept.call(name)
    assert unchanged(kept) == before
    assert kept.call("static_echo", 4, ranks=[1], writes=False) == [4]
    assert kept.call("class_echo", 4, ranks=[1], writes=False) == [("Caller", 4)]
    assert kept.call("echo", 3, twice=True, ranks=[3], writes=False) == [(3, 3)]
    with pytest.raises(ValueError, match=r"Caller\.static_echo\(value\) cannot take"):
        kept.call("static_echo")
    assert unchanged(kept) == before


def test_release_resident_arguments(kept):
    before = unchanged(kept)
    for bad in (3, 2.5, b"tp=4", {GEN: 1}, object()):
        with pytest.raises(
            ValueError,
            match=r"layouts must be None \(every kept layout\), one layout \(a "
            r"realloc\.Topology, a topology string like 'dp=2,tp=4' or a "
            r"realloc\.Layout\) or a sequence of them, got",
        ):
            kept.release_resident(bad)
    with pytest.raises(ValueError, match=r"keeps no layout \['dp=4"):
        kept.release_resident("dp=4")
    assert unchanged(kept) == before
    kept.release_resident([])  # nothing to free: nothing sent
    assert unchanged(kept) == before
    kept.release_resident(GEN)  # one topology string is one layout
    assert kept.resident_layouts() == []
    kept.reallocate(GEN, keep="in_place")
    kept.release_resident(Topology.parse(TRAIN))  # so is one Topology
    assert kept.resident_layouts() == []
    kept.reallocate(TRAIN, keep="host")
    kept.release_resident(kept.target(GEN))  # and one Layout
    assert kept.resident_layouts() == [] and kept.verify_synthetic(3) == {}


def test_assigning_a_reserved_method_name_is_named_and_undone(kept):
    with pytest.raises(
        ReallocationError,
        match=r"Caller\.shadow assigned attribute\(s\) \['context'\] of the "
        r"worker: those names are methods the library calls",
    ):
        kept.call("shadow", "context", ranks=[1])
    kept.reallocate(GEN)  # the hook runs self.context() on rank 1: the library's method again
    assert kept.verify_synthetic(3) == {} and kept.call("shard_sum", writes=False)[1] != 0
    kept.reallocate(TRAIN)
