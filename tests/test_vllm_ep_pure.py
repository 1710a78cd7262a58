"""A vLLM engine with expert parallelism (``enable_expert_parallel=True``) against realloc's layout of
it, in this process: vLLM's own Qwen3-MoE model built as each rank of the engine, baked and described
as a worker does, and the driver's choice and check of the layout.

vLLM's ``Qwen3MoeForCausalLM`` (vllm/model_executor/models/qwen3_moe.py) is built for rank ``r`` of a
tp engine as vLLM's model loader builds it (vllm/model_executor/model_loader/utils.py
``initialize_model`` under base_loader.py ``load_model``'s ``set_default_torch_dtype``:
``record_metadata_for_reloading``; then ``process_weights_after_loading``);
only vLLM's process groups (vllm/distributed/parallel_state.py ``get_tp_group``, ``get_ep_group``,
``get_pp_group``, ``get_dp_group``, ``get_pcp_group``: one replica, one stage) are stood in for. Its
``FusedMoE`` then holds whole experts, ep = tp (vllm/model_executor/layers/fused_moe/config.py
``FusedMoEParallelConfig.make``), placed as vLLM places them (expert_map_manager.py
``determine_expert_map``). On each rank:

* vLLM's own ``load_weights`` of the full checkpoint must put into ``w13_weight``/``w2_weight`` what
  realloc's layout gives the rank, bit for bit (``fused_views`` of its buffers);
* :func:`actors.vllm.bake.bake` (the worker's bake, vLLM's loaders over data-less stand-ins) and
  :func:`actors.vllm.bake.describe_experts` (what the worker reports of its experts) make the
  worker's description, and the driver's :func:`actors.driver.vllm.engine_layout` (what
  ``VLLMEngine.init`` runs) must pick ``Topology(tp=T, ep=T, etp=1)`` and find every worker's boxes
  equal to the layout's.

No engine, no processes.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from test_vllm_fp8_layers_pure import _realloc_views, same  # noqa: E402

from actors.driver.vllm import VLLM_EXPERT_PLACEMENTS, engine_layout, vllm_layout  # noqa: E402
from actors.vllm.bake import bake, describe_experts  # noqa: E402
from realloc.layout import Topology  # noqa: E402
from realloc.shards.store import TORCH_DTYPES  # noqa: E402
from realloc.spec import spec_from_hf_config  # noqa: E402

EXPERTS = "model.layers.0.mlp.experts."


def _group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank_in_group=rank,
        world_size=size,
        is_first_rank=rank == 0,
        is_last_rank=rank == size - 1,
        device_group=SimpleNamespace(size=lambda: size),
    )


@contextmanager
def engine_rank(tp: int, rank: int):
    """vLLM's process groups as tp rank ``rank`` of a ``tp`` engine of one replica and one stage (the
    ep group is the tp group: vllm/distributed/parallel_state.py ``initialize_model_parallel``),
    wherever vLLM's modules imported them by name."""
    import vllm.distributed.parallel_state as ps

    stood_in = {
        "get_tp_group": _group(rank, tp),
        "get_ep_group": _group(rank, tp),
        "get_pp_group": _group(0, 1),
        "get_dp_group": _group(0, 1),
        "get_pcp_group": _group(0, 1),
    }
    with ExitStack() as stack:
        for name, group in stood_in.items():
            original = getattr(ps, name)
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("vllm") and getattr(module, name, None) is original:
                    stack.enter_context(mock.patch.object(module, name, return_value=group))
        yield


