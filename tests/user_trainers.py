"""Trainers as RL frameworks run them: plain Ray actors (no realloc actor) holding a transformers
model under torch FSDP2 (``fully_shard``, with or without tensor parallelism: torchtitan's
composition), on a gloo process group of their own; they train, and call vLLM's trainer API
with realloc's engine on every rank (actors/trainer/)."""

from __future__ import annotations

import datetime
import os
import socket

import ray
import torch

#: The tensor-parallel plan of a Llama decoder layer (torchtitan's ``parallelize_llama``; the
#: embedding and the head are split by vocabulary rows, as there).
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0)
class FSDPRank:
    """One rank of an FSDP2 trainer: ``world`` ranks, ``tp``-way tensor parallel inside
    (mesh ``(dp_shard, tp)``), the model of folder ``path`` in float32."""

    def __init__(self, path: str, rank: int, world: int, tp: int = 1):
        self.path, self.rank, self.world, self.tp = path, rank, world, tp
        self.model = self.opt = self.engine = None

    def pid(self) -> int:
        return os.getpid()

    def setup(self, port: int) -> str:
        """Join the trainer's gloo group (rank 0's port), load and shard the model; its mesh."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from transformers import AutoModelForCausalLM

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=60),
        )
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        if self.tp > 1:
            mesh = init_device_mesh("cpu", (self.world // self.tp, self.tp), mesh_dim_names=("dp_shard", "tp"))
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            for layer in model.model.layers:
                parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
            # the vocabulary split over tp too (rows of both), the logits gathered for the loss
            edges = {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate()),
            }
            parallelize_module(model, mesh["tp"], edges)
            dp = mesh["dp_shard"]
        else:
            mesh = dp = init_device_mesh("cpu", (self.world,), mesh_dim_names=("dp_shard",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=2.0)
        return str(mesh)

    def train(self, seed: int, steps: int = 1) -> float:
        """``steps`` SGD steps on random tokens (the same on every rank); the last loss."""
        g = torch.Generator().manual_seed(seed)
        vocab = self.model.config.vocab_size
        for _ in range(steps):
            ids = torch.randint(0, vocab, (2, 12), generator=g)
            loss = self.model(input_ids=ids, labels=ids).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        return float(loss)

    def full_state(self) -> dict:
        """Every parameter gathered whole (a collective: every rank calls it): the test's oracle only."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = full.detach().clone()
        return out if self.rank == 0 else {}

    def init_transfer(self, url: str, timeout_s: float, name: str = "fsdp", **declared) -> str:
        """vLLM's trainer API with realloc's engine, toward the ``vllm serve`` at ``url``."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from actors.trainer import ReallocTrainerInitInfo, ShardSource

        self.engine = WeightTransferTrainerFactory.trainer_init(
            ReallocTrainerInitInfo(rank=self.rank, name=name, timeout_s=timeout_s),
            client=HTTPVLLMWeightSyncClient(url),
            source=ShardSource(self.model, **declared),
        )
        return str(self.engine.holdings.layout.topology)

    def send(self) -> dict:
        """``send_weights()``: the version served, the bytes this rank sent, rank 0's stats."""
        version = self.engine.send_weights()
        stats = self.engine.stats
        return {
            "version": version,
            "sent_bytes": self.engine.sent_bytes,
            "received_bytes": stats.received_bytes if stats else None,
        }

    def holds_bytes(self) -> int:
        """The bytes of this rank's local shards."""
        from torch.distributed.tensor import DTensor

        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in self.model.parameters()
        )


def start_fsdp(path, world: int, tp: int = 1) -> list:
    """An FSDP2 trainer of ``world`` plain Ray actors, set up (its model sharded)."""
    ranks = [FSDPRank.remote(str(path), r, world, tp) for r in range(world)]
    port = free_port()
    ray.get([r.setup.remote(port) for r in ranks], timeout=120)
    return ranks
