"""An RL loop with a real model: train a small Llama in one layout, generate in another, repeat.

Your model code runs in the workers (``LlamaWorker``, a ``ShardWorker`` subclass): a
tensor-parallel Llama in plain torch (``examples/llama.py``) whose parameters *are* the
worker's shards (bound without copies, rebound by the ``on_shards_changed`` hook after every
move). Each iteration trains a few AdamW steps in the training layout (gradients reduced over
dp, activations passed between pipeline stages when pp > 1), reallocates to the generation
layout (another tp; vLLM-style fused ``qkv_proj``/``gate_up_proj`` views), greedy-decodes a batch
of prompts with tensor parallelism, and reallocates back. A single-process reference model is
trained on the same batches. Checked every iteration, exit status 1 on any failure:

* the weights after every move equal, bit for bit, the weights before it;
* the generated tokens equal the reference's; the largest logit difference is reported;
* the trained weights stay close to the reference's (reported).

Run it directly (starts a local Ray) or on a cluster::

    python examples/rlhf_loop.py
    python examples/rlhf_loop.py --train dp=1,tp=2,pp=2 --generate dp=2,tp=2
    python examples/rlhf_loop.py --keep in_place   # keep both layouts: the way back moves nothing
    RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python examples/rlhf_loop.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402  (the user's model code, next to this file)

from actors import ModelGroup, ShardWorker  # noqa: E402
from realloc import Topology  # noqa: E402

# The workers cannot import this folder: ship the model code (and this module) by value.
ray.cloudpickle.register_pickle_by_value(llama)
if __name__ != "__main__":
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = llama.LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=4
)
LR = 1e-3


class LlamaWorker(ShardWorker):
    """User code in every worker: a training model + AdamW, a generation model, both bound to
    the worker's shards of the layout it holds."""

    def setup(self, config: dict, train: str, lr: float) -> None:
        self.config = llama.LlamaConfig(**config)
        self.train_layout = Topology.parse(train)
        self.lr = lr
        self.train_model = self.optimizer = self.gen_model = None
        self._bind(self.context())

    def on_shards_changed(self, ctx, change) -> None:
        if getattr(self, "config", None) is not None:
            self._bind(ctx)

    def _bind(self, ctx) -> None:
        t = ctx.topology
        stage = dict(layers=ctx.layout.stages[ctx.pp_rank], first=ctx.pp_rank == 0, last=ctx.pp_rank == t.pp - 1)
        if ctx.layout == ctx.layout.with_topology(self.train_layout):
            if self.train_model is None:
                self.train_model = llama.Llama(
                    self.config, tp_group=ctx.groups.tp, tp_size=t.tp, tp_rank=ctx.tp_rank, **stage
                )
                ctx.bind(self.train_model)
                self.optimizer = torch.optim.AdamW(self.train_model.parameters(), lr=self.lr)
            else:
                ctx.bind(self.train_model)  # same Parameter objects: AdamW keeps its state
        else:
            if t.pp != 1:
                raise ValueError(f"generation runs on one pipeline stage, not {t}")
            if self.gen_model is None:
                self.gen_model = llama.Llama(
                    self.config, tp_group=ctx.groups.tp, tp_size=t.tp, tp_rank=ctx.tp_rank, fused=True, **stage
                )
            ctx.bind(self.gen_model, fused=True)

    def train(self, tokens: torch.Tensor, steps: int) -> list[float | None]:
        """``steps`` AdamW steps; this dp replica trains on its share of ``tokens``."""
        ctx = self.context()
        mine = tokens.chunk(ctx.topology.dp)[ctx.dp_rank]
        losses = []
        for _ in range(steps):
            if ctx.topology.pp == 1:
                loss = llama.train_step(
                    self.train_model, self.optimizer, mine, dp_group=ctx.groups.dp, dp_size=ctx.topology.dp
                )
            else:
                loss = llama.pipeline_train_step(
                    self.train_model,
                    self.optimizer,
                    mine,
                    pp_group=ctx.groups.pp,
                    pp_rank=ctx.pp_rank,
                    pp_size=ctx.topology.pp,
                    dp_group=ctx.groups.dp,
                    dp_size=ctx.topology.dp,
                )
            losses.append(loss)
        return losses

    def generate(self, prompts: torch.Tensor, new_tokens: int):
        """Greedy decoding with tensor parallelism; this dp replica decodes its share."""
        ctx = self.context()
        mine = prompts.chunk(ctx.topology.dp)[ctx.dp_rank]
        with torch.no_grad():
            tokens, logits = llama.greedy_generate(self.gen_model, mine, new_tokens)
        return ctx.dp_rank, ctx.tp_rank, tokens, logits


