"""Invalid input through the Python API (not the CLI), table-driven.

Every case must raise ``ValueError`` (or a documented error of :mod:`actors.errors` /
:mod:`realloc.ckpt.errors`) whose message names what was wrong, *before any traffic*: no worker
ran a prepare/execute/commit/abort step (``ModelGroup.activity``), the group's layout is
unchanged, no placement group or named actor was left behind. After the whole table the group
still holds its weights, reallocates, copies and checkpoints.

One simulated cluster (head without CPUs, two nodes of 4 CPUs) and one set of groups per module:
``inv-policy`` (dp=2,tp=2, spread 2+2 over the nodes), ``inv-ref`` (tp=2), ``inv-other`` (one
worker of another, smaller model) and ``inv-closed`` (one worker, shut down in the fixture).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

ray = pytest.importorskip("ray")

from simulated import simulated_cluster

from actors import Fleet, ModelGroup, ShardWorker
from actors.config import GroupConfig
from actors.errors import ReallocationError
from actors.wire.zero_copy import sweep_stale_buffers
from realloc import ModelSpec, Placement, Topology
from realloc.ckpt.errors import CheckpointError
from realloc.ckpt.hf import save_hf_dir
from realloc.layout import Layout
from realloc.plan import Plan, plan_reallocation
from realloc.shards.synthetic import synthetic_state_dict
from realloc.spec import decoder_spec, hf_config_of

pytestmark = pytest.mark.slow

NODES, CPUS_PER_NODE = 2, 4
SEED = 3
TINY = ModelSpec.preset("tiny")  # 12 heads, 2 kv heads, 4 layers, tied embedding, vocab 1001
MINI = decoder_spec("mini", hidden=32, intermediate=64, layers=2, heads=4, vocab=64)  # another model
TRAIN = Topology(dp=2, tp=2)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
#: A failing call must fail fast (no waiting on the cluster): well under the groups' timeout_s=60.
FAST_S = 10.0


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(NODES, CPUS_PER_NODE) as c:
        yield c.cluster


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("invalid-api")
    # SPREAD: two workers per node, so the default clique jump (workers per node) with factor 2
    # puts the two copies of every rank file on different nodes.
    policy = ModelGroup.create(TINY, TRAIN, name="inv-policy", timeout_s=60, strategy="SPREAD")
    ref = ModelGroup.create(TINY, Topology(tp=2), name="inv-ref", timeout_s=60)
    other = ModelGroup.create(MINI, Topology(), name="inv-other", timeout_s=60)
    closed = ModelGroup.create(TINY, Topology(), name="inv-closed", timeout_s=60)
    closed.shutdown()
    try:
        assert policy.placement.num_nodes == 2 and policy.placement.per_node() == 2, policy.placement
        policy.init_synthetic(seed=SEED)
        ckpt = policy.checkpoint_manager(root=str(tmp / "ckpt"), run_id="inv", factor=2)
        ckpt.save(1)
        empty = tmp / "empty"
        empty.mkdir()
        mini_hf = tmp / "mini-hf"
        save_hf_dir(synthetic_state_dict(MINI, 0), mini_hf)
        yield SimpleNamespace(
            policy=policy, ref=ref, other=other, closed=closed, ckpt=ckpt, tmp=tmp, empty=empty, mini_hf=mini_hf
        )
    finally:
        for g in (policy, ref, other):
            g.shutdown()
        sweep_stale_buffers()


# -- helpers for the table --------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[SimpleNamespace], Any]
    error: type[BaseException]
    match: str


CASES: list[Case] = []


def case(
    category: str,
    name: str,
    call: Callable[[SimpleNamespace], Any],
    match: str,
    error: type[BaseException] = ValueError,
) -> None:
    CASES.append(Case(f"{category}: {name}", call, error, match))


def create(spec: object = TINY, topology: object = Topology(tp=2), **kwargs: Any) -> Callable:
    """A ``ModelGroup.create`` call; valid apart from what ``kwargs`` override."""
    kwargs.setdefault("name", "inv-new")
    if "config" not in kwargs:
        kwargs.setdefault("timeout_s", 60)
    return lambda e: ModelGroup.create(spec, topology, **kwargs)


def state(change: Callable[[dict], None] | None = None) -> Callable:
    """A ``load_state_dict`` call with the synthetic state of seed 99, changed by ``change``."""

    def call(e):
        s = synthetic_state_dict(TINY, 99)
        if change is not None:
            change(s)
        return e.policy.load_state_dict(s)

    return call


def plan_json(change: Callable[[dict], None]) -> Callable:
    """``Plan.from_json`` of a valid plan's JSON (tp=2 -> dp=2 over two nodes) changed by ``change``."""

    def call(e):
        data = plan_reallocation(TINY, Topology(tp=2), Topology(dp=2), Placement.blocks(2, 1)).to_json()
        change(data)
        return Plan.from_json(data)

    return call


def plan_validate(num_workers: int, change: Callable[[Plan], None]) -> Callable:
    def call(e):
        plan = plan_reallocation(TINY, Topology(tp=2), Topology(dp=2), Placement.blocks(2, 1))
        change(plan)
        return plan.validate(num_workers)

    return call


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


def _route(step: int, *routes: list) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        while len(d["steps"]) <= step:
            d["steps"].append([])
        d["steps"][step] = [list(r) for r in routes]

    return change


