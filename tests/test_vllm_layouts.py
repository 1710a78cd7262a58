"""Derived vs convention layouts: what vLLM's own loaders read on each worker equals realloc's vLLM
layout, for every parameter of Llama, Qwen3 and Qwen3-MoE at tp 1 and 2 (and a vocabulary vLLM pads).

Each worker's layout is baked (actors/vllm/bake.py) from the model vLLM builds: vLLM's model
classes and weight loaders, built by vLLM's ``get_model`` under vLLM's own parallel state in plain
processes (one for tp=1, two for tp=2, gloo), with dummy weights. Only the engine around the model
(scheduler, KV cache, API) is left out: the layout is the loaders' business, and starting six
engines would cost minutes (test_vllm_backend_ray.py runs a whole engine, and checks the same at
tp=2 before every update). The expectation is :func:`actors.driver.vllm.vllm_layout` (realloc's
conventions, docs/conventions.md), compared box by box by the check the driver runs
(:func:`actors.driver.vllm.check_derived`) and again here, independently.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

import vllm_models as vm

from actors.driver.vllm import check_derived, vllm_layout
from realloc.spec import spec_from_hf_config

#: (case, architecture, vocabulary): 1000 rows are padded by vLLM to 1024 (and split 512 + 488 real
#: rows at tp=2); 512 needs no padding
CASES = (
    ("llama", "llama", 512),
    ("llama-padded", "llama", 1000),
    ("qwen3", "qwen3", 512),
    ("qwen3-moe", "qwen3_moe", 1000),
)


def _bake(rank: int, tp: int, cases: list, out: str) -> None:
    """One vLLM worker process of tp size ``tp``: every case's model built by vLLM, then baked."""
    os.environ.update(vm.VLLM_ENV)
    os.environ["VLLM_DIST_IDENT"] = (
        f"realloc-test-{os.getppid()}"  # the tp group's shared-memory name (the executor sets it)
    )
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    from actors.vllm.bake import bake

    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does before it builds the model
    torch.set_num_threads(1)
    found = {}
    for i, (name, path, params) in enumerate(cases):
        config = EngineArgs(
            model=path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            tensor_parallel_size=tp,
            load_format="dummy",
            distributed_executor_backend="mp",
        ).create_engine_config()
        with set_current_vllm_config(config):
            if i == 0:
                init_distributed_environment(
                    world_size=tp,
                    rank=rank,
                    distributed_init_method=f"file://{out}/rendezvous-tp{tp}",  # no port to race for
                    local_rank=rank,
                    backend="gloo",
                )
                initialize_model_parallel(tp)
            model = get_model(vllm_config=config)
            baked = bake(model, [tuple(p) for p in params], torch.device("cpu"))
        found[name] = {
            "boxes": {n: [[list(o), list(s)] for o, s in b] for n, b in baked.boxes().items()},
            "unread": list(baked.unread),
            "missing": list(baked.missing),
        }
    Path(out, f"tp{tp}-rank{rank}.json").write_text(json.dumps(found))


def _run(tp: int, cases: list, out: Path, timeout_s: float = 240.0) -> None:
    ctx = mp.start_processes(_bake, args=(tp, cases, str(out)), nprocs=tp, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the tp={tp} vLLM model processes did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-layouts")
    specs, cases = {}, []
    for name, arch, vocab in CASES:
        path = vm.save_llama(root / name, vocab=vocab, arch=arch)
        specs[name] = spec_from_hf_config(path)
        cases.append((name, str(path), [[p.name, list(p.shape), p.dtype] for p in specs[name].params]))
    # the MoE model first: vLLM creates its expert-parallel group only when the model that
    # initializes the parallel state has experts
    cases.sort(key=lambda c: "moe" not in c[0])
    for tp in (1, 2):
        _run(tp, cases, root)
    found = {tp: [json.loads((root / f"tp{tp}-rank{r}.json").read_text()) for r in range(tp)] for tp in (1, 2)}
    return specs, found


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_vllm_derived_layout_equals_realloc_conventions_for_every_parameter(baked, case, tp):
    specs, found = baked
    spec = specs[case]
    layout = vllm_layout(spec, tp)
    workers = []
    for rank, by_case in enumerate(found[tp]):
        got = by_case[case]
        assert not got["missing"], f"{case} tp={tp} rank {rank}: vLLM holds tensors no checkpoint name reaches"
        want = {}
        for s in layout.shards(rank):
            want.setdefault(s.param, []).append([list(s.offsets), list(s.sizes)])
        names = {p.name for p in spec.params}
        assert set(got["boxes"]) | set(got["unread"]) == names, f"{case} tp={tp} rank {rank}"
        for name in sorted(names):
            assert sorted(want.get(name, [])) == got["boxes"].get(name, []), f"{case} tp={tp} rank {rank}: {name}"
        workers.append({"index": rank, "tp_rank": rank, "tp_size": tp, **got})
    check_derived(layout, workers, spec)  # the driver's own check agrees
    if case == "llama-padded" and tp == 2:
        assert found[2][1][case]["boxes"]["model.embed_tokens.weight"] == [[[512, 0], [488, 128]]]
    if case == "qwen3-moe":
        experts = [n for n in found[tp][0][case]["boxes"] if ".mlp.experts." in n]
        assert len(experts) == 2 * 4 * 3, "every expert's gate, up and down of both layers"
