"""FSDP2 in the workers: torch's ``fully_shard`` trains a real Llama on CPU/gloo in the workers'
own default process group; its DTensor shards are the source of a reallocation to a
tensor-parallel generation layout (bit-exact against FSDP2's own full tensors) and receive the
weights back, after which FSDP2 trains on. Real Ray actors, two simulated nodes.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from simulated import simulated_cluster

from actors import ModelGroup, ShardWorker
from realloc.shards.dtensor import mesh_topology, read_local, write_local

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(llama)

pytestmark = pytest.mark.slow

CONFIG = llama.LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2
)


class FSDPWorker(ShardWorker):
    """The user's trainer: FSDP2 over its own default group; weights handed to and from the shards."""

    def host_default_store(self) -> int:
        """Rank 0 hosts the default group's store on a port the OS picks (a port chosen by the
        driver and bound later can be taken in between: EADDRINUSE)."""
        self.default_store = dist.TCPStore(
            "127.0.0.1", 0, self.context().topology.world_size, is_master=True, wait_for_workers=False
        )
        return self.default_store.port

    def setup(self, config: dict, port: int, init: dict) -> str:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        n = self.context().topology.world_size
        store = self.default_store if self.rank == 0 else dist.TCPStore("127.0.0.1", port, n, is_master=False)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=n)
        self.mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp_shard",))
        self.model = llama.Llama(llama.LlamaConfig(**config))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(init[name])
        for layer in self.model.model.layers.values():
            fully_shard(layer, mesh=self.mesh)
        fully_shard(self.model, mesh=self.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        return str(mesh_topology(self.mesh))

    def train(self, tokens: torch.Tensor) -> float:
        mine = tokens.chunk(self.context().topology.world_size)[self.rank]
        return llama.train_step(self.model, self.optimizer, mine)  # FSDP2 reduce-scatters the gradients

    def to_shards(self) -> int:
        ctx = self.context()
        return read_local(ctx.views(), ctx.rank_layout, self.model.state_dict())

    def from_shards(self) -> int:
        ctx = self.context()
        return write_local(self.model.state_dict(), ctx.rank_layout, ctx.views())

    def full_tensors(self) -> dict:
        return {n: p.full_tensor() for n, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=2) as c:
        yield c


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp2_shards_reallocate_to_tp_and_back(cluster):
    spec = CONFIG.spec()
    g = torch.Generator().manual_seed(0)
    init = {
        p.name: (torch.ones(p.shape) if p.name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02)
        for p in spec.params
    }
    group = ModelGroup.create(spec, "fsdp=4", name="fsdp2", worker_cls=FSDPWorker, timeout_s=120)
    try:
        [port] = group.call("host_default_store", ranks=[0])
        assert group.call("setup", asdict(CONFIG), port, init) == [str(group.topology)] * 4
        tokens = torch.randint(0, CONFIG.vocab_size, (8, 12), generator=g)
        group.call("train", tokens)
        fsdp_full = group.call("full_tensors")[0]
        group.call("to_shards")  # the DTensor local tensors are exactly the layout's boxes (checked)
        assert same(fsdp_full, group.state_dict())
        group.reallocate("dp=2,tp=2")
        assert same(fsdp_full, group.state_dict())
        group.reallocate("fsdp=4", src="dp=2,tp=2")
        group.call("from_shards")
        assert same(fsdp_full, group.call("full_tensors")[1])
        losses = group.call("train", tokens)  # FSDP2 trains on from the weights that came back
        assert all(torch.isfinite(torch.tensor(x)) for x in losses)
    finally:
        group.shutdown()