def _hf_config(experts: int) -> dict:
    """A one-layer Qwen3-MoE config (bf16; sizes the CPU MoE kernel takes)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "max_position_embeddings": 64,
        "torch_dtype": "bfloat16",
    }


def _config(tmp_path, experts: int) -> tuple:
    """:func:`_hf_config` saved to ``tmp_path`` (for vLLM's ``ModelConfig``), and its spec."""
    config = _hf_config(experts)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, spec_from_hf_config(config)


def _vllm_config(path, expert_parallel: bool, placement: str = "linear"):
    from vllm.config import ModelConfig, VllmConfig

    cfg = VllmConfig(model_config=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16"))
    cfg.parallel_config.enable_expert_parallel = expert_parallel
    cfg.parallel_config.expert_placement_strategy = placement
    return cfg


def _worker(
    path, placement: str | None, tp: int, rank: int, spec, full: dict[str, torch.Tensor]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """vLLM's model of the config at ``path`` as tp rank ``rank`` of an engine with expert parallelism
    placed by ``placement`` (None: without expert parallelism; each rank its own vLLM config, as each
    worker has): its description as actors/vllm/engine.py ``_init`` posts it
    (the bake's boxes, the experts as vLLM's layers hold them), and its ``w13``/``w2`` loaded by
    vLLM's ``load_weights`` from the full checkpoint ``full``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    cpu = torch.device("cpu")
    cfg = _vllm_config(path, placement is not None, placement or "linear")
    with engine_rank(tp, rank), set_current_vllm_config(cfg), torch.device(cpu):
        with set_default_torch_dtype(cfg.model_config.dtype):  # as base_loader.py ``load_model`` builds it
            model = Qwen3MoeForCausalLM(vllm_config=cfg, prefix="")
        record_metadata_for_reloading(model)
        model.load_weights(iter(full.items()))
        experts = model.get_submodule(EXPERTS + "routed_experts")
        loaded = {p: getattr(experts, p).data.clone() for p in ("w13_weight", "w2_weight")}
        process_weights_after_loading(model, cfg.model_config, cpu)
        baked = bake(model, [(p.name, p.shape, p.dtype) for p in spec.params], cpu)
        described = {
            "index": rank,
            "workers": tp,
            "tp_rank": rank,
            "tp_size": tp,
            "pp_rank": 0,
            "pp_size": 1,
            **describe_experts(model, cfg.parallel_config),
            "boxes": {n: [[list(o), list(s)] for o, s in b] for n, b in baked.boxes().items()},
            "unread": list(baked.unread),
            "missing": list(baked.missing),
        }
    return described, loaded


def _checkpoint(spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g).to(TORCH_DTYPES[p.dtype]) for p in spec.params}


#: (tp = ep, experts): even splits, and expert counts ep does not divide (linear placement: the
#: first ``experts % ep`` ranks hold one more; 5 over 2: 3 and 2; 7 over 4: 2, 2, 2, 1; 10 over 8)
EP = [(2, 4), (2, 5), (4, 7), (4, 8), (8, 10)]


@pytest.mark.parametrize("tp, experts", EP)
def test_an_expert_parallel_engine_is_laid_out_as_its_workers_bake_it(tmp_path, tp, experts):
    path, spec = _config(tmp_path, experts)
    full = _checkpoint(spec, seed=tp * 100 + experts)
    workers, loaded = zip(*(_worker(path, "linear", tp, r, spec, full) for r in range(tp)))
    for w in workers:  # what vLLM's layers say of themselves
        assert w["expert_parallel"] and w["ep_size"] == tp and w["ep_rank"] == w["tp_rank"], w
        assert w["expert_tp_size"] == 1 and w["expert_placement"] == "linear" and not w["eplb"], w
    layout = engine_layout(spec, list(workers))  # the driver's init: picks the layout, checks every box
    assert layout.topology == Topology(tp=tp, ep=tp, etp=1)
    assert layout.key == vllm_layout(spec, tp, ep=tp).key
    held = []
    for r, w in enumerate(workers):
        mine = sorted({int(n.split(".")[5]) for n in w["boxes"] if n.startswith(EXPERTS)})
        held.append(mine)
        views = _realloc_views(layout, r, full)
        for p in ("w13_weight", "w2_weight"):  # vLLM's own load of the full checkpoint: realloc's bytes
            assert loaded[r][p].dtype == torch.bfloat16 and same(views[EXPERTS + p], loaded[r][p]), (p, tp, r)
    base, extra = divmod(experts, tp)
    counts = [base + (r < extra) for r in range(tp)]
    assert held == [list(range(sum(counts[:r]), sum(counts[: r + 1]))) for r in range(tp)]  # vLLM's linear


def test_without_expert_parallelism_the_engine_keeps_its_tensor_parallel_experts(tmp_path):
    path, spec = _config(tmp_path, 5)
    full = _checkpoint(spec, seed=3)
    workers = [_worker(path, None, 2, r, spec, full)[0] for r in range(2)]
    assert all(not w["expert_parallel"] and w["ep_size"] == 1 and w["expert_tp_size"] == 2 for w in workers)
    assert engine_layout(spec, workers).key == vllm_layout(spec, 2).key


def test_round_robin_asked_of_a_model_without_expert_groups_is_vllms_linear_placement(tmp_path):
    """vLLM places Qwen3-MoE's experts linearly even when ``round_robin`` is asked (it has no expert
    groups: expert_map_manager.py ``determine_expert_placement_strategy`` falls back): the workers
    report what their layers hold, and the engine is laid out (and checked) as linear."""
    path, spec = _config(tmp_path, 5)
    full = _checkpoint(spec, seed=5)
    workers = [_worker(path, "round_robin", 2, r, spec, full)[0] for r in range(2)]
    assert all(w["expert_placement"] == "linear" and w["expert_placement_config"] == "round_robin" for w in workers)
    assert engine_layout(spec, workers).topology == Topology(tp=2, ep=2, etp=1)


def _fused_moe_description(tp: int, rank: int, placement: str, eplb: bool = False) -> dict:
    """What :func:`describe_experts` reads of vLLM's ``FusedMoE`` (layer.py ``FusedMoEFactory``) of
    8 experts in 2 expert groups (grouped routing, where vLLM keeps ``round_robin``), as tp rank
    ``rank`` of an expert-parallel engine."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    cfg = VllmConfig()
    cfg.parallel_config.enable_expert_parallel = True
    cfg.parallel_config.expert_placement_strategy = placement
    cfg.parallel_config.enable_eplb = eplb
    with engine_rank(tp, rank), set_current_vllm_config(cfg):
        moe = FusedMoEFactory(
            num_experts=8,
            top_k=2,
            hidden_size=64,
            intermediate_size=64,
            params_dtype=torch.bfloat16,
            prefix=EXPERTS.rstrip("."),
            tp_size=tp,
            dp_size=1,
            pcp_size=1,
            num_expert_group=2,
            topk_group=1,
            use_grouped_topk=True,
            enable_eplb=eplb,
        )
    return describe_experts(moe, cfg.parallel_config)


def _moe_spec():
    return spec_from_hf_config(_hf_config(8))


def test_round_robin_expert_placement_is_refused_naming_it_before_any_box_is_compared():
    described = [_fused_moe_description(2, r, "round_robin") for r in range(2)]
    assert all(d["expert_placement"] == "round_robin" for d in described), described  # vLLM kept it
    workers = [
        {"index": r, "tp_rank": r, "tp_size": 2, "boxes": {}, "unread": [], "missing": [], **d}
        for r, d in enumerate(described)
    ]
    with pytest.raises(ValueError, match=r"places its experts 'round_robin'.*\['linear'\] only") as err:
        engine_layout(_moe_spec(), workers)  # the workers' boxes (none here) are never read
    assert "reads" not in str(err.value)
    with pytest.raises(ValueError, match=r"'round_robin'.*\['linear'\]"):
        vllm_layout(_moe_spec(), 2, ep=2, expert_placement="round_robin")
    with pytest.raises(ValueError, match=r"'custom'.*\['linear'\]"):
        vllm_layout(_moe_spec(), 2, ep=2, expert_placement="custom")
    assert VLLM_EXPERT_PLACEMENTS == ("linear",)


def test_an_ep_size_that_is_not_the_engines_tp_size_is_refused():
    with pytest.raises(ValueError, match=r"tensor parallel size 4 splits its experts over ep=1.*or ep=4.*got ep=2"):
        vllm_layout(_moe_spec(), 4, ep=2)


def test_expert_load_balancing_is_refused_naming_it():
    described = [_fused_moe_description(2, r, "linear", eplb=True) for r in range(2)]
    assert all(d["eplb"] for d in described), described
    workers = [
        {"index": r, "tp_rank": r, "tp_size": 2, "boxes": {}, "unread": [], "missing": [], **d}
        for r, d in enumerate(described)
    ]
    with pytest.raises(ValueError, match=r"enable_eplb=True.*start the engine with enable_eplb=False"):
        engine_layout(_moe_spec(), workers)
