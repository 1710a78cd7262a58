"""Mixture-of-experts specs from HF configs against transformers' own models.

The configs in ``tests/data/configs`` are the published ``config.json`` files of
mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B, Qwen/Qwen2-57B-A14B, deepseek-ai/DeepSeek-V2-Lite
and deepseek-ai/DeepSeek-V3 (see ``tests/data/configs/SOURCES.md``). Their parameter counts are
the ones transformers 5 reports for the models it builds from them (``sum(p.numel() for p in
model.parameters())``, on the meta device). Names and shapes are checked against transformers'
meta models after :func:`checkpoint_state_dict` unstacks their in-memory experts, and that
conversion against transformers' own ``revert_weight_conversion`` (what ``save_pretrained``
writes) on small models with real weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from realloc.layout import Layout, Topology
from realloc.spec import ModelSpec, spec_from_hf_config
from realloc.spec.moe import checkpoint_state_dict
from realloc_tools.offline.plan import main

CONFIGS = Path(__file__).parent / "data" / "configs"
#: transformers 5.x's parameter counts of the published configs (buffers not included).
PUBLISHED_COUNTS = {
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Qwen2-57B-A14B": 57_408_658_944,
    "DeepSeek-V2-Lite": 15_706_484_224,
    "DeepSeek-V3": 671_026_404_352,
}

#: Small configs exercising each family's options (dense layers, no q LoRA, biases, tied head).
TINY = {
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 64,
        "num_local_experts": 3,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "num_experts": 3,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 24,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    },
    "qwen2_moe_no_bias_tied": {
        "model_type": "qwen2_moe",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 64,
        "num_experts": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 16,
        "qkv_bias": False,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "vocab_size": 64,
        "num_experts": 3,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "mlp_only_layers": [0],
        "attention_bias": True,
    },
    "deepseek_v2": {
        "model_type": "deepseek_v2",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "vocab_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": 8,
        "first_k_dense_replace": 2,
        "q_lora_rank": 12,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "attention_bias": True,
    },
}


def published(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def parameter_count(spec: ModelSpec) -> int:
    return sum(p.numel for p in spec.params if not p.buffer)


def names_and_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name of ``spec`` (tied aliases included, as state dicts hold them) and its shape."""
    shapes = {p.name: tuple(p.shape) for p in spec.params}
    return {**shapes, **{alias: shapes[target] for alias, target in spec.aliases.items()}}


