"""Specs built from HF ``config.json`` files against shapes and counts worked out by hand.

Configs below are the published ones (trimmed to the fields that shape the weights). Expected
shapes follow from the HF modelling code: q is ``heads * head_dim`` rows, k/v ``kv_heads *
head_dim`` rows, o the transpose of q, MLP ``intermediate x hidden``; Qwen2 adds q/k/v biases,
Qwen3 adds per-head q/k RMSNorm weights of ``head_dim``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from realloc.layout import Layout, Topology
from realloc.spec import ModelSpec, spec_from_hf_config

LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}
QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def count(spec: ModelSpec) -> int:
    return sum(p.numel for p in spec.params)


def layer_shapes(spec: ModelSpec, layer: int = 0) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{layer}."
    return {p.name[len(prefix) :]: p.shape for p in spec.params if p.name.startswith(prefix)}


def write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


# -- llama ----------------------------------------------------------------------------------


def test_llama3_gqa_shapes_and_count():
    spec = spec_from_hf_config(LLAMA3_8B)
    assert layer_shapes(spec) == {
        "input_layernorm.weight": (4096,),
        "self_attn.q_proj.weight": (4096, 4096),
        "self_attn.k_proj.weight": (1024, 4096),  # 8 kv heads x 128
        "self_attn.v_proj.weight": (1024, 4096),
        "self_attn.o_proj.weight": (4096, 4096),
        "post_attention_layernorm.weight": (4096,),
        "mlp.gate_proj.weight": (14336, 4096),
        "mlp.up_proj.weight": (14336, 4096),
        "mlp.down_proj.weight": (4096, 14336),
    }
    assert spec.param("model.embed_tokens.weight").shape == (128256, 4096)
    assert spec.param("lm_head.weight").shape == (128256, 4096)
    assert spec.aliases == {}
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads) == (32, 32, 8)
    assert spec.dtypes() == ["bfloat16"]
    per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096
    assert count(spec) == 2 * 128256 * 4096 + 32 * per_layer + 4096
    assert count(spec) == pytest.approx(8.03e9, abs=0.005e9)  # Meta's "8.03B"


def test_llama_without_kv_heads_is_multi_head():
    config = dict(LLAMA3_8B)
    del config["num_key_value_heads"]
    spec = spec_from_hf_config(config)
    assert spec.num_kv_heads == 32
    assert spec.param("model.layers.0.self_attn.k_proj.weight").shape == (4096, 4096)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("kv_heads", ["absent", None, 4])
def test_kv_heads_a_config_leaves_out_are_the_transformers_class_default(model_type, kv_heads):
    """transformers' own config classes are the oracle (the model they build is the checkpoint's):
    Mistral defaults ``num_key_value_heads`` to 8 and Qwen2/Qwen3 to 32, while an explicit null is
    one per attention head (``__post_init__``). The spec read 16 kv heads (one per head) for every
    config that left the field out, so k/v had other shapes than the model's."""
    transformers = pytest.importorskip("transformers")
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    config = dict(model_type=model_type, hidden_size=128, intermediate_size=256, num_hidden_layers=1)
    config.update(num_attention_heads=64, vocab_size=100, head_dim=2)
    if kv_heads != "absent":
        config["num_key_value_heads"] = kv_heads
    fields = {k: v for k, v in config.items() if k != "model_type"}
    if model_type == "mistral" and kv_heads is None:
        pytest.skip("transformers' MistralConfig refuses an explicit null num_key_value_heads (typed int)")
    want = getattr(transformers, classes[model_type])(**fields)
    spec = spec_from_hf_config(config)
    assert spec.num_kv_heads == want.num_key_value_heads
    assert spec.param("model.layers.0.self_attn.k_proj.weight").shape == (want.num_key_value_heads * 2, 128)