@dataclass
class LoopReport:
    """What the loop measured (all comparisons against the single-process reference)."""

    train: str
    generate: str
    iterations: int = 0
    weights_bit_exact_after_moves: bool = True
    tokens_identical: bool = True
    max_logit_diff: float = 0.0
    max_weight_diff_vs_reference: float = 0.0
    losses: list = field(default_factory=list)
    cycle_seconds: list = field(default_factory=list)  # train -> generate -> train, each iteration
    move_seconds: list = field(default_factory=list)  # the two reallocations of each iteration
    move_uses: list = field(default_factory=list)  # their resident_use (with --keep: refreshed / adopted)
    keep: str | None = None
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def batches(config, n: int, length: int, seed: int) -> torch.Tensor:
    """Learnable sequences: token t+1 = token t + stride (mod vocab), random start and stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % config.vocab_size


def reference_init(config, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = {}
    for p in config.spec().params:
        if p.name.endswith("norm.weight"):
            full[p.name] = torch.ones(p.shape)
        else:
            full[p.name] = torch.randn(p.shape, generator=g) * 0.02
    return full


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def run_loop(
    train: str = "dp=2,tp=2",
    generate: str = "dp=1,tp=4",
    iterations: int = 2,
    steps: int = 2,
    prompts: int = 4,
    new_tokens: int = 6,
    name: str = "rlhf-policy",
    timeout_s: float = 120,
    log=print,
    worker_cls: type = LlamaWorker,
    keep: str | None = None,
) -> LoopReport:
    """The loop on a running Ray; returns what it measured (``report.ok``: every check passed).

    ``keep``: keep the layout each move leaves (``reallocate(..., keep=)``); generation is
    called with ``writes=False``, so the way back adopts the kept training layout."""
    report = LoopReport(train, generate, keep=keep)
    spec = CONFIG.spec()
    init = reference_init(CONFIG, seed=0)
    reference = llama.Llama(CONFIG)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(init[n])
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)

    policy = ModelGroup.create(spec, train, name=name, worker_cls=worker_cls, timeout_s=timeout_s)
    try:
        policy.load_state_dict(init)
        policy.call("setup", asdict(CONFIG), train, LR)
        for it in range(iterations):
            data = batches(CONFIG, 8, 16, seed=100 + it % 2)  # two batches, revisited: the loss falls
            started = time.perf_counter()
            losses = policy.call("train", data, steps)
            for _ in range(steps):
                ref_loss = llama.train_step(reference, ref_opt, data)
            last = [rank[-1] for rank in losses if rank[-1] is not None]  # every rank of the last stage
            report.losses.append((sum(last) / len(last), ref_loss))  # the mean over dp = the full-batch loss

            trained = policy.state_dict()
            to_gen = policy.reallocate(generate, src=train, keep=keep)
            if not _same(policy.state_dict(), trained):
                report.failures.append(f"iteration {it}: weights changed moving {train} -> {generate}")
            prompt = batches(CONFIG, prompts, 5, seed=1000 + it)
            outputs = policy.call("generate", prompt, new_tokens, writes=False)
            back = policy.reallocate(train, src=generate, keep=keep)
            report.cycle_seconds.append(time.perf_counter() - started)
            report.move_seconds.append((to_gen.pause_seconds, back.pause_seconds))
            report.move_uses.append((to_gen.resident_use, back.resident_use))
            if not _same(policy.state_dict(), trained):
                report.failures.append(f"iteration {it}: weights changed moving {generate} -> {train}")

            want_tokens, want_logits = llama.greedy_generate(reference, prompt, new_tokens)
            tokens, logits = _assemble(outputs, prompt, Topology.parse(generate).dp)
            if not torch.equal(tokens, want_tokens):
                report.tokens_identical = False
                report.failures.append(f"iteration {it}: generated tokens differ from the reference")
            report.max_logit_diff = max(report.max_logit_diff, float((logits - want_logits).abs().max()))
            ref_state = {n: p.detach() for n, p in reference.named_parameters()}
            report.max_weight_diff_vs_reference = max(report.max_weight_diff_vs_reference, max_diff(trained, ref_state))
            report.iterations += 1
            log(
                f"iteration {it}: loss {report.losses[-1][0]:.4f} (reference {ref_loss:.4f}); "
                f"{train} -> {generate} {to_gen.pause_seconds:.3f}s, back {back.pause_seconds:.3f}s; "
                f"cycle {report.cycle_seconds[-1]:.2f}s; tokens {'identical' if report.tokens_identical else 'DIFFER'}; "
                f"max |logit diff| {report.max_logit_diff:.2e}"
            )
    finally:
        policy.shutdown()
    report.weights_bit_exact_after_moves = not any("weights changed" in f for f in report.failures)
    return report


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assemble(outputs, prompts: torch.Tensor, dp: int):
    """Tokens and logits of all prompts from the tp-rank-0 worker of every dp replica (every tp
    rank of a replica must agree)."""
    by_replica = {}
    for dp_rank, _tp_rank, tokens, logits in outputs:
        if dp_rank in by_replica and not torch.equal(by_replica[dp_rank][0], tokens):
            raise AssertionError(f"tp ranks of replica {dp_rank} generated different tokens")
        by_replica.setdefault(dp_rank, (tokens, logits))
    return (torch.cat([by_replica[d][0] for d in range(dp)]), torch.cat([by_replica[d][1] for d in range(dp)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", default="dp=2,tp=2", help="training layout (default dp=2,tp=2)")
    parser.add_argument("--generate", default="dp=1,tp=4", help="generation layout, pp=1 (default tp=4)")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps per iteration")
    parser.add_argument(
        "--keep",
        choices=("in_place", "host"),
        default=None,
        help="keep the layout each move leaves (resident layouts: the way back moves nothing)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    workers = Topology.parse(args.train).world_size
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
    report = run_loop(args.train, args.generate, args.iterations, args.steps, keep=args.keep)
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    for failure in report.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if not report.ok:
        return 1
    print(
        f"rlhf loop finished: {report.iterations} iterations verified; weights bit-exact after every move; "
        f"tokens identical to the reference; max |logit diff| {report.max_logit_diff:.2e}; "
        f"max |weight diff| vs reference {report.max_weight_diff_vs_reference:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