# -- the table ---------------------------------------------------------------------------------

# ModelGroup.create: argument types and values, names, the cluster's capacity.
C = "create"
case(C, "spec as a preset name", create(spec="tiny"), r"spec must be a realloc\.ModelSpec .*got str 'tiny'")
case(C, "spec None", create(spec=None), r"spec must be a realloc\.ModelSpec .*got NoneType")
case(C, "topology 42", create(topology=42), r"a layout is a realloc\.Topology.*got int")
case(C, "topology None", create(topology=None), r"a layout is a realloc\.Topology.*got NoneType")
case(C, "topology 'dp=0'", create(topology="dp=0"), r"topology dp must be a positive integer, got 0")
case(C, "topology empty part", create(topology="dp=2,,tp=2"), r"bad topology part '' in 'dp=2,,tp=2'")
case(C, "topology unknown dim", create(topology="tp=2,xp=2"), r"bad topology part 'xp=2'")
case(C, "tp the model cannot take", create(topology=Topology(tp=3)), r"tp=3 does not fit tiny")
case(C, "pp beyond the layers", create(topology=Topology(pp=5)), r"pp=5 is larger than the 4 layers of tiny")
case(
    C,
    "a Layout and another padding",
    create(topology=Layout(TINY, Topology(dp=2, tp=2), 64), vocab_pad_multiple=8),
    r"vocab_pad_multiple=8 contradicts the layout's own padding \(64\)",
)
case(
    C,
    "a Layout and another vocab_pad_rule",
    create(topology=Layout(TINY, Topology(tp=2), 64), vocab_pad_rule="vllm"),
    r"vocab_pad_rule='vllm' contradicts the layout's own vocab_pad_rule \(megatron\)",
)
case(
    C,
    "vocab_pad_rule unknown",
    create(vocab_pad_rule="sglang"),
    r"vocab_pad_rule must be one of 'megatron', 'vllm', got 'sglang'",
)
case(
    C,
    "qkv_order with linear_qkv rows tp does not divide",
    create(topology=Topology(tp=6), qkv_order="megatron"),
    r"qkv_order='megatron' .*2 query groups \(kv heads\) cannot be split 6 ways.*128 rows",
)
case(C, "topology string of the wrong type", lambda e: Topology.parse(5), r"a topology string looks like .*got int 5")
case(
    C,
    "layer_split not summing",
    create(topology=Topology(pp=2, layer_split=(1, 2))),
    r"layer_split \(1, 2\) sums to 3 but tiny has 4 layers",
)
case(
    C,
    "layout of another model",
    create(topology=Layout(MINI, Topology())),
    r"layout Layout\(mini, .*\) is of model 'mini', not 'tiny'",
)
for bad in (0, -1, True, 1.5):
    case(
        C,
        f"vocab_pad_multiple={bad!r}",
        create(vocab_pad_multiple=bad),
        rf"vocab_pad_multiple must be a positive integer, got {re.escape(repr(bad))}",
    )
for bad in (float("inf"), "10", 0, -1, True, float("nan")):
    case(
        C,
        f"timeout_s={bad!r}",
        create(timeout_s=bad),
        rf"timeout_s must be a finite positive number of seconds, got {re.escape(repr(bad))}",
    )
    case(
        C,
        f"start_timeout_s={bad!r}",
        create(start_timeout_s=bad),
        rf"start_timeout_s must be a finite positive number of seconds, got {re.escape(repr(bad))}",
    )
for bad in ("1", -1, float("nan"), float("inf"), True):
    case(
        C,
        f"cpus_per_worker={bad!r}",
        create(cpus_per_worker=bad),
        rf"cpus_per_worker must be a finite number >= 0, got {re.escape(repr(bad))}",
    )
for bad in (10, "64", 1.5, True):
    case(
        C,
        f"bucket_bytes={bad!r}",
        create(bucket_bytes=bad),
        rf"bucket_bytes must be an integer of at least 1024, got {re.escape(repr(bad))}",
    )
case(C, "strategy FOO", create(strategy="FOO"), r"placement strategy 'FOO' is not one of \('PACK', ")
case(C, "strategy lower case", create(strategy="pack"), r"placement strategy 'pack' is not one of")
case(C, "use_gpu 'yes'", create(use_gpu="yes"), r"use_gpu must be True or False, got 'yes'")
case(C, "zero_copy 1", create(zero_copy=1), r"zero_copy must be True or False, got 1")
for bad in (0, -0.5, 1.5, float("inf"), "1", True):
    case(
        C,
        f"gpus_per_worker={bad!r}",
        create(use_gpu=True, gpus_per_worker=bad),
        rf"gpus_per_worker must be a fraction in \(0, 1\] or a whole number of GPUs \(what Ray can assign\), "
        rf"got {re.escape(repr(bad))}",
    )