def test_one_table_of_config_defaults_is_transformers_own_for_every_model_type_read():
    """``CONFIG_DEFAULTS`` (realloc/spec/_hf_fields.py) is the one table of transformers' config
    class defaults the dense and the MoE spec builders read (two tables once held parts of it):
    every field it gives is the class's own default, for every model type the builders read."""
    transformers = pytest.importorskip("transformers")
    from realloc.spec._hf_fields import CONFIG_DEFAULTS
    from realloc.spec.hf_config import SUPPORTED_MODEL_TYPES
    from realloc.spec.moe import MOE_MODEL_TYPES

    assert sorted(CONFIG_DEFAULTS) == sorted(SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES)
    for model_type, fields in CONFIG_DEFAULTS.items():
        made = transformers.AutoConfig.for_model(model_type)
        for key, value in fields.items():
            if key == "num_key_value_heads" and value is None:  # one per head, as __post_init__ sets it
                value = made.num_attention_heads
            assert getattr(made, key) == value, (model_type, key, value, getattr(made, key))


def test_kv_heads_that_do_not_divide_the_heads_say_whether_the_config_set_them():
    """The message of a kv-head count that does not divide the heads says when the count is
    transformers' default for a config that left it out, not a value the config holds."""
    config = dict(model_type="mistral", hidden_size=96, intermediate_size=256, num_hidden_layers=1)
    config.update(num_attention_heads=12, vocab_size=100)
    with pytest.raises(ValueError, match=r"num_key_value_heads=8 \(transformers' default for mistral: the config"):
        spec_from_hf_config(config)
    with pytest.raises(ValueError, match=r"num_key_value_heads=5$"):
        spec_from_hf_config({**config, "num_key_value_heads": 5})


def test_llama_attention_and_mlp_bias():
    spec = spec_from_hf_config({**LLAMA3_8B, "num_hidden_layers": 1, "attention_bias": True, "mlp_bias": True})
    shapes = layer_shapes(spec)
    assert shapes["self_attn.q_proj.bias"] == (4096,)
    assert shapes["self_attn.k_proj.bias"] == (1024,)
    assert shapes["self_attn.o_proj.bias"] == (4096,)
    assert shapes["mlp.gate_proj.bias"] == (14336,)
    assert shapes["mlp.down_proj.bias"] == (4096,)
    # Row-parallel biases are added after the all-reduce: whole on every tp rank.
    assert spec.param("model.layers.0.self_attn.o_proj.bias").tp_dim is None
    assert spec.param("model.layers.0.mlp.down_proj.bias").tp_dim is None
    assert spec.param("model.layers.0.mlp.up_proj.bias").tp_dim == 0
    names = [p.name for p in spec.params]
    assert (
        names.index("model.layers.0.self_attn.o_proj.bias") == names.index("model.layers.0.self_attn.o_proj.weight") + 1
    )
    lay = Layout(spec, Topology(tp=4))
    up = [s for s in lay.shards(3) if s.param == "model.layers.0.mlp.up_proj.bias"]
    assert [(s.offsets, s.sizes) for s in up] == [((3 * 3584,), (3584,))]


# -- mistral --------------------------------------------------------------------------------


def test_mistral_7b():
    spec = spec_from_hf_config(MISTRAL_7B)
    shapes = layer_shapes(spec)
    assert shapes["self_attn.k_proj.weight"] == (1024, 4096)
    assert "self_attn.q_proj.bias" not in shapes
    assert spec.param("lm_head.weight").shape == (32000, 4096)
    assert count(spec) == pytest.approx(7.24e9, abs=0.005e9)  # Mistral's "7.24B"


