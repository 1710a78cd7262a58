"""HF export assembled on the workers, loaded back with transformers' ``from_pretrained``.

One local Ray instance (4 CPU slots) for the module; each test makes its own 4-worker group.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
import torch

ray = pytest.importorskip("ray")

from simulated import simulated_cluster

from actors import ModelGroup
from actors.driver.checkpoint import CheckpointManager
from actors.wire.zero_copy import sweep_stale_buffers
from realloc import Topology
from realloc.ckpt.hf import INDEX_FILE, SINGLE_FILE
from realloc.spec import decoder_spec, hf_config_of, spec_from_hf_config

TOKENS = torch.tensor([[1, 5, 9, 42, 77, 3, 0, 64]])


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    with simulated_cluster(nodes=1, cpus_per_node=4):  # as every Ray test module: its own cluster, torn down
        yield
    sweep_stale_buffers()


def llama(tied: bool):
    return decoder_spec(
        f"llama-gqa-{'tied' if tied else 'untied'}",
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        vocab=100,
        tied=tied,
        dtype="float32",
    )


def group_of(spec, topology, name, tmp_path):
    group = ModelGroup.create(spec, topology, name=name, timeout_s=60)
    return group, CheckpointManager(group, root=str(tmp_path / "ckpt"), run_id=name, factor=1)


def check_export(manager: CheckpointManager, out, group) -> dict:
    """Files, index and writers of the export in ``out``; returns the index's weight map."""
    spec, stats = group.spec, manager.last_hf_export
    names = {p.name for p in spec.params}
    per_tensor = Counter(t for f in stats.files for t in f["tensors"])
    assert set(per_tensor) == names and set(per_tensor.values()) == {1}  # each tensor by exactly one writer
    if len(stats.files) > 1:
        assert len({f["writer"] for f in stats.files}) > 1  # the workers wrote, not one process
    assert stats.bytes_local + stats.bytes_intra_node + stats.bytes_inter_node == spec.total_bytes()
    for f in stats.files:  # what the writers reported is on disk
        data = (out / f["name"]).read_bytes()
        assert len(data) == f["bytes"] and hashlib.sha256(data).hexdigest() == f["sha256"]
    if len(stats.files) == 1:
        assert not (out / INDEX_FILE).exists()
        return {t: SINGLE_FILE for t in names}
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == spec.total_bytes()
    assert index["weight_map"] == {t: f["name"] for f in stats.files for t in f["tensors"]}
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == sorted(f["name"] for f in stats.files)
    return index["weight_map"]


def check_loads(out, group):
    """transformers loads the directory as it is: no missing or unexpected keys, every tensor equal
    to the group's (bit-exact), and the same logits as a model given the group's weights by hand."""
    transformers = pytest.importorskip("transformers")
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, **{dtype_kw: torch.float32}
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys"), info
    expected = group.state_dict()  # test only: the driver assembles the model to compare
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    for name, t in expected.items():
        assert torch.equal(loaded[name], t.to(torch.float32)), name
    if group.spec.aliases:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(out), **{dtype_kw: torch.float32}
    )
    reference.load_state_dict({k: v.to(torch.float32) for k, v in expected.items()})
    model.eval(), reference.eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
        assert torch.isfinite(logits).all() and logits.abs().sum() > 0
        assert torch.equal(logits, reference(TOKENS).logits)


def check_files(out, group, weight_map: dict) -> None:
    """Every tensor in the files equals the group's (a cheaper check than loading a model)."""
    from safetensors.torch import load_file

    expected = group.state_dict()
    for file in sorted(set(weight_map.values())):
        for name, t in load_file(out / file).items():
            assert weight_map[name] == file and torch.equal(t, expected[name]), name


def test_untied_llama_from_two_layouts(tmp_path):
    spec = llama(tied=False)
    group, manager = group_of(spec, Topology(tp=2, pp=2), "hfx-untied", tmp_path)
    try:
        group.init_synthetic(5)
        max_bytes = spec.total_bytes() // 6
        first = tmp_path / "tp2pp2"
        written = manager.export_hf(first, max_shard_bytes=max_bytes)
        weight_map = check_export(manager, first, group)
        assert len(set(weight_map.values())) >= 3 and written[-1].name == INDEX_FILE
        assert json.loads((first / "config.json").read_text()) == hf_config_of(spec)
        assert not (first / "generation_config.json").exists()  # a derived config has no token ids
        check_loads(first, group)

        group.reallocate(Topology(dp=2, tp=2))
        second = tmp_path / "dp2tp2"
        manager.export_hf(second, max_shard_bytes=max_bytes)
        check_files(second, group, check_export(manager, second, group))
    finally:
        group.shutdown()


def test_tied_qwen2_from_its_config(tmp_path):
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 120,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 7,
        "eos_token_id": 8,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
    }
    spec = spec_from_hf_config(config, name="qwen2-mini")
    assert "model.layers.0.self_attn.q_proj.bias" in spec.by_name and spec.aliases
    group, manager = group_of(spec, Topology(dp=2, tp=2), "hfx-qwen2", tmp_path)
    try:
        group.init_synthetic(8)
        out = tmp_path / "out"
        manager.export_hf(out, max_shard_bytes=spec.total_bytes() // 4)
        weight_map = check_export(manager, out, group)
        assert "lm_head.weight" not in weight_map and len(set(weight_map.values())) >= 3
        assert json.loads((out / "config.json").read_text()) == config  # the config it came from
        generation = json.loads((out / "generation_config.json").read_text())
        assert generation == {"_from_model_config": True, "bos_token_id": 7, "eos_token_id": 8}
        check_loads(out, group)  # HF ties lm_head to the embedding it finds
        transformers = pytest.importorskip("transformers")
        assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 8

        with pytest.raises(ValueError, match="does not describe"):
            manager.export_hf(out, config={**config, "tie_word_embeddings": False})
        # Again into the same directory: two writers, then one file; the old shards and index go.
        group.init_synthetic(9)
        manager.export_hf(out, writers=2, generation_config={"eos_token_id": 8, "max_new_tokens": 5})
        assert sorted(p.name for p in out.glob("model*")) == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            INDEX_FILE,
        ]
        assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 5
        manager.export_hf(out)
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", SINGLE_FILE]
        assert manager.last_hf_export.writers == [manager.last_hf_export.files[0]["writer"]]  # one file, one writer
        check_files(out, group, check_export(manager, out, group))
    finally:
        group.shutdown()