case(
    C,
    "gpus_per_worker without use_gpu",
    create(gpus_per_worker=0.5),
    r"gpus_per_worker=0\.5 needs use_gpu=True \(CPU workers hold no GPU\)",
)
case(C, "transport 'mpi'", create(transport="mpi"), r"transport 'mpi' is not one of \('auto', 'nccl', 'gloo'\)")
case(
    C,
    "nccl for CPU workers",
    create(transport="nccl"),
    r"transport='nccl' needs use_gpu=True and gpus_per_worker >= 1 .*got use_gpu=False, gpus_per_worker=1; "
    r"use 'gloo' or 'auto'",
)
case(
    C,
    "nccl for workers sharing a GPU",
    create(use_gpu=True, gpus_per_worker=0.25, transport="nccl"),
    r"transport='nccl' needs .* refuses two ranks on one GPU\), got use_gpu=True, gpus_per_worker=0\.25",
)
case(
    C,
    "fractional GPUs on a CPU-only cluster",
    create(use_gpu=True, gpus_per_worker=0.5),
    r"the cluster cannot hold 2 workers of 0\.5 GPU each",
)
case(C, "bandwidths 3", create(bandwidths=3), r"bandwidths must be a realloc\.Bandwidths, got int")
case(C, "runtime_env 'x'", create(runtime_env="x"), r"runtime_env must be a dict or None, got str")
case(C, "unknown setting foo", create(foo=1), r"unknown group settings \['foo'\]; allowed: \[.*'timeout_s'")
case(
    C, "unknown setting next to known ones", create(timeout=5, strategy="PACK"), r"unknown group settings \['timeout'\]"
)
case(
    C,
    "config and settings together",
    create(config=GroupConfig(), timeout_s=5),
    r"give either config= or settings, not both \(got \['timeout_s'\]\)",
)
case(C, "config a dict", create(config={"timeout_s": 5}), r"config must be an actors\.config\.GroupConfig, got dict")
for bad in ("", "a/b", "a:b", " x", "x ", 5, None):
    case(
        C,
        f"name {bad!r}",
        create(name=bad),
        rf"group name must be a non-empty string without '/', ':' or surrounding spaces, got {re.escape(repr(bad))}",
    )
case(
    C,
    "name of a running group",
    create(name="inv-policy"),
    r"a group named 'inv-policy' is already running .*choose another name",
)
case(
    C,
    "more workers than the cluster holds",
    create(topology=Topology(dp=16)),
    r"the cluster cannot hold 16 workers of 1 CPU each with strategy PACK: its 3 live nodes have 8 CPU in all "
    r"and fit 8",
)
case(
    C,
    "a worker larger than any node",
    create(topology=Topology(), cpus_per_worker=5),
    r"the cluster cannot hold 1 workers of 5 CPU each .* fit 0 \(add nodes, or lower cpus_per_worker\)",
)
case(C, "GPUs on a CPU-only cluster", create(use_gpu=True), r"the cluster cannot hold 2 workers of 1 GPU each")
case(
    C,
    "STRICT_PACK beyond one node",
    create(topology=Topology(dp=8), strategy="STRICT_PACK"),
    r"cannot hold 8 workers of 1 CPU each with strategy STRICT_PACK: .* fit 4",
)
case(
    C,
    "STRICT_SPREAD beyond the nodes",
    create(topology=Topology(dp=3), strategy="STRICT_SPREAD"),
    r"cannot hold 3 workers of 1 CPU each with strategy STRICT_SPREAD: .* fit 2",
)
for bad in (0, 0.0):
    case(
        C,
        f"a bundle of no resources (cpus_per_worker={bad!r})",
        create(cpus_per_worker=bad),
        rf"cpus_per_worker must be > 0 unless use_gpu=True \(a worker's placement bundle needs some resource\), "
        rf"got {bad!r}",
    )