def test_mistral_explicit_head_dim():
    # Mistral-NeMo: 32 heads of 128 although 5120 / 32 = 160.
    spec = spec_from_hf_config({**MISTRAL_7B, "hidden_size": 5120, "head_dim": 128, "num_hidden_layers": 2})
    shapes = layer_shapes(spec)
    assert shapes["self_attn.q_proj.weight"] == (4096, 5120)
    assert shapes["self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["self_attn.o_proj.weight"] == (5120, 4096)
    assert spec.param("model.layers.0.self_attn.q_proj.weight").tp_unit == 128


# -- qwen2 ----------------------------------------------------------------------------------


def test_qwen2_bias_and_tied_embeddings():
    spec = spec_from_hf_config(QWEN25_05B)
    shapes = layer_shapes(spec)
    assert shapes["self_attn.q_proj.weight"] == (896, 896)
    assert shapes["self_attn.k_proj.weight"] == (128, 896)  # 2 kv heads x 64
    assert shapes["self_attn.q_proj.bias"] == (896,)
    assert shapes["self_attn.k_proj.bias"] == (128,)
    assert shapes["self_attn.v_proj.bias"] == (128,)
    assert "self_attn.o_proj.bias" not in shapes
    assert spec.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in spec.by_name
    per_layer = 2 * 896 * 896 + 896 + 2 * (128 * 896 + 128) + 3 * 4864 * 896 + 2 * 896
    assert count(spec) == 151936 * 896 + 24 * per_layer + 896 == 494_032_768  # Qwen's "0.49B"


def test_qwen2_kv_bias_replicates_with_kv_heads():
    config = {
        **QWEN25_05B,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 1000,
    }
    lay = Layout(spec_from_hf_config(config), Topology(tp=8, pp=2))
    # tp=8 > 2 kv heads of 32: ranks 0..3 hold kv head 0, ranks 4..7 kv head 1 (bias included).
    bias = {tp: [s for s in lay.shards_at(tp, 0) if s.param.endswith("0.self_attn.k_proj.bias")][0] for tp in (3, 4)}
    assert (bias[3].offsets, bias[3].sizes) == ((0,), (32,))
    assert (bias[4].offsets, bias[4].sizes) == ((32,), (32,))
    # The tied head sits on the last stage as its own copy of the embedding.
    head = [s for s in lay.shards_at(0, 1) if s.slot == "lm_head.weight"]
    assert [s.param for s in head] == ["model.embed_tokens.weight"]


# -- qwen3 ----------------------------------------------------------------------------------


def test_qwen3_head_dim_and_qk_norm():
    spec = spec_from_hf_config(QWEN3_06B)
    shapes = layer_shapes(spec)
    # head_dim 128 != 1024 / 16 = 64: q is 16 x 128 rows, o its transpose.
    assert shapes["self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["self_attn.k_proj.weight"] == (1024, 1024)
    assert shapes["self_attn.o_proj.weight"] == (1024, 2048)
    assert shapes["self_attn.q_norm.weight"] == (128,)
    assert shapes["self_attn.k_norm.weight"] == (128,)
    assert not any(name.endswith(".bias") for name in shapes)
    assert spec.param("model.layers.0.self_attn.q_norm.weight").tp_dim is None
    non_embedding = count(spec) - 151936 * 1024
    per_layer = 2048 * 1024 + 2 * 1024 * 1024 + 1024 * 2048 + 3 * 3072 * 1024 + 2 * 1024 + 2 * 128
    assert non_embedding == 28 * per_layer + 1024
    assert non_embedding == pytest.approx(0.44e9, abs=0.005e9)  # Qwen's "0.44B non-embedding"


def test_qwen3_default_head_dim_is_transformers_default():
    config = {**QWEN3_06B, "num_hidden_layers": 1}
    del config["head_dim"]
    assert spec_from_hf_config(config).param("model.layers.0.self_attn.q_proj.weight").shape == (16 * 128, 1024)


def test_qwen3_attention_bias():
    spec = spec_from_hf_config({**QWEN3_06B, "num_hidden_layers": 1, "attention_bias": True})
    shapes = layer_shapes(spec)
    assert shapes["self_attn.q_proj.bias"] == (2048,)
    assert shapes["self_attn.o_proj.bias"] == (1024,)


# -- dtypes, names, sources -----------------------------------------------------------------


def test_dtypes():
    assert spec_from_hf_config({**MISTRAL_7B, "torch_dtype": "float16"}).dtypes() == ["float16"]
    assert spec_from_hf_config({**MISTRAL_7B, "torch_dtype": None}).dtypes() == ["bfloat16"]
    assert spec_from_hf_config({**MISTRAL_7B, "dtype": "float32", "torch_dtype": None}).dtypes() == ["float32"]
    assert spec_from_hf_config(MISTRAL_7B, dtype="float32").dtypes() == ["float32"]
    spec = spec_from_hf_config(QWEN3_06B, norm_dtype="float32")
    assert spec.param("model.layers.3.self_attn.k_norm.weight").dtype == "float32"
    assert spec.param("model.norm.weight").dtype == "float32"
    assert spec.param("model.layers.3.self_attn.k_proj.weight").dtype == "bfloat16"


def test_from_file_and_directory(tmp_path):
    path = write_config(tmp_path / "Qwen2.5-0.5B", QWEN25_05B)
    from_dict = spec_from_hf_config(QWEN25_05B)
    for source in (path, str(path), path.parent, str(path.parent)):
        spec = spec_from_hf_config(source)
        assert spec.params == from_dict.params
        assert spec.aliases == from_dict.aliases
        assert spec.name == "Qwen2.5-0.5B"
    assert spec_from_hf_config(path, name="policy").name == "policy"


def test_name_from_config_and_the_package_entry_point():
    import realloc

    spec = realloc.spec_from_hf_config({**MISTRAL_7B, "_name_or_path": "mistralai/Mistral-7B-v0.1"})
    assert spec.name == "mistralai/Mistral-7B-v0.1"
    assert spec_from_hf_config(MISTRAL_7B).name == "mistral"
    assert not hasattr(ModelSpec, "from_hf_config"), "one spelling: spec_from_hf_config"


# -- presets against published parameter counts ----------------------------------------------

# Published counts are rounded to the digits shown; the tolerance is half a unit of the last
# digit, the widest error that rounding can explain.
PUBLISHED = {
    "llama-7b": (6.74e9, 0.005e9),
    "llama-70b": (68.98e9, 0.005e9),
    "qwen2.5-7b": (7.62e9, 0.005e9),
    "qwen2.5-72b": (72.7e9, 0.05e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    expected, tolerance = PUBLISHED[name]
    assert count(ModelSpec.preset(name)) == pytest.approx(expected, abs=tolerance)


def test_preset_matches_equivalent_hf_config():
    config = {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    assert spec_from_hf_config(config).params == ModelSpec.preset("qwen2.5-7b").params


# -- mixture-of-experts (details in test_moe_spec.py) ---------------------------------------


MIXTRAL_TINY = {**MISTRAL_7B, "model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 8}


def test_supported_moe_model_types_are_accepted():
    spec = spec_from_hf_config(MIXTRAL_TINY)
    moe = {
        k: v
        for k, v in layer_shapes(spec).items()
        if k.startswith(("block_sparse_moe.gate.", "block_sparse_moe.experts.7."))
    }
    assert moe == {
        "block_sparse_moe.gate.weight": (8, 4096),
        "block_sparse_moe.experts.7.w1.weight": (14336, 4096),
        "block_sparse_moe.experts.7.w3.weight": (14336, 4096),
        "block_sparse_moe.experts.7.w2.weight": (4096, 14336),
    }
    assert not any(name.startswith("mlp.") for name in layer_shapes(spec))
    assert count(spec) == 32000 * 4096 * 2 + 4096 + (
        2 * 4096 * 4096 + 2 * 1024 * 4096 + 2 * 4096 + 8 * 4096 + 8 * 3 * 14336 * 4096
    )


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {**LLAMA3_8B, "model_type": "olmoe"},
            r"model_type 'olmoe' is a mixture-of-experts model, which is not supported; "
            r"supported dense decoders: llama, mistral, qwen2, qwen3; supported mixture-of-experts: mixtral, qwen2_moe, "
            r"qwen3_moe, deepseek_v2, deepseek_v3",
        ),
        ({**LLAMA3_8B, "model_type": "dbrx"}, r"'dbrx' is a mixture-of-experts model, which is not supported"),
        (
            {**LLAMA3_8B, "num_local_experts": 8},
            r"num_local_experts=8 makes this a mixture-of-experts model, but "
            r"model_type 'llama' has no experts",
        ),
        ({**QWEN3_06B, "num_experts": 128}, r"num_experts=128 makes this a mixture-of-experts model"),
    ],
)
def test_unsupported_moe_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        spec_from_hf_config(config)


def test_moe_name_from_config_file_stem(tmp_path):
    path = tmp_path / "Mixtral-tiny.json"
    path.write_text(json.dumps(MIXTRAL_TINY))
    assert spec_from_hf_config(path).name == "Mixtral-tiny"
    assert spec_from_hf_config(write_config(tmp_path / "ckpt", MIXTRAL_TINY)).name == "ckpt"
