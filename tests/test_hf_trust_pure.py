"""HF import and export at the edges a user touches, without Ray: dtype kinds, tied pairs, files
that change under an import, exports that must never destroy the one before.

The Ray-level counterparts (through ``CheckpointManager``) are in ``test_hf_trust_ray.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from realloc import Topology
from realloc.ckpt.errors import CheckpointError
from realloc.ckpt.hf import INDEX_FILE, check_ties, export_state, load_shards, match_spec, save_hf_dir, scan_hf_dir
from realloc.layout import Layout
from realloc.shards import ShardStore, allocate_buffers
from realloc.shards.synthetic import synthetic_state_dict
from realloc.spec import decoder_spec, hf_config_of

TIED = decoder_spec(
    "tied-llama", hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, vocab=64, tied=True, dtype="float32"
)
BF16 = decoder_spec("bf16-llama", hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, vocab=64, dtype="bfloat16")


def test_integer_tensors_are_refused_for_float_parameters(tmp_path):
    """An int8 export (quantized values, scales elsewhere) never lands in bf16 parameters as numbers."""
    state = export_state(synthetic_state_dict(BF16, 0), BF16)
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = torch.randint(-128, 127, state[name].shape, dtype=torch.int8)
    save_hf_dir(state, tmp_path)
    with pytest.raises(ValueError, match=rf"{name} is int8, the model's {name} is bfloat16.*never int values"):
        match_spec(scan_hf_dir(tmp_path), BF16)


def test_float_widths_still_cast_and_floats_never_become_integers(tmp_path):
    state = export_state(synthetic_state_dict(BF16, 0), BF16)
    save_hf_dir({n: t.float() for n, t in state.items()}, tmp_path)  # an fp32 export of a bf16 model
    assert len(match_spec(scan_hf_dir(tmp_path), BF16)) == len(BF16.params)
    ints = decoder_spec("u8", hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, vocab=64, dtype="uint8")
    with pytest.raises(ValueError, match="never float values into uint ones"):
        match_spec(scan_hf_dir(tmp_path), ints)


def _untied_checkpoint(path: Path, same: bool) -> dict[str, torch.Tensor]:
    state = export_state(synthetic_state_dict(TIED, 1), TIED)
    head = state["model.embed_tokens.weight"].clone()
    if not same:
        head[3, 5] += 1.0  # one element differs: untied
    state["lm_head.weight"] = head
    save_hf_dir(state, path, extra={"config.json": hf_config_of(TIED)})
    return state


def test_transformers_loads_an_untied_checkpoint_untied_so_a_tied_import_is_refused(tmp_path):
    """The engine first: transformers 5, told ``tie_word_embeddings=True``, keeps both tensors of
    a checkpoint that holds them with different values. A tied spec cannot hold both: refused."""
    transformers = pytest.importorskip("transformers")
    state = _untied_checkpoint(tmp_path, same=False)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    if int(transformers.__version__.split(".")[0]) >= 5:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        loaded = model.state_dict()
        assert torch.equal(loaded["lm_head.weight"], state["lm_head.weight"])
        assert torch.equal(loaded["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
        assert not torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    tensors = scan_hf_dir(tmp_path)
    match_spec(tensors, TIED)  # the headers fit
    with pytest.raises(ValueError, match="holds both 'model.embed_tokens.weight'.*'lm_head.weight'.*they differ"):
        check_ties(tmp_path, tensors, TIED, chunk_bytes=1000)  # small chunks: the difference is in a later one


def test_byte_equal_tied_pairs_import_as_one_tensor(tmp_path):
    _untied_checkpoint(tmp_path, same=True)
    tensors = scan_hf_dir(tmp_path)
    check_ties(tmp_path, tensors, TIED, chunk_bytes=1000)
    assert match_spec(tensors, TIED)["model.embed_tokens.weight"] == "model.embed_tokens.weight"


def test_a_file_replaced_after_the_scan_is_caught_by_the_reader(tmp_path):
    """The driver scans headers; a worker must check that what it reads is still that."""
    state = export_state(synthetic_state_dict(BF16, 0), BF16)
    save_hf_dir(state, tmp_path)
    tensors = scan_hf_dir(tmp_path)
    mapping = match_spec(tensors, BF16)
    name = "model.layers.0.mlp.down_proj.weight"
    bigger = dict(state)
    bigger[name] = torch.ones(state[name].shape[0] + 8, state[name].shape[1], dtype=torch.bfloat16)
    save_file(bigger, str(tmp_path / "model.safetensors"))  # every box of the old shape still slices
    layout = Layout(BF16, Topology(tp=2))
    store = ShardStore(layout.shards(0), allocate_buffers(layout, 0))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is \(40, 64\) bfloat16 now, but was \(32, 64\)"):
        load_shards(tmp_path, tensors, mapping, layout.shards(0), store)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="could not be read as scanned"):
        load_shards(tmp_path, tensors, mapping, layout.shards(0), store)


def test_a_save_that_fills_the_disk_keeps_the_previous_export(small_disk):
    out = small_disk / "export"
    state = export_state(synthetic_state_dict(TIED, 0), TIED)  # ~90 KB
    save_hf_dir(state, out, max_shard_bytes=30_000, extra={"config.json": {"v": 1}})
    (out / "tokenizer.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    big = {"w": torch.ones(1_000_000)}  # 4 MB: cannot fit
    with pytest.raises(CheckpointError, match=r"No space left on device.*free space.*before is unchanged"):
        save_hf_dir(big, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["export"]  # no staging left behind
    save_hf_dir(state, out, extra={"config.json": {"v": 2}})  # a good export replaces it, the tokenizer stays
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not (out / INDEX_FILE).exists()


def test_a_read_only_directory_and_a_file_path_are_named(small_disk, tmp_path):
    state = {"w": torch.zeros(4)}
    save_hf_dir(state, small_disk / "export")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(CheckpointError, match=r"export' failed: Read-only file system.*choose a writable directory"):
        save_hf_dir(state, small_disk / "export")
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        save_hf_dir(state, afile)
    assert afile.read_text() == "x"