# reallocate / plan_to: the destination and the claimed source.
R = "reallocate"
case(R, "dst None", lambda e: e.policy.reallocate(None), r"a layout is a realloc\.Topology.*got NoneType")
case(R, "dst 42", lambda e: e.policy.reallocate(42), r"a layout is a realloc\.Topology.*got int")
case(R, "dst True", lambda e: e.policy.reallocate(True), r"a layout is a realloc\.Topology.*got bool")
case(R, "dst a dict", lambda e: e.policy.reallocate({"tp": 4}), r"a layout is a realloc\.Topology.*got dict")
case(R, "dst 'dp=0'", lambda e: e.policy.reallocate("dp=0"), r"topology dp must be a positive integer, got 0")
case(R, "dst 'xx=2'", lambda e: e.policy.reallocate("xx=2"), r"bad topology part 'xx=2'.*dp=N, tp=N or pp=N")
case(R, "dst empty string", lambda e: e.policy.reallocate(""), r"topology string is empty")
case(
    R,
    "dst world size",
    lambda e: e.policy.reallocate(Topology(dp=4, tp=2)),
    r"destination dp=4,tp=2,pp=1 needs 8 workers but group 'inv-policy' has 4; dp\*tp\*pp must stay 4",
)
case(R, "dst string world size", lambda e: e.policy.reallocate("dp=8"), r"needs 8 workers but group 'inv-policy' has 4")
case(R, "dst tp that does not fit", lambda e: e.policy.reallocate(Topology(tp=3)), r"tp=3 does not fit tiny")
case(R, "dst pp beyond the layers", lambda e: e.policy.reallocate("pp=8"), r"pp=8 is larger than the 4 layers")
case(
    R,
    "dst unknown pp_split",
    lambda e: e.policy.reallocate("tp=2,pp=2,pp_split=even"),
    r"unknown pp_split 'even'; allowed: vllm, megatron, balanced",
)
case(
    R,
    "dst megatron split that is uneven",
    lambda e: e.policy.reallocate(Topology(pp=3, pp_split="megatron")),
    r"tiny: pp_split='megatron' needs pp to divide the layer count",
)
case(
    R,
    "dst layout of another model",
    lambda e: e.policy.reallocate(Layout(MINI, Topology(dp=4))),
    r"is of model 'mini', not 'tiny'",
)
case(
    R,
    "dst layout of another world size",
    lambda e: e.policy.reallocate(Layout(TINY, Topology(tp=2))),
    r"needs 2 workers but group 'inv-policy' has 4",
)
case(
    R,
    "src that is not the current layout",
    lambda e: e.policy.reallocate(Topology(tp=4), src=Topology(tp=4)),
    r"group 'inv-policy' holds layout dp=2,tp=2,pp=1, but src says dp=1,tp=4,pp=1",
)
case(
    R,
    "src string that does not match",
    lambda e: e.policy.reallocate("tp=4", src="dp=4"),
    r"holds layout dp=2,tp=2,pp=1, but src says dp=4,tp=1,pp=1",
)
case(
    R,
    "src with other vocabulary padding",
    lambda e: e.policy.reallocate("tp=4", src=Layout(TINY, TRAIN, vocab_pad_multiple=64)),
    r"holds layout dp=2,tp=2,pp=1, but src says dp=2,tp=2,pp=1 vocab pad 64",
)
case(
    R,
    "src of the wrong type",
    lambda e: e.policy.reallocate("tp=4", src=42),
    r"a layout is a realloc\.Topology.*got int",
)
case(R, "src a list", lambda e: e.policy.reallocate("tp=4", src=[2, 2]), r"a layout is a realloc\.Topology.*got list")
case(R, "src world size", lambda e: e.policy.reallocate("tp=4", src="dp=8"), r"needs 8 workers")
case(
    R,
    "src of another model",
    lambda e: e.policy.reallocate("tp=4", src=Layout(MINI, Topology(dp=4))),
    r"is of model 'mini', not 'tiny'",
)
case(
    R, "src malformed string", lambda e: e.policy.reallocate("tp=4", src="dp=2;tp=2"), r"bad topology part 'dp=2;tp=2'"
)
case(R, "plan_to world size", lambda e: e.policy.plan_to("dp=3"), r"needs 3 workers but group 'inv-policy' has 4")
case(R, "plan_to None", lambda e: e.policy.plan_to(None), r"a layout is a realloc\.Topology")

# copy_to: the other group and the blend factor.
K = "copy_to"
case(K, "other a string", lambda e: e.policy.copy_to("h"), r"copy_to needs another ModelGroup or a CopyTarget, got str")
case(
    K, "other None", lambda e: e.policy.copy_to(None), r"copy_to needs another ModelGroup or a CopyTarget, got NoneType"
)
case(
    K,
    "other a layout",
    lambda e: e.policy.copy_to(e.ref.layout),
    r"copy_to needs another ModelGroup or a CopyTarget, got Layout",
)
case(K, "other itself", lambda e: e.policy.copy_to(e.policy), r"copy_to needs another group; use reallocate")
case(K, "other of another model", lambda e: e.policy.copy_to(e.other), r"model specs 'tiny' and 'mini' differ")
case(K, "from a group of another model", lambda e: e.other.copy_to(e.policy), r"model specs 'mini' and 'tiny' differ")
case(K, "other shut down", lambda e: e.policy.copy_to(e.closed), r"copy_to: group 'inv-closed' was shut down")
case(  # it returned an update whose wait() failed, after calls to the dead actors (found in review, 2026-11-28)
    K,
    "staged copy from a group shut down",
    lambda e: e.closed.copy_to(e.policy, stage=True),
    r"stage from group 'inv-closed': it was shut down",
)
for bad in ("0.5", True, -0.1, 1.5, float("nan"), float("inf"), [0.5]):
    case(
        K,
        f"eta {bad!r}",
        lambda e, bad=bad: e.policy.copy_to(e.ref, eta=bad),
        rf"blend eta must be a number within \[0, 1\], got {re.escape(repr(bad))}",
    )

# run: the function.
U = "run"
for bad in (None, 42, "fn", {"fn": 1}):
    case(
        U,
        f"fn {bad!r}",
        lambda e, bad=bad: e.policy.run(bad),
        rf"run needs a callable fn\(ctx, \.\.\.\), got {type(bad).__name__}",
    )

