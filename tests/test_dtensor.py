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


def _start(rank: int, world: int, port: int, cls) -> tuple[torch.nn.Module, dict]:
    """Join the gloo group; a ``cls`` model (seed 0) and a copy of its full tensors."""
    torch.set_num_threads(1)
    processes.init_group(port, rank, world)
    torch.manual_seed(0)
    model = cls()
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank: int, world: int, port: int, tp: int, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model, full = _start(rank, world, port, MLP)
        if tp > 1:
            mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
            parallelize_module(model.mlp, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp_shard"])
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            fully_shard(model, mesh=mesh)
        layout = Layout(SPEC, mesh_topology(mesh))
        state = _round_trip(model, full, layout, rank)
        queue.put((rank, "ok", {k: local_box(v) for k, v in state.items()}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


def _dp_named_worker(rank: int, world: int, port: int, queue) -> None:
    """``fully_shard`` over a 1-D mesh its user named ``("dp",)`` (common in user code), read
    through ``ShardSource`` as a trainer rank reads it."""
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from actors.trainer import ShardSource

        model, full = _start(rank, world, port, MLP)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
        held = ShardSource(model, spec=SPEC).holdings()
        state = _round_trip(model, full, held.layout, held.rank)
        queue.put((rank, "ok", (str(held.layout.topology), held.rank, {k: local_box(v) for k, v in state.items()})))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


def _round_trip(model: torch.nn.Module, full: dict, layout: Layout, rank: int) -> dict:
    """The model's state dict after: its boxes checked against ``rank``'s in ``layout``, its local
    tensors read into the rank's views (each exactly the global tensor's box), the views doubled
    and written back (every full tensor then exactly doubled)."""
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
    return state


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


def test_fsdp2_over_a_mesh_named_dp_is_read_as_fsdp():
    """A mesh named ``("dp",)`` was read as replicated data parallelism whatever the tensors'
    placements, so ``fully_shard`` over it (a common user setup) was refused as "another rank
    order or sharding rule" (found in review, 2026-12-08). The placements say: sharded over it,
    it is fsdp."""
    got = spawn_workers(_dp_named_worker, 4)
    assert {r: got[r][:2] for r in got} == {r: ("dp=1,fsdp=4,tp=1,pp=1", r) for r in range(4)}
    assert got[3][2]["mlp.down_proj.weight"] == ((6, 0), (0, 10))


#: Every case's parameters: ``tiny`` (2 rows) leaves an fsdp rank of each tp shard an empty
#: chunk under tp=2 (``_StridedShard``: 1 row per tp rank, chunks 1 and none); ``lm_head``, a
#: vocabulary of 19 rows, is split unevenly by tp=2 (10 and 9 rows, torch.chunk as DTensor's
#: ``Shard(0)``), and then by fsdp=3 its chunks are not those torch's
#: ``compute_local_shape_and_global_offset`` gives for ``_StridedShard`` (see
#: ``realloc.shards.dtensor._strided_boxes``)
MESH_SPEC = ModelSpec(
    "mlp",
    SPEC.params[:2]
    + (
        ParamSpec("mlp.tiny.weight", (2, 3), "float32", "layer", layer=0, tp_dim=0),
        SPEC.params[2],
        ParamSpec("lm_head.weight", (19, 6), "float32", "head", tp_dim=0, pad_to_tp=True),
    ),
    num_layers=1,
)


class TinyMLP(MLP):
    def __init__(self):
        super().__init__()
        self.mlp.tiny = torch.nn.Linear(3, 2, bias=False)
        self.lm_head = torch.nn.Linear(6, 19, bias=False)


def _mesh_worker(rank: int, world: int, port: int, case: str, queue) -> None:
    """One of the meshes ``fully_shard`` builds its DTensors on: HSDP (a 2-D ``(dp_replicate,
    dp_shard)`` mesh), and torchtitan's default ``spmd_backend="spmd_types"`` (torchtitan/distributed/
    fsdp.py ``resolve_fsdp_mesh``): every parameter first a DTensor on the whole storage mesh
    (Replicate on the data-parallel dims), then ``fully_shard(mesh=storage, dp_mesh_dims=...)``,
    which shards on the named dims in place (torch's ``FSDPParam._init_sharding_spec_spmd``:
    ``_StridedShard(0, split_factor=tp)`` where tp shards dim 0) and flattens ``dp_shard`` x ``cp``
    into one ``dp_shard_cp`` dim (``_get_mesh_info_from_named_dims``)."""
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        model, full = _start(rank, world, port, TinyMLP)
        names = {
            "hsdp": ("dp_replicate", "dp_shard"),
            "spmd_tp": ("dp_shard", "tp"),
            "spmd_tp3": ("dp_shard", "tp"),
            "spmd_hsdp": ("dp_replicate", "dp_shard"),
            "spmd_cp": ("dp_shard", "cp"),
        }[case]
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=names)
        if case == "hsdp":
            fully_shard(model, mesh=mesh)
        else:
            tp = {"mlp.up_proj.weight": Shard(0), "mlp.down_proj.weight": Shard(1), "mlp.tiny.weight": Shard(0)}
            tp["lm_head.weight"] = Shard(0)
            for name, p in list(model.named_parameters()):
                owner, attr = name.rsplit(".", 1)
                last = tp.get(name, Replicate()) if case.startswith("spmd_tp") else Replicate()
                dt = distribute_tensor(p.detach(), mesh, [Replicate(), last])
                setattr(model.get_submodule(owner), attr, torch.nn.Parameter(dt))
            dims = {
                "spmd_tp": DataParallelMeshDims(shard="dp_shard"),
                "spmd_tp3": DataParallelMeshDims(shard="dp_shard"),
                "spmd_hsdp": DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
                "spmd_cp": DataParallelMeshDims(shard=("dp_shard", "cp")),
            }[case]
            fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        state = model.state_dict()
        meshes = {tuple(v.device_mesh.mesh_dim_names) for v in state.values()}
        for name, v in state.items():  # torch's box is what the local tensor holds
            offsets, sizes = local_box(v)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            assert torch.equal(v.to_local(), full[name][index]), (name, offsets, sizes)
        layout = Layout(MESH_SPEC, mesh_topology(state["mlp.up_proj.weight"].device_mesh))
        _round_trip(model, full, layout, rank)  # every mesh here is the world in rank order
        if case == "spmd_tp":  # a local tensor that is not what its placements give is refused
            from torch.distributed.tensor import DTensor

            odd = DTensor.from_local(
                torch.zeros(1, 3), mesh, [Shard(0), Replicate()], run_check=False, shape=(8, 3), stride=(3, 1)
            )
            with pytest.raises(ValueError, match=r"holds a local tensor of shape \(1, 3\), not the \(4, 3\)"):
                local_box(odd)
        boxes = {k: local_box(v) for k, v in state.items()}
        queue.put((rank, "ok", (str(layout.topology), sorted(meshes), boxes)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


@pytest.mark.parametrize(
    "case, topology, mesh",
    [
        ("hsdp", "dp=2,fsdp=2,tp=1,pp=1", ("dp_replicate", "dp_shard")),
        ("spmd_tp", "dp=1,fsdp=2,tp=2,pp=1", ("dp_shard", "tp")),
        ("spmd_hsdp", "dp=2,fsdp=2,tp=1,pp=1", ("dp_replicate", "dp_shard")),
        ("spmd_cp", "dp=1,fsdp=4,tp=1,pp=1", ("dp_shard_cp",)),  # cp folded into fsdp, as torchtitan does
        ("spmd_tp3", "dp=1,fsdp=3,tp=2,pp=1", ("dp_shard", "tp")),  # 6 processes
    ],
)
def test_hsdp_and_torchtitans_spmd_meshes_are_the_layout(case, topology, mesh):
    world = 6 if case == "spmd_tp3" else 4
    out = spawn_workers(_mesh_worker, world, case, timeout=180)
    assert {r: out[r][0] for r in out} == {r: topology for r in range(world)}
    assert out[0][1] == [mesh]  # torchtitan's spmd path: every parameter on the one mesh
    if case == "spmd_tp":  # tp rank 0's 1 row of tiny: fsdp rank 0 holds it, fsdp rank 1 (rank 2) nothing
        assert out[0][2]["mlp.tiny.weight"] == ((0, 0), (1, 3))
        assert out[2][2]["mlp.tiny.weight"][1] == (0, 3)
        assert out[3][2]["mlp.up_proj.weight"] == ((8, 0), (2, 6))  # tp rows 5-9, fsdp chunk 3 + 2
    if case == "spmd_tp3":  # lm_head: tp rows 0-9 chunked 4, 4, 2; rows 10-18 chunked 3, 3, 3
        assert out[4][2]["lm_head.weight"] == ((8, 0), (2, 6))  # torch's own rule: rows 8, 9, 16
        assert out[5][2]["lm_head.weight"] == ((16, 0), (3, 6))  # torch's own rule: rows 17-18
    if case in ("hsdp", "spmd_hsdp"):  # replica 1 holds replica 0's shards
        assert out[2][2] == out[0][2] and out[3][2] == out[1][2]


def test_mesh_without_names_is_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="needs dimension names"):
        mesh_topology(SimpleNamespace(mesh_dim_names=None, shape=(2, 2)))
    with pytest.raises(ValueError, match="mesh dimension 'cp'"):
        mesh_topology(SimpleNamespace(mesh_dim_names=("cp",), shape=(2,)))
    # "dp" is replicated unless the tensors are sharded over it; two dimensions of one role are refused
    from torch.distributed.tensor import Replicate, Shard

    named = SimpleNamespace(mesh_dim_names=("dp", "tp"), shape=(2, 4))
    assert str(mesh_topology(named, [(Replicate(), Shard(0))])) == "dp=2,tp=4,pp=1"
    assert str(mesh_topology(named, [(Shard(0), Shard(0)), (Shard(0), Replicate())])) == "dp=1,fsdp=2,tp=4,pp=1"
    with pytest.raises(ValueError, match="mesh dimensions 'dp' and 'fsdp' are both fsdp"):
        mesh_topology(SimpleNamespace(mesh_dim_names=("dp", "fsdp"), shape=(2, 2)), [(Shard(0), Shard(0))])
