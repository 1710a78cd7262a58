"""torchtitan's EP + FSDP composition replayed with torch itself (torchtitan is not installed
here): its ``GroupedExperts`` stacks (``w1_EFD``/``w3_EFD`` ``[E, F, D]``, ``w2_EDF`` ``[E, D, F]``)
distributed ``Shard(0)`` over the ``ep`` dimension of the sparse mesh ``(efsdp, ep)``
(torchtitan/distributed/parallel_dims.py, moe_sharding.py), then ``fully_shard`` over ``efsdp`` with
torchtitan's ``shard_placement_fn`` (``Shard(0)``, or ``Shard(1)`` when ``efsdp * ep > E``:
torchtitan/distributed/fsdp.py); the router ``fully_shard`` over the dense fsdp mesh. On 4 gloo
processes the local tensors torch holds equal the ``expert_order="torchtitan"`` layout's views.
"""

from __future__ import annotations

import traceback

import oracle
import processes
import pytest
import torch
from test_dtensor import spawn_workers


def model(experts: int) -> oracle.MoeDecoder:
    return oracle.MoeDecoder(
        hidden=4,
        intermediate=8,
        layers=2,
        heads=2,
        kv_heads=1,
        head_dim=2,
        vocab=11,
        dtype="float32",
        norm_dtype="float32",
        experts=experts,
        moe_inter=6,
        shared_inter=4,
        dense_layers=1,
    )


def _worker(rank: int, world: int, port: int, topology: str, experts: int, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        from realloc import Layout, Topology
        from realloc.shards import ShardStore, allocate_buffers, fused_views

        torch.set_num_threads(1)
        processes.init_group(port, rank, world)
        t = Topology.parse(topology)
        m = model(experts)
        full = oracle.moe_full_tensors(m, seed=7)
        efsdp = t.fsdp * t.tp // t.ep
        # torchtitan's sparse mesh: the world unflattened as (efsdp, ep), ep fastest; dense: (fsdp, tp)
        sparse = init_device_mesh("cpu", (efsdp, t.ep), mesh_dim_names=("efsdp", "ep"))
        dense = init_device_mesh("cpu", (t.fsdp, t.tp), mesh_dim_names=("fsdp", "tp"))
        layer = m.dense_layers
        pre = f"model.layers.{layer}.mlp."
        experts_module, router = torch.nn.Module(), torch.nn.Module()
        for name, proj in (("w1_EFD", "gate_proj"), ("w2_EDF", "down_proj"), ("w3_EFD", "up_proj")):
            stack = torch.stack([full[f"{pre}experts.{e}.{proj}.weight"] for e in range(experts)])
            param = distribute_tensor(stack, sparse["ep"], [Shard(0)])  # ExpertParallel's Shard(0)
            setattr(experts_module, name, torch.nn.Parameter(param))
        router.weight = torch.nn.Parameter(full[pre + "gate.weight"].clone())
        placement = Shard(1) if efsdp * t.ep > experts else Shard(0)
        fully_shard(experts_module, mesh=sparse["efsdp"], shard_placement_fn=lambda p: placement)
        fully_shard(router, mesh=dense["fsdp"])  # replicated over tp, sharded over fsdp
        held = {
            f"layers.{layer}.moe.routed_experts.inner_experts.{n}": p.to_local()
            for n, p in experts_module.named_parameters()
        }
        held[pre + "gate.weight"] = router.weight.to_local()

        layout = Layout(m.spec(), t, expert_order="torchtitan")
        store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
        for s in layout.shards(rank):
            box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
            store.write(s.param, s.offsets, s.sizes, full[s.param][box])
        views = fused_views(layout.at(rank), store.buffers)
        for name, local in held.items():
            assert views[name].shape == local.shape, (name, views[name].shape, local.shape)
            assert torch.equal(views[name], local), f"rank {rank}: {name} differs from torch's local tensor"
        queue.put((rank, "ok", {k: tuple(v.shape) for k, v in held.items()}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


@pytest.mark.parametrize(
    "topology, experts, w1",
    [
        ("dp=1,fsdp=4,ep=2,etp=1", 4, (1, 6, 4)),  # efsdp 2: 2 x 2 <= 4, Shard(0): 1 expert of 2
        ("dp=1,fsdp=4,ep=2,etp=1", 2, (1, 3, 4)),  # 2 x 2 > 2, Shard(1): 3 of 6 rows of its expert
        ("dp=1,fsdp=2,tp=2,ep=2,etp=1", 6, (2, 6, 4)),  # EP borrows the tp ranks: 3 experts, 2 and 1
    ],
)
def test_torchs_local_tensors_are_the_torchtitan_layout(topology, experts, w1):
    shapes = spawn_workers(_worker, 4, topology, experts, timeout=180)
    assert shapes[0]["layers.1.moe.routed_experts.inner_experts.w1_EFD"] == w1
