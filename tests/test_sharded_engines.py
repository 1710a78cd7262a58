"""Sharded data-parallel layouts against the engines themselves, on CPU over gloo.

The parent builds a Megatron-style module's parameters (tp=1) from the oracle's full HF tensors:
the vocabulary-padded embedding ``[P, hidden]`` (padding rows zero), Megatron's fused
``linear_qkv`` / ``linear_fc1`` weights and biases (tests/oracle.py ``megatron_linear_qkv``,
``megatron_linear_fc1``), ``down_proj`` and a norm, and compares with the layout
``Layout(..., vocab_pad_multiple=8, qkv_order="megatron")``; ``fsdp`` spawned processes shard them with the engine:

* torch FSDP2 (``torch.distributed.fsdp.fully_shard`` over a 1-D mesh): each rank's
  ``param.to_local()``;
* DeepSpeed ZeRO-3 (``deepspeed.zero.Init``; in the test extra, skipped where it is not installed;
  run with ``DS_ACCELERATOR=cpu``; no op is built): each rank's ``param.ds_tensor``.

and send back their local tensors, which must equal what the realloc layout's views of a buffer
written from the same HF tensors give (FSDP2: ``fused_views(padding=True, convention="megatron")``;
ZeRO-3: ``flat_views``), padding positions excepted (the engine's padding
values are its own).
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import processes
import pytest
import torch

from realloc.boxes import box_index
from realloc.layout import Layout, Topology
from realloc.shards import ShardStore, allocate_buffers, flat_views, fused_views

try:
    from tests import oracle
    from tests.test_sharded_fused import GQA
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle
    from test_sharded_fused import GQA

D = dataclasses.replace(GQA, layers=1, tied=True)  # 4 q heads in 2 query groups, q/k/v and MLP biases
PAD = 8  # Megatron's make_vocab_size_divisible_by: 13 rows padded to 16
EMBED = "model.embed_tokens.weight"


def engine_tensors(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's (tp=1) parameters, from the full HF tensors, by their layout slot / view names."""
    padded = oracle.padded_vocab(D.vocab, 1, PAD)
    embed = torch.cat([full[EMBED], torch.zeros(padded - D.vocab, D.hidden)])
    out = {EMBED: embed, "model.layers.0.input_layernorm.weight": full["model.layers.0.input_layernorm.weight"]}
    for suffix in ("weight", "bias"):
        out[f"model.layers.0.self_attention.linear_qkv.{suffix}"] = oracle.megatron_linear_qkv(D, full, 0, 1, 0, suffix)
        out[f"model.layers.0.mlp.linear_fc1.{suffix}"] = oracle.megatron_linear_fc1(full, 0, 1, 0, suffix)
    out["model.layers.0.mlp.down_proj.weight"] = full["model.layers.0.mlp.down_proj.weight"]
    return out


def _fsdp2(rank: int, world: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Module()
    for i, t in enumerate(tensors.values()):
        model.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    return {name: getattr(model, f"p{i}").to_local().detach().clone() for i, name in enumerate(tensors)}


def _zero3(rank: int, world: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no JIT-built shared-memory op
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": False}}

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for i, t in enumerate(tensors.values()):
                self.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(t.shape)))

    with deepspeed.zero.Init(config_dict_or_path=config):  # float32: the config enables neither fp16 nor bf16
        model = Holder()
    params = [getattr(model, f"p{i}") for i in range(len(tensors))]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            for p, t in zip(params, tensors.values()):
                p.data.copy_(t)
    return {name: p.ds_tensor.detach().clone() for name, p in zip(tensors, params)}


def _worker(engine: str, rank: int, world: int, port: int, tensors, queue) -> None:
    try:
        import torch.distributed as dist

        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        torch.set_num_threads(1)
        processes.init_group(port, rank, world)
        local = (_fsdp2 if engine == "fsdp2" else _zero3)(rank, world, tensors)
        queue.put((rank, "ok", {k: v.numpy() for k, v in local.items()}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


def run(engine: str, world: int, tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    store = processes.host_store()  # the group's rendezvous, held until the workers are done
    port = store.port
    ctx = processes.context()  # a fork server's children, not fork (tests/processes.py)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(engine, r, world, port, tensors, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, local = queue.get(timeout=180)
            assert status == "ok", f"{engine} rank {rank}:\n{status}"
            results[rank] = {k: torch.from_numpy(v) for k, v in local.items()}
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        del store
    return results


def layout_views(lay: Layout, rank: int, full: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(views of the rank's buffer written from ``full`` through its boxes, a mask of real elements
    per view) by the layout's own views: padded shard views (FSDP2) or flat partitions (ZeRO-3)."""
    out = []
    for value in (None, True):
        buffers = allocate_buffers(lay, rank)
        store = ShardStore(lay.shards(rank), buffers)
        for s in lay.shards(rank):
            if s.numel:
                data = full[s.param][box_index(s.offsets, s.sizes)]
                store.write(s.param, s.offsets, s.sizes, torch.ones_like(data) if value else data)
        zero3 = lay.topology.fsdp_split == "zero3"
        if zero3:
            out.append(flat_views(lay.at(rank), buffers))
        else:
            out.append(fused_views(lay.at(rank), buffers, padding=True, convention="megatron"))
    return out[0], {k: v.bool() for k, v in out[1].items()}


def check_engine(engine: str, fsdp: int) -> None:
    full = oracle.full_tensors(D, seed=5)
    tensors = engine_tensors(full)
    got = run(engine, fsdp, tensors)
    lay = Layout(D.spec(), Topology(fsdp=fsdp, fsdp_split=engine), PAD, qkv_order="megatron")
    for rank in range(fsdp):
        views, real = layout_views(lay, rank, full)
        for name in tensors:
            local = got[rank][name]
            if name not in views:  # an empty FSDP2 chunk: no shard here
                assert local.numel() == 0, (engine, rank, name)
                continue
            assert local.shape == views[name].shape, (engine, rank, name, local.shape, views[name].shape)
            assert torch.equal(local[real[name]], views[name][real[name]]), (engine, rank, name)
            assert torch.equal(local.reshape(-1)[~real[name].reshape(-1)].abs().sum(), torch.tensor(0.0)) or (
                engine == "zero3"  # DeepSpeed's partition tail is torch.empty; FSDP2's chunk padding rows are ours
            )


@pytest.mark.parametrize("fsdp", [3, 4])
def test_fsdp2_shards_megatrons_tensors_as_the_layout(fsdp):
    check_engine("fsdp2", fsdp)


@pytest.mark.parametrize("fsdp", [3, 4])
def test_zero3_partitions_megatrons_tensors_as_the_layout(fsdp, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    check_engine("zero3", fsdp)