# load_state_dict: the mapping, its keys and its tensors.
S = "load_state_dict"
case(S, "None", lambda e: e.policy.load_state_dict(None), r"a state dict maps parameter names to tensors, got NoneType")
case(
    S,
    "a list of pairs",
    lambda e: e.policy.load_state_dict(list(synthetic_state_dict(TINY, 0).items())),
    r"a state dict maps parameter names to tensors, got list",
)
case(S, "a tensor", lambda e: e.policy.load_state_dict(torch.zeros(3)), r"got Tensor")
case(
    S,
    "a parameter missing",
    state(lambda s: s.pop("model.norm.weight")),
    r"state dict lacks parameter 'model\.norm\.weight'",
)
case(S, "empty", lambda e: e.policy.load_state_dict({}), r"state dict lacks parameter 'model\.embed_tokens\.weight'")
case(
    S,
    "an extra key",
    state(lambda s: s.__setitem__("model.extra.weight", torch.zeros(2))),
    r"state dict has keys that are not parameters of 'tiny': \['model\.extra\.weight'\]",
)
case(
    S,
    "a non-string key",
    state(lambda s: s.__setitem__(7, torch.zeros(2))),
    r"state dict has keys that are not parameters of 'tiny': \['7'\]",
)
case(
    S,
    "numpy arrays",
    state(lambda s: s.update({k: v.float().numpy() for k, v in s.items()})),
    r"parameter 'model\.embed_tokens\.weight' must be a torch\.Tensor, got ndarray",
)
case(
    S,
    "a list instead of a tensor",
    state(lambda s: s.__setitem__("model.norm.weight", [1.0] * 96)),
    r"parameter 'model\.norm\.weight' must be a torch\.Tensor, got list",
)
case(
    S,
    "a meta tensor",
    state(lambda s: s.__setitem__("model.norm.weight", torch.empty(96, device="meta"))),
    r"parameter 'model\.norm\.weight' is a meta tensor \(no data\)",
)
case(
    S,
    "wrong shape",
    state(lambda s: s.__setitem__(EMBED, s[EMBED].t())),
    r"parameter 'model\.embed_tokens\.weight' has shape \(96, 1001\), expected \(1001, 96\)",
)
case(
    S,
    "a scalar",
    state(lambda s: s.__setitem__("model.norm.weight", torch.tensor(1.0))),
    r"parameter 'model\.norm\.weight' has shape \(\), expected \(96,\)",
)
case(
    S,
    "an integer tensor",
    state(lambda s: s.__setitem__(EMBED, s[EMBED].to(torch.int32))),
    r"parameter 'model\.embed_tokens\.weight' has dtype torch\.int32; expected a floating-point tensor",
)
case(
    S,
    "a bool tensor",
    state(lambda s: s.__setitem__("model.norm.weight", torch.ones(96, dtype=torch.bool))),
    r"has dtype torch\.bool; expected a floating-point tensor",
)
case(
    S,
    "a complex tensor",
    state(lambda s: s.__setitem__("model.norm.weight", torch.ones(96, dtype=torch.complex64))),
    r"has dtype torch\.complex64; expected a floating-point tensor",
)
case(
    S,
    "tied head and embedding differ",
    state(lambda s: s.__setitem__(HEAD, s[EMBED] + 1)),
    r"tied parameters 'model\.embed_tokens\.weight' and 'lm_head\.weight' are both given and differ",
)
case(
    S,
    "tied head of another shape",
    state(lambda s: s.__setitem__(HEAD, s[EMBED][:10])),
    r"parameter 'lm_head\.weight' has shape \(10, 96\), expected \(1001, 96\)",
)
case(
    S,
    "tied head a numpy array",
    state(lambda s: s.__setitem__(HEAD, s[EMBED].float().numpy())),
    r"parameter 'lm_head\.weight' must be a torch\.Tensor, got ndarray",
)
case(
    S,
    "tied head a meta tensor",
    state(lambda s: s.__setitem__(HEAD, torch.empty(1001, 96, device="meta"))),
    r"parameter 'lm_head\.weight' is a meta tensor",
)
case(
    S,
    "tied head an integer tensor",
    state(lambda s: s.__setitem__(HEAD, s[EMBED].to(torch.int64))),
    r"parameter 'lm_head\.weight' has dtype torch\.int64; expected a floating-point tensor",
)

# shard_boxes: the ranks.
B = "shard_boxes"
for bad in ([99], [-1], [4], [True], [1.5], [0, "1"]):
    case(
        B,
        f"ranks {bad!r}",
        lambda e, bad=bad: e.policy.shard_boxes(bad),
        rf"ranks \[{re.escape(repr(bad[-1]))}\] are not ranks of group 'inv-policy' \(0\.\.3\)",
    )
case(B, "a rank twice", lambda e: e.policy.shard_boxes([0, 0]), r"ranks \[0, 0\] name a rank twice")
for bad in ("0", 0, {0, 1}, b"\x00"):
    case(
        B,
        f"ranks {bad!r}",
        lambda e, bad=bad: e.policy.shard_boxes(bad),
        rf"ranks must be a sequence of integers, got {type(bad).__name__}",
    )

# init_synthetic / verify_synthetic: the seed.
D = "seed"
for bad in (-1, "1", 1.5, True, None):
    case(
        D,
        f"init_synthetic({bad!r})",
        lambda e, bad=bad: e.policy.init_synthetic(bad),
        rf"seed must be a non-negative integer, got {re.escape(repr(bad))}",
    )
    case(
        D,
        f"verify_synthetic({bad!r})",
        lambda e, bad=bad: e.policy.verify_synthetic(bad),
        rf"seed must be a non-negative integer, got {re.escape(repr(bad))}",
    )
case(
    D,
    "init_synthetic of a shut-down group",
    lambda e: e.closed.init_synthetic(0),
    r"initialise weights: group 'inv-closed' was shut down",
)
case(
    D,
    "verify_synthetic of a shut-down group",
    lambda e: e.closed.verify_synthetic(0),
    r"verify weights: group 'inv-closed' was shut down",
)

