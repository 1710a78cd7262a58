"""DTensor interop against torch itself: FSDP2 (``fully_shard``) and FSDP2 + tensor parallelism
(torchtitan's composition: ``parallelize_module`` on the tp mesh, then ``fully_shard`` on the
dp_shard mesh) on 4 CPU processes over gloo. The local tensors torch holds must be exactly the
boxes of the fsdp layout (``realloc.shards.dtensor.check_boxes``), uneven and empty chunks included,
and the copies in and out must be exact."""

from __future__ import annotations

import traceback

import processes
import pytest
import torch

from realloc import Layout, ModelSpec, ParamSpec
from realloc.shards import ShardStore, allocate_buffers
from realloc.shards.dtensor import check_boxes, local_box, mesh_topology, read_local, write_local

SPEC = ModelSpec(
    "mlp",
    (
        ParamSpec("mlp.up_proj.weight", (10, 6), "float32", "layer", layer=0, tp_dim=0),
        ParamSpec("mlp.down_proj.weight", (6, 10), "float32", "layer", layer=0, tp_dim=1),
        ParamSpec("norm.weight", (3,), "float32", "final"),
    ),
    num_layers=1,
)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.up_proj = torch.nn.Linear(6, 10, bias=False)
        self.mlp.down_proj = torch.nn.Linear(10, 6, bias=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(3))


def _worker(rank: int, world: int, port: int, tp: int, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch.set_num_threads(1)
        processes.init_group(port, rank, world)
        torch.manual_seed(0)
        model = MLP()
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if tp > 1:
            mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
            parallelize_module(model.mlp, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp_shard"])
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            fully_shard(model, mesh=mesh)
        layout = Layout(SPEC, mesh_topology(mesh))
        me = layout.at(rank)
        state = model.state_dict()
        check_boxes(me, state)  # torch's boxes are the layout's
        store = ShardStore(me.shards(), allocate_buffers(layout, rank))
        views = {s.slot: store.view(s.param, s.offsets, s.sizes) for s in me.shards()}
        read_local(views, me, state)
        for s in me.shards():  # what arrived is the global tensor's box
            index = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
            assert torch.equal(views[s.slot], full[s.param][index]), s
        for v in views.values():
            v.mul_(2)
        write_local(state, me, views)
        after = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(after[k], 2 * full[k]) for k in full)
        queue.put((rank, "ok", {k: local_box(v) for k, v in state.items()}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


def spawn_workers(worker, world: int, *args, timeout: float = 90) -> dict:
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes (a gloo
    group on a free port); rank -> what each put on the queue after ``(rank, "ok", ...)``."""
    store = processes.host_store()  # the group's rendezvous, on a port no one else can take
    port = store.port
    ctx = processes.context()  # a fork server's children, not fork (tests/processes.py)
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            assert status == "ok", f"rank {rank}:\n{status}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return results


def run(world: int, tp: int) -> dict:
    return spawn_workers(_worker, world, tp)


def test_fsdp2_boxes_are_the_fsdp_layout():
    boxes = run(4, tp=1)
    assert boxes[3]["mlp.down_proj.weight"] == ((6, 0), (0, 10))  # 6 rows over 4: 2, 2, 2, 0 (empty)
    assert boxes[3]["norm.weight"] == ((3,), (0,))


def test_fsdp2_with_tensor_parallel_boxes_are_the_fsdp_tp_layout():
    boxes = run(4, tp=2)  # up_proj: tp rows 5 each, fsdp chunks 3 + 2 inside them (_StridedShard)
    assert boxes[1]["mlp.up_proj.weight"] == ((5, 0), (3, 6))
    assert boxes[3]["mlp.up_proj.weight"] == ((8, 0), (2, 6))


def test_mesh_without_names_is_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="needs dimension names"):
        mesh_topology(SimpleNamespace(mesh_dim_names=None, shape=(2, 2)))
    with pytest.raises(ValueError, match="mesh dimension 'cp'"):
        mesh_topology(SimpleNamespace(mesh_dim_names=("cp",), shape=(2,)))
