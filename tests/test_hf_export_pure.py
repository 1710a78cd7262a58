"""HF export without Ray: the config of a spec, the writer assignment, the file images."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import safetensors.torch
import torch

from realloc import ModelSpec, Placement, Topology
from realloc.ckpt.hf import INDEX_FILE, SINGLE_FILE, Arena, file_names, save_hf_dir, scan_hf_dir, split_files
from realloc.ckpt.hf_export import assign_writers
from realloc.layout import Layout
from realloc.spec import ParamSpec, decoder_spec, hf_config_of, spec_from_hf_config
from realloc.spec.hf_config import DERIVED_DEFAULTS, check_config_fits, generation_config_of

GQA = decoder_spec("gqa", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=100, dtype="float32")
QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 120,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 7,
    "eos_token_id": [8, 9],
    "rope_theta": 1e6,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}


# -- config.json ------------------------------------------------------------------------------


def test_derived_config_of_a_llama_spec():
    c = hf_config_of(GQA)
    assert c["model_type"] == "llama" and c["architectures"] == ["LlamaForCausalLM"]
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (64, 128, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (4, 2, 16, 100)
    assert c["tie_word_embeddings"] is False and c["attention_bias"] is False and c["torch_dtype"] == "float32"
    assert {k: c[k] for k in DERIVED_DEFAULTS} == DERIVED_DEFAULTS and c["max_position_embeddings"] == 2048
    assert generation_config_of(c) is None  # a derived config knows no token ids
    # The config describes exactly the spec's parameters.
    assert spec_from_hf_config(c).params == GQA.params


@pytest.mark.parametrize("name", ["tiny", "small", "qwen2.5-7b", "llama-70b"])
def test_derived_config_of_presets_round_trips(name):
    spec = ModelSpec.preset(name)
    c = hf_config_of(spec)
    back = spec_from_hf_config(c, norm_dtype=spec.param("model.norm.weight").dtype)
    assert back.params == spec.params and back.aliases == spec.aliases
    assert c["model_type"] == ("qwen2" if name.startswith("qwen") else "llama")
    assert "attention_bias" not in c if name.startswith("qwen") else c["attention_bias"] is False
    assert c["torch_dtype"] == "bfloat16"  # tiny keeps fp32 norms; the weights' dtype is the embedding's


def test_derived_config_of_qwen3_and_biases():
    qwen3 = decoder_spec(
        "q3", hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, vocab=50, head_dim=32, qk_norm=True, tied=True
    )
    c = hf_config_of(qwen3)
    assert (c["model_type"], c["head_dim"], c["tie_word_embeddings"], c["max_position_embeddings"]) == (
        "qwen3",
        32,
        True,
        32768,
    )
    assert spec_from_hf_config(c).params == qwen3.params
    llama_bias = spec_from_hf_config({**hf_config_of(GQA), "attention_bias": True, "mlp_bias": True})
    derived = hf_config_of(
        llama_bias.__class__(
            llama_bias.name,
            llama_bias.params,
            llama_bias.num_layers,
            dict(llama_bias.aliases),
            num_heads=4,
            num_kv_heads=2,
        )
    )
    assert (derived["model_type"], derived["attention_bias"], derived["mlp_bias"]) == ("llama", True, True)


def test_spec_remembers_its_hf_config_outside_equality():
    spec = spec_from_hf_config(QWEN2)
    assert spec.hf_config_json == json.dumps(QWEN2, sort_keys=True, separators=(",", ":"))
    plain = decoder_spec(
        spec.name, hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=120, qkv_bias=True, tied=True
    )
    assert plain.hf_config_json is None and plain == spec and hash(plain) == hash(spec)
    assert len(pickle.dumps(spec)) - len(pickle.dumps(plain)) < 2 * len(spec.hf_config_json)
    assert pickle.loads(pickle.dumps(spec)).hf_config_json == spec.hf_config_json
    c = hf_config_of(spec)
    assert {k: v for k, v in c.items() if k != "torch_dtype"} == {k: v for k, v in QWEN2.items() if k != "torch_dtype"}
    assert hf_config_of(spec_from_hf_config(QWEN2, dtype="float32"))["torch_dtype"] == "float32"  # what is written
    assert generation_config_of(c) == {"_from_model_config": True, "bos_token_id": 7, "eos_token_id": [8, 9]}
    # Biased llama specs (rebuilt by _with_biases) remember theirs too.
    biased = spec_from_hf_config({**hf_config_of(GQA), "attention_bias": True})
    assert json.loads(biased.hf_config_json)["attention_bias"] is True


def test_explicit_configs_are_checked_against_the_spec():
    assert check_config_fits(hf_config_of(GQA), GQA)["vocab_size"] == 100
    with pytest.raises(ValueError, match="does not describe model 'gqa'"):
        check_config_fits({**hf_config_of(GQA), "vocab_size": 101}, GQA)
    with pytest.raises(ValueError, match=r"only in model 'gqa' \['lm_head.weight'\]"):
        check_config_fits({**hf_config_of(GQA), "tie_word_embeddings": True}, GQA)
    with pytest.raises(ValueError, match="must be a dict"):
        check_config_fits("config.json", GQA)
    odd = ModelSpec("odd", (ParamSpec("w", (4, 4), "float32", "embed"),), 1)
    with pytest.raises(ValueError, match="not a Llama/Qwen2/Qwen3 decoder"):
        hf_config_of(odd)


def test_configs_are_valid_for_transformers():
    transformers = pytest.importorskip("transformers")
    for c in (
        hf_config_of(GQA),
        hf_config_of(ModelSpec.preset("qwen2.5-7b")),
        hf_config_of(spec_from_hf_config(QWEN2)),
    ):
        config = transformers.AutoConfig.for_model(**c)
        assert config.num_key_value_heads == c["num_key_value_heads"]
        assert config.tie_word_embeddings == c["tie_word_embeddings"]


# -- writer assignment ------------------------------------------------------------------------

CASES = [
    (GQA, Topology(tp=2, pp=2), Placement.blocks(4, 4), 40_000, None),
    (GQA, Topology(dp=2, tp=2), Placement.blocks(4, 2), 60_000, None),
    (ModelSpec.preset("tiny"), Topology(dp=2, tp=2, pp=2), Placement.blocks(8, 4), 100_000, None),
    (ModelSpec.preset("tiny"), Topology(dp=2, tp=2, pp=2), Placement.blocks(8, 4), 10**9, None),
    (ModelSpec.preset("tiny"), Topology(tp=4, pp=2), Placement.blocks(8, 2), 50_000, 3),
    (ModelSpec.preset("small"), Topology(dp=2, tp=4, pp=2), Placement.blocks(16, 8), 10_000_000, None),
]


@pytest.mark.parametrize("spec,topology,placement,max_bytes,writers", CASES)
def test_writer_assignment_invariants(spec, topology, placement, max_bytes, writers):
    layout = Layout(spec, topology)
    a = assign_writers(layout, placement, max_bytes, writers)
    assert a == assign_writers(layout, placement, max_bytes, writers)  # deterministic
    written = [t for f in a.files for t in f.tensors]
    assert sorted(written) == sorted(p.name for p in spec.params)  # every storage tensor once, no tied alias
    assert not set(spec.aliases) & set(written)
    for f in a.files:  # the cap holds, except for a tensor larger than it alone
        assert f.nbytes <= max_bytes or len(f.tensors) == 1
        assert f.nbytes == sum(spec.param(t).nbytes for t in f.tensors)
        order = [p.name for p in spec.params if p.name in f.tensors]
        assert list(f.tensors) == order  # spec order inside a file
    assert [f.name for f in a.files] == file_names(len(a.files))
    total = spec.total_bytes()
    count = writers or min(topology.world_size, math.ceil(total / max_bytes))
    assert len(a.writers) == min(count, topology.world_size)
    largest = max(p.nbytes for p in spec.params)
    assert max(a.loads().values()) <= total / len(a.writers) + largest  # the LPT bound
    # A writer cuts its own tensors into files: never more files than a writer needs.
    for w in a.writers:
        mine = [(t, spec.param(t).nbytes) for f in a.files_of(w) for t in f.tensors]
        assert len(a.files_of(w)) == len(split_files(mine, max_bytes))
    # needs: each writer needs exactly its whole tensors
    needs = {g.workers: {p for p, _, _ in g.pieces} for g in a.needs()}
    assert needs == {(w,): {t for f in a.files_of(w) for t in f.tensors} for w in a.writers}


def test_writers_prefer_holders_and_spread_over_nodes():
    spec = GQA
    # pp=2 on two workers: each stage's tensors are held whole by one worker; two writers write
    # what they hold, whatever balance allows.
    layout = Layout(spec, Topology(pp=2))
    a = assign_writers(layout, Placement.blocks(2, 1), max_shard_bytes=10**9, writers=2)
    stage_of = {s.param: r for r in range(2) for s in layout.shards(r)}
    local = sum(spec.param(t).nbytes for t, w in a.writer_of.items() if stage_of[t] == w)
    assert local >= 0.7 * spec.total_bytes()
    assert a.writer_of["model.embed_tokens.weight"] == 0 and a.writer_of["lm_head.weight"] == 1
    # dp=2 replicas on two nodes, each holds everything: the two writers sit on different nodes.
    placement = Placement(("a", "a", "b", "b"))
    b = assign_writers(Layout(spec, Topology(dp=4)), placement, max_shard_bytes=10**9, writers=2)
    assert {placement.nodes[w] for w in b.writers} == {"a", "b"}


def test_one_file_when_the_model_fits():
    a = assign_writers(Layout(GQA, Topology(tp=2, pp=2)), Placement.blocks(4, 4), max_shard_bytes=10**9)
    assert len(a.writers) == 1 and [f.name for f in a.files] == [SINGLE_FILE]


def test_bad_assignment_arguments():
    layout = Layout(GQA, Topology(tp=2))
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive integer"):
        assign_writers(layout, Placement.blocks(2, 2), 0)
    with pytest.raises(ValueError, match="writers must be a positive integer"):
        assign_writers(layout, Placement.blocks(2, 2), 100, writers=0)
    with pytest.raises(ValueError, match="placement has 1 workers"):
        assign_writers(layout, Placement.blocks(1, 1), 100)


# -- file images -------------------------------------------------------------------------------


def test_arena_files_are_safetensors_with_tensors_in_place():
    g = torch.Generator().manual_seed(0)
    files = [
        ("a.safetensors", [("x", (3, 5), "bfloat16"), ("y", (7,), "float32"), ("z", (1, 3), "float16")]),
        ("b.safetensors", [("u", (5,), "bfloat16"), ("v", (2, 2), "float64")]),
    ]
    tensors = {n: torch.randn(shape, generator=g).to(getattr(torch, d)) for _, es in files for n, shape, d in es}
    arena = Arena.plan(files, {"format": "pt", "k": "v"})
    data, store = arena.allocate()
    for name, t in tensors.items():
        store.write(name, (0,) * t.dim(), tuple(t.shape), t)
    for i, (_fname, entries) in enumerate(files):
        raw = arena.file_bytes(data, i).numpy().tobytes()
        assert arena.files[i].start % 8 == 0
        loaded = safetensors.torch.load(raw)
        assert sorted(loaded) == sorted(n for n, _, _ in entries)
        for n in loaded:
            assert loaded[n].dtype == tensors[n].dtype and torch.equal(loaded[n], tensors[n])
        # The same tensors serialised by safetensors itself give the same bytes after the header.
        reference = safetensors.torch.save({n: tensors[n] for n, _, _ in entries})
        ref_head = 8 + int.from_bytes(reference[:8], "little")
        own_head = 8 + int.from_bytes(raw[:8], "little")
        assert raw[own_head:] == reference[ref_head:]


def test_save_hf_dir_shares_naming_index_and_clean_up(tmp_path):
    state = {f"w{i}": torch.full((10, 10), float(i)) for i in range(5)}  # 400 bytes each
    written = save_hf_dir(state, tmp_path, max_shard_bytes=800, extra={"config.json": {"a": 1}})
    names = [p.name for p in written]
    assert names == file_names(3) + ["config.json", INDEX_FILE]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 2000 and index["weight_map"]["w4"] == "model-00003-of-00003.safetensors"
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1}
    save_hf_dir(state, tmp_path, max_shard_bytes=1200)  # fewer files: the old ones go
    assert sorted(p.name for p in tmp_path.glob("model*")) == file_names(2) + [INDEX_FILE]
    save_hf_dir(state, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == [SINGLE_FILE]
    assert set(scan_hf_dir(tmp_path)) == set(state)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        save_hf_dir({"i": torch.zeros(2, dtype=torch.int64)}, tmp_path)


def test_a_bf16_export_of_a_block_fp8_models_config_declares_no_quantization(tmp_path):
    """A spec made from a block-FP8 HF config holds the model's dtypes (bf16), and so does its
    export: the config written beside the weights must not keep the source's
    ``quantization_config``, or transformers reads the bf16 weights as quantized ones and this
    project's own import refuses the directory. It used to keep it (found in review, 2026-11-28)."""
    from realloc.ckpt.hf import CONFIG_FILE, check_declared_format, export_state, save_hf_dir, scan_hf_dir
    from realloc.shards.synthetic import synthetic_state_dict

    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    source = {**hf_config_of(GQA), "torch_dtype": "bfloat16", "quantization_config": fp8}
    spec = spec_from_hf_config(source)
    assert spec.weight_format is None
    config = hf_config_of(spec)
    assert "quantization_config" not in config and {**config, "quantization_config": fp8} == source
    save_hf_dir(export_state(synthetic_state_dict(spec), spec), tmp_path, extra={CONFIG_FILE: config})
    check_declared_format(tmp_path, scan_hf_dir(tmp_path), spec)  # read back as what it is