# checkpoints: the manager's settings, save, load, HF import and export.
M = "checkpoint_manager"
case(
    M,
    "root ''",
    lambda e: e.policy.checkpoint_manager(root="", run_id="x"),
    r"root must be an absolute directory path .*got ''",
)
case(
    M,
    "root blank",
    lambda e: e.policy.checkpoint_manager(root="  ", run_id="x"),
    r"root must be an absolute directory path .*got '  '",
)
case(
    M,
    "relative root",
    lambda e: e.policy.checkpoint_manager(root="ckpt", run_id="x"),
    r"root must be an absolute directory path \(each worker resolves it on its own node\), got 'ckpt'",
)
case(
    M,
    "relative root Path",
    lambda e: e.policy.checkpoint_manager(root=Path("a") / "b", run_id="x"),
    r"root must be an absolute directory path .*got 'a/b'",
)
case(M, "root 3", lambda e: e.policy.checkpoint_manager(root=3, run_id="x"), r"root must be a path, got int")
for bad in ("a/b", "", 5, "-lead", "a b", "x" * 129):
    case(
        M,
        f"run_id {bad!r}"[:40],
        lambda e, bad=bad: e.policy.checkpoint_manager(root=str(e.tmp), run_id=bad),
        rf"run id {re.escape(repr(bad))} is invalid: use 1-128 letters, digits",
    )
for bad in (0, -2, True, 1.5):
    case(
        M,
        f"factor {bad!r}",
        lambda e, bad=bad: e.policy.checkpoint_manager(root=str(e.tmp), factor=bad),
        rf"replication factor must be a positive integer, got {re.escape(repr(bad))}",
    )
case(
    M,
    "factor that does not divide",
    lambda e: e.policy.checkpoint_manager(root=str(e.tmp), factor=3),
    r"world size 4 is not divisible by jump\*factor = 2\*3 = 6",
)
for bad in (0, -1, True, 2.0):
    case(
        M,
        f"jump {bad!r}",
        lambda e, bad=bad: e.policy.checkpoint_manager(root=str(e.tmp), jump=bad),
        rf"replication jump must be a positive integer, got {re.escape(repr(bad))}",
    )
case(
    M,
    "jump that does not divide",
    lambda e: e.policy.checkpoint_manager(root=str(e.tmp), jump=3),
    r"world size 4 is not divisible by jump\*factor = 3\*2 = 6",
)
for bad in (0, -5, "x", True, float("inf"), float("nan")):
    case(
        M,
        f"timeout_s {bad!r}",
        lambda e, bad=bad: e.policy.checkpoint_manager(root=str(e.tmp), timeout_s=bad),
        rf"timeout_s must be a finite positive number of seconds, got {re.escape(repr(bad))}",
    )

V = "save"
for bad in (-1, True, "1", 1.5, None, 2**63):
    case(
        V,
        f"save({bad!r})",
        lambda e, bad=bad: e.ckpt.save(bad),
        rf"iteration must be a non-negative integer.*got {re.escape(repr(bad))}",
    )
case(
    V,
    "save(1) again",
    lambda e: e.ckpt.save(1),
    r"iteration 1 is not after the last saved iteration 1; iterations of a run must increase",
)
case(V, "save(0) after 1", lambda e: e.ckpt.save(0), r"iteration 0 is not after the last saved iteration 1")
case(V, "is_async 'yes'", lambda e: e.ckpt.save(2, is_async="yes"), r"is_async must be True or False, got 'yes'")
case(V, "is_async 1", lambda e: e.ckpt.save(2, is_async=1), r"is_async must be True or False, got 1")
case(
    V,
    "fault of the wrong type",
    lambda e: e.ckpt.save(2, fault="crash"),
    r"fault must be a CheckpointFault for a rank below 4, got 'crash'",
)

L = "load"
for bad in (-1, "x", 2**63, True, 1.5):
    case(
        L,
        f"load({bad!r})",
        lambda e, bad=bad: e.ckpt.load(bad),
        rf"iteration must be a non-negative integer.*got {re.escape(repr(bad))}",
    )

H = "hf"
for bad in (0, -1, True, "1"):
    case(
        H,
        f"export_hf max_shard_bytes={bad!r}",
        lambda e, bad=bad: e.ckpt.export_hf(str(e.tmp / "out"), max_shard_bytes=bad),
        rf"max_shard_bytes must be a positive integer, got {re.escape(repr(bad))}",
    )
case(H, "export_hf path None", lambda e: e.ckpt.export_hf(None), r"HF export directory must be a path, got NoneType")
case(
    H,
    "export_hf path 3",
    lambda e: e.ckpt.export_hf(3, max_shard_bytes=1 << 20),
    r"HF export directory must be a path, got int",
)
case(
    H,
    "import_hf of a missing directory",
    lambda e: e.ckpt.import_hf(str(e.tmp / "nope")),
    r"HF checkpoint directory '.*/nope' does not exist",
)
case(
    H,
    "import_hf of a file",
    lambda e: e.ckpt.import_hf(str(e.mini_hf / "model.safetensors")),
    r"HF checkpoint directory '.*model\.safetensors' is not a directory",
)
case(
    H,
    "import_hf without safetensors",
    lambda e: e.ckpt.import_hf(e.empty),
    r"'.*/empty' has neither model\.safetensors nor model\.safetensors\.index\.json",
)
case(
    H,
    "import_hf of another model",
    lambda e: e.ckpt.import_hf(e.mini_hf),
    r"HF checkpoint does not fit model 'tiny': \d+ problems, e\.g\. .*has shape \(64, 32\), the model needs \(1001, 96\)",
)
case(
    H, "import_hf path None", lambda e: e.ckpt.import_hf(None), r"HF checkpoint directory must be a path, got NoneType"
)
case(
    H,
    "import_hf path a list",
    lambda e: e.ckpt.import_hf([str(e.mini_hf)]),
    r"HF checkpoint directory must be a path, got list",
)

