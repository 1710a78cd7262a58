"""torchtitan's EP + FSDP composition replayed with torch itself (torchtitan is not installed
here): its ``GroupedExperts`` stacks (``w1_EFD``/``w3_EFD`` ``[E, F, D]``, ``w2_EDF`` ``[E, D, F]``)
distributed ``Shard(0)`` over the ``ep`` dimension of the sparse mesh ``(efsdp, ep)``
(torchtitan/distributed/parallel_dims.py, moe_sharding.py), then ``fully_shard`` over ``efsdp`` with
torchtitan's ``shard_placement_fn`` (``Shard(0)``, or ``Shard(1)`` when ``efsdp * ep > E``:
torchtitan/distributed/fsdp.py); the router ``fully_shard`` over the dense fsdp mesh. On 4 gloo
processes the local tensors torch holds equal the ``expert_order="torchtitan"`` layout's views, under
both of torchtitan's ``spmd_backend``s: ``"partial_dtensor"`` (the calls above) and its default
``"spmd_types"`` (every parameter a DTensor on the whole storage mesh, ``(dp_replicate, efsdp, ep)``
or ``(dp_replicate, dp_shard, tp)``, then ``fully_shard(mesh=..., dp_mesh_dims=...)``:
``resolve_sparse_fsdp_mesh`` / ``resolve_fsdp_mesh`` in torchtitan/distributed/fsdp.py), HSDP included.
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


def _worker(rank: int, world: int, port: int, topology: str, experts: int, backend: str, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from realloc import Layout, Topology
        from realloc.shards import ShardStore, allocate_buffers, fused_views

        torch.set_num_threads(1)
        processes.init_group(port, rank, world)
        t = Topology.parse(topology)
        m = model(experts)
        full = oracle.moe_full_tensors(m, seed=7)
        efsdp = t.fsdp * t.tp // t.ep
        # torchtitan's sparse mesh: the world unflattened as (dp_replicate, efsdp, ep), ep fastest;
        # dense: (dp_replicate, fsdp, tp) (partial_dtensor), (dp_replicate, dp_shard, tp) (spmd_types)
        spmd = backend == "spmd_types"
        sparse = init_device_mesh("cpu", (t.dp, efsdp, t.ep), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        dense = init_device_mesh(
            "cpu", (t.dp, t.fsdp, t.tp), mesh_dim_names=("dp_replicate", "dp_shard" if spmd else "fsdp", "tp")
        )
        layer = m.dense_layers
        pre = f"model.layers.{layer}.mlp."
        experts_module, router = torch.nn.Module(), torch.nn.Module()
        for name, proj in (("w1_EFD", "gate_proj"), ("w2_EDF", "down_proj"), ("w3_EFD", "up_proj")):
            stack = torch.stack([full[f"{pre}experts.{e}.{proj}.weight"] for e in range(experts)])
            if spmd:  # expert_param_placement_sparse: R on dp_replicate and efsdp, Shard(0) on ep
                param = distribute_tensor(stack, sparse, [Replicate(), Replicate(), Shard(0)])
            else:
                param = distribute_tensor(stack, sparse["ep"], [Shard(0)])  # ExpertParallel's Shard(0)
            setattr(experts_module, name, torch.nn.Parameter(param))
        gate = full[pre + "gate.weight"].clone()
        router.weight = torch.nn.Parameter(distribute_tensor(gate, dense, [Replicate()] * 3) if spmd else gate)
        placement = Shard(1) if efsdp * t.ep > experts else Shard(0)
        replicate = "dp_replicate" if t.dp > 1 else None
        if spmd:  # torchtitan/distributed/fsdp.py: resolve_sparse_fsdp_mesh / resolve_fsdp_mesh
            fully_shard(
                experts_module,
                mesh=sparse,
                dp_mesh_dims=DataParallelMeshDims(shard="efsdp", replicate=replicate),
                shard_placement_fn=lambda p: placement,
            )
            fully_shard(router, mesh=dense, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard", replicate=replicate))
        else:
            edp, dp = (["dp_replicate", "efsdp"], ["dp_replicate", "fsdp"]) if t.dp > 1 else (["efsdp"], ["fsdp"])
            fully_shard(experts_module, mesh=sparse[tuple(edp)], shard_placement_fn=lambda p: placement)
            fully_shard(router, mesh=dense[tuple(dp)])  # replicated over tp, sharded over fsdp
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
    "topology, experts, w1, backend",
    [
        ("dp=1,fsdp=4,ep=2,etp=1", 4, (1, 6, 4), "partial_dtensor"),  # efsdp 2: 2 x 2 <= 4, Shard(0): 1 expert of 2
        ("dp=1,fsdp=4,ep=2,etp=1", 2, (1, 3, 4), "partial_dtensor"),  # 2 x 2 > 2, Shard(1): 3 of 6 rows of its expert
        ("dp=1,fsdp=2,tp=2,ep=2,etp=1", 6, (2, 6, 4), "partial_dtensor"),  # EP borrows tp ranks: 3 experts, 2 and 1
        # torchtitan's default backend (spmd_types): DTensors on the whole storage meshes, fully_shard
        # with dp_mesh_dims (efsdp: _StridedShard(0, split_factor=ep) over ep's Shard(0), same chunks)
        ("dp=1,fsdp=4,ep=2,etp=1", 2, (1, 3, 4), "spmd_types"),
        ("dp=1,fsdp=2,tp=2,ep=2,etp=1", 6, (2, 6, 4), "spmd_types"),
        ("dp=2,fsdp=2,ep=2,etp=1", 2, (1, 6, 4), "spmd_types"),  # HSDP: dp_replicate the slowest dim of both
    ],
)
def test_torchs_local_tensors_are_the_torchtitan_layout(topology, experts, w1, backend):
    shapes = spawn_workers(_worker, 4, topology, experts, backend, timeout=180)
    assert shapes[0]["layers.1.moe.routed_experts.inner_experts.w1_EFD"] == w1
    if topology.startswith("dp=2"):  # replica 1 holds replica 0's experts
        assert shapes[2] == shapes[0] and shapes[3] == shapes[1]
