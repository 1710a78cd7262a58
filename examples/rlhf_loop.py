"""An RLHF-style loop on the public API: train in one layout, generate in another, repeat.

Run it directly (starts a local Ray) or on a cluster::

    python examples/rlhf_loop.py
    RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python examples/rlhf_loop.py

"Training" is a deterministic elementwise update of every shard (what an optimizer step does
to each rank's local weights); "generation" reads the generation-layout shards. The driver
replays the same updates on full tensors and checks the weights after every move.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray
import torch

from actors import ModelGroup
from realloc import ModelSpec, Topology
from realloc.boxes import box_index
from realloc.synthetic import synthetic_state_dict

TRAIN = Topology(dp=2, tp=2, pp=2)
GENERATE = Topology(dp=4, tp=2, pp=1)


def train_step(ctx, decay: float, shift: float) -> int:
    """One "optimizer step" on this worker's shards (only real elements, never vocab padding)."""
    for shard in ctx.shards:
        box = ctx.tensors[shard.slot][tuple(slice(0, n) for n in shard.sizes)]
        box.mul_(decay).add_(shift)
    return ctx.rank


def generate(ctx) -> dict[str, float]:
    """Stand-in for a generation engine: read every local shard (a checksum per slot)."""
    return {shard.slot: float(ctx.tensors[shard.slot].double().sum()) for shard in ctx.shards}


def expected_sums(reference: dict[str, torch.Tensor], group: ModelGroup) -> list[dict[str, float]]:
    out = []
    for rank in range(group.num_workers):
        sums = {}
        for shard in group.layout.shards(rank):
            box = reference[shard.param][box_index(shard.offsets, shard.sizes)]
            sums[shard.slot] = float(box.double().sum())
        out.append(sums)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args(argv)

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=TRAIN.world_size, include_dashboard=False, log_to_driver=False)
    spec = ModelSpec.preset(args.model)
    policy = ModelGroup.create(spec, TRAIN, name="rlhf-policy", timeout_s=120)
    try:
        policy.init_synthetic(seed=0)
        reference = synthetic_state_dict(spec, seed=0)
        for it in range(args.iterations):
            decay, shift = 0.5, 0.125 * (it + 1)  # exact in bf16: results stay bit-comparable
            policy.run(train_step, decay, shift)
            reference = {k: v.mul(decay).add(shift) for k, v in reference.items()}

            to_gen = policy.reallocate(GENERATE, src=TRAIN)
            sums = policy.run(generate)
            if sums != expected_sums(reference, policy):
                raise SystemExit(f"iteration {it}: generation shards differ from the reference")
            back = policy.reallocate(TRAIN, src=GENERATE)
            state = policy.state_dict()
            if not all(torch.equal(state[k], reference[k]) for k in reference):
                raise SystemExit(f"iteration {it}: training shards differ after the round trip")
            print(f"iteration {it}: train->gen {to_gen.seconds:.3f}s ({to_gen.gbps:.2f} GB/s), "
                  f"gen->train {back.seconds:.3f}s, weights verified", flush=True)
    finally:
        policy.shutdown()
    print("rlhf loop finished: all iterations verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