# plans: malformed plan JSON and plans that name workers outside the group (pure).
P = "plan"
case(P, "from_json of a list", lambda e: Plan.from_json([]), r"a plan is a JSON object, got list")
case(P, "unknown format", plan_json(_set("format", 2)), r"plan format 2 is not supported \(expected 1\)")
case(P, "missing keys", plan_json(lambda d: d.pop("steps")), r"plan JSON lacks \['steps'\]")
case(
    P,
    "segment of unknown dtype",
    plan_json(lambda d: d["segments"][0].__setitem__(3, "float8")),
    r"plan segment 0 \('.*'\) has dtype 'float8', not one of \['bfloat16'",
)
case(P, "segment of three fields", plan_json(lambda d: d["segments"][0].pop()), r"malformed plan JSON: ")
case(
    P,
    "segment with a negative offset",
    plan_json(lambda d: d["segments"][0].__setitem__(1, [-1] * len(d["segments"][0][1]))),
    r"plan segment 0 \('.*'\) has an invalid box offsets=\(-1",
)
case(
    P,
    "segment list naming a missing segment",
    plan_json(lambda d: d["segment_lists"][0].append(10**6)),
    r"a segment list names a segment that does not exist",
)
case(
    P,
    "route naming a missing segment list",
    plan_json(_route(0, [0, 1, 10**6])),
    r"malformed plan: a route names a segment list that does not exist",
)
case(
    P,
    "a worker sends twice in one step",
    plan_json(_route(0, [0, 1, 0], [0, 2, 0])),
    r"plan step 0: worker\(s\) \[0\] send more than once",
)
case(
    P,
    "a worker receives twice in one step",
    plan_json(_route(0, [0, 1, 0], [2, 1, 0])),
    r"plan step 0: worker\(s\) \[1\] receive more than once",
)
case(
    P,
    "worker -1",
    plan_json(_route(0, [-1, 1, 0])),
    r"plan names worker\(s\) \['-1'\] that do not exist \(worker ids are integers from 0\)",
)
case(P, "worker as a string", plan_json(_route(0, ["0", 1, 0])), r"plan names worker\(s\) \['0'\] that do not exist")
case(
    P,
    "bucket_bytes 0",
    plan_json(_set("bucket_bytes", 0)),
    r"plan bucket_bytes must be an integer of at least 16, got 0",
)
case(P, "forward_from beyond the steps", plan_json(_set("forward_from", 99)), r"plan forward_from 99 is outside 0\.\.")
case(
    P,
    "validate(num_workers=4) on worker 7",
    plan_validate(4, lambda p: p.steps.append([p.steps[0][0]._replace(dst=7)])),
    r"plan names worker\(s\) \['7'\] that do not exist \(worker ids are integers from 0 and below 4\)",
)
case(
    P,
    "validate(num_workers=2) on a local copy by worker 2",
    plan_validate(2, lambda p: p.local_copies.append((2, 0))),
    r"plan names worker\(s\) \['2'\]",
)

# layouts and topologies (pure).
T = "layout"
case(
    T,
    "Layout vocab_pad_multiple=0",
    lambda e: Layout(TINY, Topology(tp=2), vocab_pad_multiple=0),
    r"vocab_pad_multiple must be a positive integer, got 0",
)
case(
    T,
    "Layout vocab_pad_multiple='8'",
    lambda e: Layout(TINY, Topology(tp=2), vocab_pad_multiple="8"),
    r"vocab_pad_multiple must be a positive integer, got '8'",
)
case(
    T, "Layout of a preset name", lambda e: Layout("tiny", Topology()), r"a layout needs a realloc\.ModelSpec, got str"
)
case(T, "Layout of a topology string", lambda e: Layout(TINY, "dp=2"), r"a layout needs a realloc\.Topology, got str")
case(
    T,
    "parse pp_split=foo",
    lambda e: Topology.parse("pp=2,pp_split=foo"),
    r"unknown pp_split 'foo'; allowed: vllm, megatron, balanced",
)
case(T, "parse bare pp_split=foo", lambda e: Topology.parse("pp_split=foo"), r"unknown pp_split 'foo'")
case(T, "parse a dimension twice", lambda e: Topology.parse("dp=2,dp=3"), r"topology 'dp=2,dp=3' gives dp twice")
case(
    T,
    "parse layer_split of words",
    lambda e: Topology.parse("pp=2,layer_split=a/b"),
    r"bad topology part 'layer_split=a/b'",
)
case(T, "Topology(dp=True)", lambda e: Topology(dp=True), r"topology dp must be a positive integer, got True")
case(T, "Topology(tp=2.0)", lambda e: Topology(tp=2.0), r"topology tp must be a positive integer, got 2\.0")
case(
    T,
    "layer_split of the wrong length",
    lambda e: Topology(pp=2, layer_split=(4,)),
    r"layer_split \(4,\) has 1 stages but pp=2",
)

