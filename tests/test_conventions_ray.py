"""Engine conventions through the Ray layer: a group created with vLLM's vocabulary rule and
Megatron's q/k/v order keeps them as one layout value across reallocations and copies, and its
workers see Megatron's fused tensors (tests/test_conventions.py checks the values in-process)."""

from __future__ import annotations

import sys

import pytest
import ray
from simulated import simulated_cluster

from actors import ModelGroup, ShardWorker
from realloc import Layout, ModelSpec, Topology

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

pytestmark = pytest.mark.slow

TINY = ModelSpec.preset("tiny")  # 12 heads, 2 kv heads (query groups), tied embedding, vocab 1001


class FusedWorker(ShardWorker):
    def fused_shapes(self, convention: str) -> dict:
        views = self.context().fused_views(convention)
        return {name: tuple(t.shape) for name, t in views.items() if "layers.0." in name and "linear" in name}


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=4, cpus_per_node=2) as c:
        yield c


def test_group_keeps_its_conventions_across_reallocations_and_copies(cluster):
    group = ModelGroup.create(
        TINY,
        Topology.parse("dp=2,pp=2"),
        name="conv",
        vocab_pad_multiple=64,
        vocab_pad_rule="vllm",
        qkv_order="megatron",
        worker_cls=FusedWorker,
        timeout_s=30,
    )
    plain = ModelGroup.create(TINY, Topology.parse("tp=2,pp=2"), name="plain", timeout_s=30)
    try:
        group.init_synthetic(1)
        assert group.layout == Layout(TINY, Topology(dp=2, pp=2), 64, "vllm", "megatron")
        # one rank holds both query groups: linear_qkv is (2 * (6 + 2) * 8, 96), fc1 [gate; up]
        assert group.call("fused_shapes", "megatron", ranks=[0])[0] == {
            "model.layers.0.self_attention.linear_qkv.weight": (128, 96),
            "model.layers.0.mlp.linear_fc1.weight": (384, 96),
        }
        group.reallocate(Topology(tp=2, pp=2))
        assert group.verify_synthetic(1) == {}
        assert group.layout.options == {
            "vocab_pad_multiple": 64,
            "vocab_pad_rule": "vllm",
            "qkv_order": "megatron",
            "expert_order": "hf",
            "weight_format": None,
        }
        group.reallocate("dp=4")
        assert group.verify_synthetic(1) == {} and group.layout.qkv_order == "megatron"
        group.copy_to(plain)  # Megatron order, vLLM padding -> HF order, Megatron padding
        assert plain.verify_synthetic(1) == {}
        plain.init_synthetic(2)
        plain.copy_to(group)
        assert group.verify_synthetic(2) == {} and group.layout.vocab_pad_rule == "vllm"
    finally:
        group.shutdown()
        plain.shutdown()