def transformers_model(config: dict, device: str = "meta"):
    """transformers' model for ``config`` (meta: shapes only), and its model type."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")}
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(hf_config)


# -- published configs ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_published_parameter_counts(name):
    spec = spec_from_hf_config(CONFIGS / f"{name}.json")
    assert spec.name == name
    assert parameter_count(spec) == PUBLISHED_COUNTS[name]
    assert spec.dtypes() == (["bfloat16", "float32"] if name == "DeepSeek-V3" else ["bfloat16"])


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_published_names_and_shapes_match_transformers(name):
    config = published(name)
    model = transformers_model(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_COUNTS[name]
    theirs = {k: tuple(v.shape) for k, v in checkpoint_state_dict(model.state_dict(), config["model_type"]).items()}
    assert names_and_shapes(spec_from_hf_config(config)) == theirs


def test_deepseek_v3_layout_of_published_config():
    spec = spec_from_hf_config(CONFIGS / "DeepSeek-V3.json")
    names = spec.by_name
    # 3 dense layers, 58 MoE layers of 256 experts, no multi-token-prediction layer 61.
    assert spec.num_layers == 61 and not any(n.startswith("model.layers.61.") for n in names)
    assert names["model.layers.2.mlp.down_proj.weight"].shape == (7168, 18432)
    assert "model.layers.2.mlp.gate.weight" not in names
    assert names["model.layers.3.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert names["model.layers.3.mlp.shared_experts.gate_proj.weight"].shape == (2048, 7168)
    bias = names["model.layers.60.mlp.gate.e_score_correction_bias"]
    assert (bias.shape, bias.dtype, bias.buffer, bias.tp_dim) == ((256,), "float32", True, None)
    assert sum(p.numel for p in spec.params if p.buffer) == 58 * 256
    prefix = "model.layers.0.self_attn."
    attention = {n[len(prefix) :]: p.shape for n, p in names.items() if n.startswith(prefix)}
    assert attention == {
        "q_a_proj.weight": (1536, 7168),
        "q_a_layernorm.weight": (1536,),
        "q_b_proj.weight": (128 * 192, 1536),
        "kv_a_proj_with_mqa.weight": (512 + 64, 7168),
        "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (128 * 256, 512),
        "o_proj.weight": (7168, 128 * 128),
    }


# -- small configs: every option against transformers -----------------------------------------


@pytest.mark.parametrize("case", sorted(TINY))
def test_tiny_names_and_shapes_match_transformers(case):
    config = TINY[case]
    model = transformers_model(config)
    theirs = {k: tuple(v.shape) for k, v in checkpoint_state_dict(model.state_dict(), config["model_type"]).items()}
    spec = spec_from_hf_config(config)
    assert names_and_shapes(spec) == theirs
    assert parameter_count(spec) == sum(p.numel() for p in model.parameters())
    assert all(p.layer == int(p.name.split(".")[2]) for p in spec.params if p.name.startswith("model.layers."))


def test_dense_and_sparse_layers():
    def moe(case: str) -> list[int]:
        spec = spec_from_hf_config(TINY[case])
        return sorted({p.layer for p in spec.params if p.name.endswith("mlp.gate.weight")})

    assert moe("qwen2_moe") == [1]  # step 2 -> layers 1, 3; layer 3 is in mlp_only_layers
    assert moe("qwen3_moe") == [1, 2]
    assert moe("deepseek_v2") == [1, 2]
    assert moe("deepseek_v3") == [2]


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_checkpoint_state_dict_is_transformers_revert(case):
    torch = pytest.importorskip("torch")
    from transformers.core_model_loading import revert_weight_conversion

    torch.manual_seed(0)
    config = TINY[case]
    model = transformers_model(config, device="cpu")
    state = model.state_dict()
    ours = checkpoint_state_dict(state, config["model_type"])
    theirs = revert_weight_conversion(model, dict(state))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert set(ours) == set(spec_from_hf_config(config).by_name)


def test_checkpoint_state_dict_gate_then_up_rows():
    np = pytest.importorskip("numpy")
    stacked = np.arange(2 * 6 * 4).reshape(2, 6, 4)
    out = checkpoint_state_dict(
        {"model.layers.5.mlp.experts.gate_up_proj": stacked, "model.layers.5.mlp.gate.weight": np.zeros((2, 4))},
        "mixtral",
    )
    assert (out["model.layers.5.block_sparse_moe.experts.1.w1.weight"] == stacked[1, :3]).all()
    assert (out["model.layers.5.block_sparse_moe.experts.1.w3.weight"] == stacked[1, 3:]).all()
    assert "model.layers.5.block_sparse_moe.gate.weight" in out
    with pytest.raises(ValueError, match="gate_up_proj rows 5"):
        checkpoint_state_dict({"model.layers.0.mlp.experts.gate_up_proj": np.zeros((2, 5, 4))}, "qwen3_moe")
    with pytest.raises(ValueError, match="model_type 'olmoe' is not one of"):
        checkpoint_state_dict({}, "olmoe")


# -- tensor parallel metadata ------------------------------------------------------------------


def test_tensor_parallel_rules():
    spec = spec_from_hf_config(CONFIGS / "DeepSeek-V3.json")
    p = spec.by_name
    rules = {
        name: (p[name].tp_dim, p[name].tp_unit)
        for name in (
            "model.layers.3.mlp.experts.7.gate_proj.weight",
            "model.layers.3.mlp.experts.7.up_proj.weight",
            "model.layers.3.mlp.experts.7.down_proj.weight",
            "model.layers.3.mlp.shared_experts.down_proj.weight",
            "model.layers.3.mlp.gate.weight",
            "model.layers.3.self_attn.q_a_proj.weight",
            "model.layers.3.self_attn.q_b_proj.weight",
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.3.self_attn.kv_b_proj.weight",
            "model.layers.3.self_attn.o_proj.weight",
            "model.layers.3.self_attn.kv_a_layernorm.weight",
        )
    }
    assert rules == {
        "model.layers.3.mlp.experts.7.gate_proj.weight": (0, 1),
        "model.layers.3.mlp.experts.7.up_proj.weight": (0, 1),
        "model.layers.3.mlp.experts.7.down_proj.weight": (1, 1),
        "model.layers.3.mlp.shared_experts.down_proj.weight": (1, 1),
        "model.layers.3.mlp.gate.weight": (None, 1),
        "model.layers.3.self_attn.q_a_proj.weight": (None, 1),
        "model.layers.3.self_attn.q_b_proj.weight": (0, 192),  # by heads of qk_nope + qk_rope
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (None, 1),
        "model.layers.3.self_attn.kv_b_proj.weight": (0, 256),  # by heads of qk_nope + v
        "model.layers.3.self_attn.o_proj.weight": (1, 128),  # by heads of v
        "model.layers.3.self_attn.kv_a_layernorm.weight": (None, 1),
    }
    lite = spec_from_hf_config(CONFIGS / "DeepSeek-V2-Lite.json").by_name
    q_proj = lite["model.layers.0.self_attn.q_proj.weight"]  # q_lora_rank null
    assert (q_proj.tp_dim, q_proj.tp_unit) == (0, 192)
    qwen2 = spec_from_hf_config(CONFIGS / "Qwen2-57B-A14B.json").by_name
    assert qwen2["model.layers.0.mlp.shared_expert_gate.weight"].tp_dim is None
    assert qwen2["model.layers.0.mlp.shared_expert.up_proj.weight"].tp_dim == 0
    assert qwen2["model.layers.0.self_attn.k_proj.bias"].replicate_units


def test_expert_shards_under_tp_and_pp():
    spec = spec_from_hf_config(TINY["deepseek_v3"])
    lay = Layout(spec, Topology(tp=2, pp=3))
    # The last stage holds layer 2 (MoE): rank tp=1 holds the second half of each expert's rows of
    # gate/up and columns of down, the whole router and bias, and heads 2..3 of q_b/kv_b/o.
    shards = {s.param: (s.offsets, s.sizes) for s in lay.shards_at(1, 2)}
    assert shards["model.layers.2.mlp.experts.3.gate_proj.weight"] == ((4, 0), (4, 32))
    assert shards["model.layers.2.mlp.experts.3.down_proj.weight"] == ((0, 4), (32, 4))
    assert shards["model.layers.2.mlp.gate.weight"] == ((0, 0), (4, 32))
    assert shards["model.layers.2.mlp.gate.e_score_correction_bias"] == ((0,), (4,))
    assert shards["model.layers.2.self_attn.q_b_proj.weight"] == ((2 * 12, 0), (2 * 12, 12))
    assert shards["model.layers.2.self_attn.kv_b_proj.weight"] == ((2 * 14, 0), (2 * 14, 16))
    assert shards["model.layers.2.self_attn.o_proj.weight"] == ((0, 2 * 6), (32, 2 * 6))
    assert not any(name.startswith("model.layers.1.") for name in shards)


# -- realloc plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, src, dst",
    [
        ("Mixtral-8x7B-v0.1", "tp=8", "tp=4,dp=2"),
        ("Qwen2-57B-A14B", "tp=4,dp=2", "tp=2,dp=4"),  # 28 heads: tp=8 does not divide them
        ("DeepSeek-V2-Lite", "tp=8", "tp=4,dp=2"),
    ],
)
def test_cli_plan_reports_parameter_count(name, src, dst, capsys):
    assert main(["plan", "--model", str(CONFIGS / f"{name}.json"), "--src", src, "--dst", dst, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["model_parameters"]) == (name, PUBLISHED_COUNTS[name])


@pytest.mark.parametrize("case", ["deepseek_v3", "qwen2_moe"])
def test_cli_plan_verifies_moving_a_small_moe(case, tmp_path, capsys):
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps(TINY[case]))
    argv = ["plan", "--model", str(path), "--src", "tp=2,pp=2", "--dst", "dp=2,tp=2", "--verify", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["verified"] is True


def test_cli_plan_refuses_tp_that_splits_a_head(capsys):
    assert main(["plan", "--model", str(CONFIGS / "Qwen2-57B-A14B.json"), "--src", "tp=8", "--dst", "dp=8"]) == 2
    assert "q_proj.weight: 28 units along dim 0 cannot be split 8 ways" in capsys.readouterr().err


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
        ({"n_shared_experts": 0}, r"'n_shared_experts' must be a positive integer, got 0"),
        ({"n_routed_experts": None}, r"'n_routed_experts' must be a positive integer, got None"),
        ({"first_k_dense_replace": -1}, r"'first_k_dense_replace' must be a non-negative integer"),
        ({"mlp_bias": True}, r"mlp_bias=true is not supported for deepseek_v2"),
        ({"q_lora_rank": 0}, r"'q_lora_rank' must be a positive integer, got 0"),
    ],
)
def test_deepseek_refusals(change, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config({**TINY["deepseek_v2"], **change})


def test_qwen_refusals():
    with pytest.raises(ValueError, match=r"'mlp_only_layers' must be a list of layer indices"):
        spec_from_hf_config({**TINY["qwen3_moe"], "mlp_only_layers": "0"})
    with pytest.raises(ValueError, match=r"'decoder_sparse_step' must be a positive integer"):
        spec_from_hf_config({**TINY["qwen2_moe"], "decoder_sparse_step": 0})
    with pytest.raises(ValueError, match=r"'qkv_bias' must be true or false"):
        spec_from_hf_config({**TINY["qwen2_moe"], "qkv_bias": 1})
