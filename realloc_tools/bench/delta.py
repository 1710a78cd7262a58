"""``realloc bench --delta``: delta copies beside full ones, per AdamW step (issue 24).

A trainer group (``GroupConfig(delta="host")``) on the actors of one simulated node copies into
a generator group on the other's after every optimizer step: first ``copy_to(gen, delta=True)``
(a delta: only the changed elements travel), then a plain ``copy_to(gen)`` of the same weights
(the full move, timed for comparison; it leaves the delta bookkeeping as it was). The trainer's
workers hold fp32 master weights initialised like a Llama (normal(0, 0.02), norms 1) and step
AdamW (weight decay 0.01) on random normal gradients; their bf16 cast is what moves. Adam's step
is about ``lr`` per element whatever the gradients' scale, so the changed fraction follows the
learning rate as in training (``benchmarks/delta_encoding.py`` measures it with real next-token
training of the example Llama). Per step: the changed fraction, bytes on the wire, seconds, the
issue's goal (wire bytes <= 3x the changed fraction + 0.5% of a full copy), and whether every
generator worker's buffers after the delta are bit-identical (xxh3 per tensor) to what the full
copy of the same weights leaves.
"""

from __future__ import annotations

import torch

from actors import ModelGroup, ShardWorker
from realloc import Topology

TRAINER, GENERATOR = Topology(tp=4), Topology(dp=2, tp=2)


class AdamTrainer(ShardWorker):
    """Trainer-side user code of the bench: fp32 masters and AdamW over this rank's shards."""

    def adam_setup(self, lr: float, seed: int) -> None:
        ctx = self.context()
        self._masters = {}
        for name, t in sorted(ctx.tensors.items()):
            g = torch.Generator().manual_seed(seed * 7919 + sum(map(ord, name)) + 131 * ctx.tp_rank)
            master = torch.ones(t.shape) if "norm" in name else torch.randn(t.shape, generator=g) * 0.02
            t.copy_(master.to(t.dtype))
            self._masters[name] = torch.nn.Parameter(master.to(t.device))
        self._optimizer = torch.optim.AdamW(list(self._masters.values()), lr=lr, weight_decay=0.01)
        self._seed = seed

    def adam_step(self, step: int) -> tuple[int, int]:
        """One AdamW step on random gradients; returns (bf16 elements changed, elements)."""
        ctx = self.context()
        changed = total = 0
        for name, p in self._masters.items():
            g = torch.Generator().manual_seed(self._seed * 104729 + step * 1009 + sum(map(ord, name)) + ctx.tp_rank)
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        self._optimizer.step()
        for name, p in self._masters.items():
            t = ctx.tensors[name]
            new = p.detach().to(t.dtype)
            changed += int((new.view(torch.int16) != t.view(torch.int16)).sum()) if t.element_size() == 2 else 0
            total += t.numel()
            t.copy_(new)
        return changed, total


class DigestGen(ShardWorker):
    """Generator-side user code of the bench: a digest of this rank's buffers."""

    def digest(self) -> list[int]:
        from realloc.shards import delta

        return [delta.checksum(t.reshape(-1).view(torch.uint8)) for t in self.context().tensors.values()]


def measure(spec, lrs: list[float], steps: int, bucket_bytes: int, log=print, **settings) -> list[dict]:
    """The per-step rows of one model (Ray must be up with two nodes of 4 CPU slots, or one of 8).
    ``settings`` are the groups' other :class:`~actors.GroupConfig` fields (bench-gpu: ``use_gpu``)."""
    rows = []
    for lr in lrs:
        trainer = ModelGroup.create(
            spec,
            TRAINER,
            name="delta-trainer",
            worker_cls=AdamTrainer,
            bucket_bytes=bucket_bytes,
            zero_copy=False,
            delta="host",
            **settings,
        )
        gen = ModelGroup.create(
            spec,
            GENERATOR,
            name="delta-gen",
            worker_cls=DigestGen,
            bucket_bytes=bucket_bytes,
            zero_copy=False,
            **settings,
        )
        try:
            trainer.call("adam_setup", lr, 0)
            first = trainer.copy_to(gen, delta=True)
            log(f"{spec.name} lr {lr:g}: first copy {first.delta['mode']}, {first.pause_seconds:.3f} s")
            for step in range(1, steps + 1):
                counts = trainer.call("adam_step", step)
                changed = sum(c for c, _ in counts) / sum(n for _, n in counts)
                d = trainer.copy_to(gen, delta=True)
                after_delta = gen.call("digest", writes=False)
                full_s = trainer.copy_to(gen).pause_seconds
                exact = gen.call("digest", writes=False) == after_delta  # the same weights, copied whole
                wire = d.delta["wire_bytes"] / d.delta["bytes"]
                row = {
                    "model": spec.name,
                    "lr": lr,
                    "step": step,
                    "changed_fraction": changed,
                    "mode": d.delta["mode"],
                    "bytes": d.delta["bytes"],
                    "wire_bytes": d.delta["wire_bytes"],
                    "wire_fraction": wire,
                    "goal_fraction": 3 * changed + 0.005,
                    "goal_met": wire <= 3 * changed + 0.005,
                    "buckets": {k: d.delta[k] for k in ("buckets", "delta", "whole", "repaired")},
                    "delta_seconds": d.pause_seconds,
                    "full_seconds": full_s,
                    "base_bytes_per_actor": d.delta["base_bytes_per_actor"],
                    "exact": exact,
                }
                rows.append(row)
                log(
                    f"  step {step}: {100 * changed:.2f}% changed, wire {100 * wire:.2f}% of "
                    f"{d.delta['bytes'] / 1e6:.1f} MB ({d.delta['mode']}), {d.pause_seconds:.3f} s vs full {full_s:.3f} s"
                )
        finally:
            trainer.shutdown()
            gen.shutdown()
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| model | lr | step | changed | wire (of full) | goal (3x changed + 0.5%) | delta s | full s | buckets delta/whole/repaired |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["buckets"]
        lines.append(
            f"| {r['model']} | {r['lr']:g} | {r['step']} | {100 * r['changed_fraction']:.2f}% | "
            f"{100 * r['wire_fraction']:.2f}% | {100 * r['goal_fraction']:.2f}% {'met' if r['goal_met'] else 'MISSED'} | "
            f"{r['delta_seconds']:.3f} | {r['full_seconds']:.3f} | {b['delta']}/{b['whole']}/{b['repaired']} |"
        )
    return "\n".join(lines)