# your worker class and your calls (the policy's worker class is the plain ShardWorker).
W = "worker class"
case(W, "worker_cls object", create(worker_cls=object), r"worker_cls must be a subclass of actors\.ShardWorker")
case(
    W,
    "worker_cls an instance",
    create(worker_cls=ShardWorker.__new__(ShardWorker)),
    r"worker_cls must be a subclass of actors\.ShardWorker",
)
case(
    W,
    "worker_cls redefining op_commit",
    create(worker_cls=type("Clash", (ShardWorker,), {"op_commit": lambda self: 0})),
    r"worker_cls Clash redefines methods the protocol relies on: \['op_commit'\]",
)
case(
    W,
    "call without a worker class",
    lambda e: e.policy.call("train"),
    r"'train' is not a method of worker class ShardWorker; callable: none",
)
case(W, "call a protocol method", lambda e: e.policy.call("op_commit", "x"), r"'op_commit' is not a method")
case(W, "call a private name", lambda e: e.policy.call("_drop_op"), r"'_drop_op' is not a method")
case(W, "call with a non-string name", lambda e: e.policy.call(len), r"is not a method of worker class")
case(W, "call on ranks out of range", lambda e: e.policy.call("run", ranks=[0, 9]), r"not a method|not ranks")
case(
    W,
    "export_hf config of another model",
    lambda e: e.ckpt.export_hf(e.tmp / "x", config=hf_config_of(MINI)),
    r"HF config does not describe model 'tiny'",
)
case(
    W,
    "export_hf config declaring a quantization the weights do not have",
    lambda e: e.ckpt.export_hf(
        e.tmp / "x", config={**hf_config_of(e.ckpt.group.spec), "quantization_config": {"quant_method": "fp8"}}
    ),
    r"declares a quantization_config .* writes the weights in the model's dtypes",
)


# timeouts and the fleet (issue 36): every timeout is a finite positive number of seconds.
T = "timeouts"
case(T, "Fleet(None)", lambda e: Fleet(None), r"replicas must be a ModelGroup or a sequence of ModelGroups, got None")
case(T, "Fleet of a string", lambda e: Fleet("inv-ref"), r"replicas must be a ModelGroup or a sequence of")
case(
    T,
    "Fleet timeout_s as a string",
    lambda e: Fleet([e.ref], timeout_s="10"),
    r"timeout_s must be a finite positive number of seconds, got '10'",
)
case(
    T,
    "Fleet timeout_s infinite",
    lambda e: Fleet([e.ref], timeout_s=float("inf")),
    r"timeout_s must be a finite positive number of seconds, got inf",
)
case(T, "Fleet timeout_s 0", lambda e: Fleet([e.ref], timeout_s=0), r"timeout_s must be a finite positive number")
case(
    T,
    "last_trace timeout_s as a string",
    lambda e: e.policy.last_trace(timeout_s="5"),
    r"timeout_s must be a finite positive number of seconds, got '5'",
)
case(
    T,
    "last_trace timeout_s infinite",
    lambda e: e.policy.last_trace(timeout_s=float("inf")),
    r"timeout_s must be a finite positive number of seconds, got inf",
)


# -- the tests -------------------------------------------------------------------------------------


def _live_placement_groups() -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def _named_actors() -> set[str]:
    return set(ray.util.list_named_actors())


def test_table_is_large_and_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    assert len(CASES) >= 110, len(CASES)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_invalid_input_is_refused_before_any_traffic(env, c: Case):
    policy = env.policy
    layout, activity = policy.layout, policy.activity()
    pgs, actors = _live_placement_groups(), _named_actors()
    started, result = time.monotonic(), None
    try:
        with pytest.raises(c.error, match=c.match) as info:
            result = c.call(env)
    finally:
        if isinstance(result, ModelGroup):  # a create that should have failed: do not leak its workers
            result.shutdown()
    elapsed = time.monotonic() - started
    # the project's own error types only: a bare TypeError/KeyError/... is a validation gap
    assert type(info.value) in (ValueError, ReallocationError, CheckpointError) or issubclass(
        type(info.value), (ReallocationError, CheckpointError)
    ), type(info.value)
    assert elapsed < FAST_S, f"took {elapsed:.1f}s to refuse"
    assert policy.layout is layout
    assert policy.activity() == activity, "a worker started an operation step"
    assert _live_placement_groups() == pgs, "a placement group was left behind"
    assert _named_actors() == actors, "actors were started or lost"


def test_group_is_still_usable(env):
    """Runs last: the weights survived the whole table, and every operation still works."""
    policy, ref = env.policy, env.ref
    assert policy.layout == Layout(TINY, TRAIN)
    assert policy.verify_synthetic(SEED) == {}
    before = policy.activity()
    policy.reallocate(Topology(tp=4))
    assert policy.topology == Topology(tp=4)
    # the table's "no traffic" check can fail: a real operation moves every worker's counters
    assert all(
        a["prepare"] == b["prepare"] + 1 and a["commit"] == b["commit"] + 1 for a, b in zip(policy.activity(), before)
    )
    assert policy.verify_synthetic(SEED) == {}
    policy.copy_to(ref)
    assert ref.verify_synthetic(SEED) == {}
    # the checkpoint manager survived the refused saves and loads: save in tp=4, overwrite the
    # weights, go back to the training layout and load (a resharding load)
    assert env.ckpt.save(2).wait().iteration == 2
    policy.init_synthetic(SEED + 1)
    policy.reallocate(TRAIN, src=Topology(tp=4))
    assert policy.verify_synthetic(SEED) != {}
    assert env.ckpt.load(2).method == "reshard"
    assert policy.layout == Layout(TINY, TRAIN)
    assert policy.verify_synthetic(SEED) == {}
