"""Every bad input gets a ValueError (or, on the command line, exit 2 and one line) naming the problem."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pytest

from realloc.layout import Group, Layout, Topology
from realloc.plan import Bandwidths, Placement, Plan, plan_exchange, plan_reallocation
from realloc.spec import ModelSpec, ParamSpec, spec_from_hf_config
from realloc_tools.offline.plan import main

TINY = ModelSpec.preset("tiny")
LLAMA_7B = ModelSpec.preset("llama-7b")
LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
}
W = {"w": ((8, 4), "float32")}  # a one-parameter table for the planner


def one(w: tuple[int, ...], offsets=(0, 0), sizes=(8, 4), param="w") -> Group:
    return Group(w, ((param, offsets, sizes),))


def config_with(**changes) -> dict:
    config = dict(LLAMA_CONFIG, **changes)
    return {k: v for k, v in config.items() if v is not ...}


def blend(eta: float) -> None:
    import torch

    from realloc.shards import blend_into

    blend_into({"float32": torch.zeros(4)}, {"float32": torch.ones(4)}, eta)


CASES: list[tuple[str, Callable[[], object], str]] = [
    # topology strings and values
    ("dp=0", lambda: Topology.parse("dp=0"), r"dp must be a positive integer, got 0"),
    ("tp=-1", lambda: Topology.parse("tp=-1"), r"tp must be a positive integer, got -1"),
    ("empty part", lambda: Topology.parse("dp=2,,tp=2"), r"bad topology part ''"),
    ("unknown dim", lambda: Topology.parse("xx=2"), r"bad topology part 'xx=2'.*dp=N, tp=N or pp=N"),
    ("dim twice", lambda: Topology.parse("dp=2,dp=3"), r"gives dp twice"),
    ("empty string", lambda: Topology.parse(""), r"topology string is empty"),
    ("word size", lambda: Topology.parse("dp=two"), r"bad topology part 'dp=two'"),
    ("zero pp", lambda: Topology(pp=0), r"pp must be a positive integer, got 0"),
    ("float tp", lambda: Topology(tp=2.0), r"tp must be a positive integer, got 2.0"),
    (
        "unknown pp_split",
        lambda: Topology(pp=2, pp_split="even"),
        r"unknown pp_split 'even'; allowed: vllm, megatron, balanced",
    ),
    (
        "pp_split not a string",
        lambda: Topology(pp=2, pp_split=3),
        r"topology pp_split must be a string naming a rule \(vllm, megatron, balanced\), got 3",
    ),
    ("pp_split None", lambda: Topology(pp_split=None), r"pp_split must be a string naming a rule .*got None"),
    (
        "parse unknown pp_split",
        lambda: Topology.parse("dp=2,pp=4,pp_split=Balanced"),
        r"unknown pp_split 'Balanced'; allowed: vllm, megatron, balanced",
    ),
    ("parse empty pp_split", lambda: Topology.parse("pp=2,pp_split="), r"bad topology part 'pp_split='"),
    ("pp_split twice", lambda: Topology.parse("pp=2,pp_split=vllm,pp_split=balanced"), r"gives pp_split twice"),
    (
        "parse bad layer_split",
        lambda: Topology.parse("pp=2,layer_split=2/x"),
        r"bad topology part 'layer_split=2/x'.*layer_split=A/B/\.\.\.",
    ),
    ("parse comma layer_split", lambda: Topology.parse("pp=2,layer_split=2,2"), r"bad topology part '2'"),
    (
        "parse short layer_split",
        lambda: Topology.parse("pp=3,layer_split=2/2"),
        r"layer_split \(2, 2\) has 2 stages but pp=3",
    ),
    ("bool in layer_split", lambda: Topology(pp=2, layer_split=(True, 3)), r"every stage needs at least one layer"),
    (
        "megatron uneven",
        lambda: Layout(TINY, Topology(pp=3, pp_split="megatron")),
        r"tiny: pp_split='megatron' needs pp to divide the layer count, but 4 layers do not split evenly over pp=3; "
        r"give the stages explicitly with layer_split .*e.g. layer_split=1/2/1",
    ),
    # what the model can take
    ("tp=5 on 32 heads", lambda: Layout(LLAMA_7B, Topology(tp=5)), r"tp=5 does not fit llama-7b: .*32 units"),
    (
        "tp=3 on 2 kv heads",
        lambda: Layout(TINY, Topology(tp=3)),
        r"k_proj.weight: 2 units .* cannot be split 3 ways \(tp must be a divisor or a multiple of 2\)",
    ),
    ("pp > layers", lambda: Layout(TINY, Topology(pp=5)), r"pp=5 is larger than the 4 layers of tiny"),
    ("split length", lambda: Topology(pp=2, layer_split=(4,)), r"layer_split \(4,\) has 1 stages but pp=2"),
    ("split sum", lambda: Layout(TINY, Topology(pp=2, layer_split=(1, 2))), r"sums to 3 but tiny has 4 layers"),
    ("split zero stage", lambda: Topology(pp=2, layer_split=(4, 0)), r"every stage needs at least one layer"),
    (
        "vocab pad 0",
        lambda: Layout(TINY, Topology(tp=2), vocab_pad_multiple=0),
        r"vocab_pad_multiple must be a positive integer, got 0",
    ),
    (
        "vocab pad rule",
        lambda: Layout(TINY, Topology(tp=2), vocab_pad_rule="Megatron"),
        r"vocab_pad_rule must be one of 'megatron', 'vllm', got 'Megatron'",
    ),
    (
        "qkv order",
        lambda: Layout(TINY, Topology(tp=2), qkv_order=""),
        r"qkv_order must be one of 'hf', 'megatron', got ''",
    ),
    (
        "vllm vocab over tp=6",
        lambda: Layout(TINY, Topology(tp=6), 64, "vllm"),
        r"vocab_pad_rule='vllm': model.embed_tokens.weight of 1001 rows padded to a multiple of 64 is 1024 rows, which tp=6 does not divide",
    ),
    (
        "megatron qkv with linear_qkv rows tp does not divide",
        lambda: Layout(TINY, Topology(tp=6), qkv_order="megatron"),
        r"qkv_order='megatron' \(model.layers.0.self_attn.q_proj.weight\): 2 query groups \(kv heads\) cannot be split 6 ways.*128 rows",
    ),
    ("unknown preset", lambda: ModelSpec.preset("llama-8b"), r"unknown model preset 'llama-8b'; known: .*llama-7b"),
    # specs
    ("param dtype", lambda: ParamSpec("w", (4,), "float8", "embed"), r"dtype 'float8' is not one of"),
    (
        "param shape",
        lambda: ParamSpec("w", (4, 0), "float32", "embed"),
        r"shape \(4, 0\) must be non-empty with positive",
    ),
    ("param role", lambda: ParamSpec("w", (4,), "float32", "body"), r"role 'body' is not one of"),
    (
        "duplicate params",
        lambda: ModelSpec("m", (ParamSpec("w", (4,), "float32", "embed"),) * 2, 1),
        r"duplicate parameter names \['w'\]",
    ),
    ("specs differ", lambda: TINY.check_same_as(LLAMA_7B), r"model specs 'tiny' and 'llama-7b' differ"),
    (
        "plan across specs",
        lambda: plan_reallocation(
            TINY,
            Layout(TINY, Topology(tp=2)),
            Layout(ModelSpec.preset("llama-7b"), Topology(tp=2)),
            Placement.blocks(2, 1),
        ),
        r"differ: only in first \[\]",
    ),
    # HF configs (file-based ones are in test_config_files below)
    (
        "missing field",
        lambda: spec_from_hf_config(config_with(hidden_size=...)),
        r"missing required field 'hidden_size'",
    ),
    (
        "missing model_type",
        lambda: spec_from_hf_config(config_with(model_type=...)),
        r"missing required field 'model_type'",
    ),
    (
        "MoE model_type",
        lambda: spec_from_hf_config(config_with(model_type="olmoe")),
        r"'olmoe' is a mixture-of-experts model, which is not supported; supported dense decoders: llama, mistral, "
        r"qwen2, qwen3; supported mixture-of-experts: mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3",
    ),
    ("dbrx", lambda: spec_from_hf_config(config_with(model_type="dbrx")), r"'dbrx' is a mixture-of-experts"),
    (
        "qwen2_moe kv heads",
        lambda: spec_from_hf_config(config_with(model_type="qwen2_moe")),
        r"num_attention_heads=4 is not a multiple of num_key_value_heads=16",
    ),  # Qwen2MoeConfig's default
    (
        "experts under llama",
        lambda: spec_from_hf_config(config_with(num_local_experts=8)),
        r"num_local_experts=8 makes this a mixture-of-experts model",
    ),
    (
        "model_type not a string",
        lambda: spec_from_hf_config(config_with(model_type=["llama"])),
        r"model_type must be a string",
    ),
    (
        "encoder model",
        lambda: spec_from_hf_config(config_with(model_type="bert")),
        r"model_type 'bert' is not supported; supported dense decoders: llama, mistral, qwen2, qwen3",
    ),
    (
        "zero hidden",
        lambda: spec_from_hf_config(config_with(hidden_size=0)),
        r"'hidden_size' must be a positive integer, got 0",
    ),
    (
        "negative layers",
        lambda: spec_from_hf_config(config_with(num_hidden_layers=-2)),
        r"'num_hidden_layers' must be a positive integer, got -2",
    ),
    (
        "string vocab",
        lambda: spec_from_hf_config(config_with(vocab_size="100")),
        r"'vocab_size' must be a positive integer, got '100'",
    ),
    ("zero head_dim", lambda: spec_from_hf_config(config_with(head_dim=0)), r"'head_dim' must be a positive integer"),
    (
        "heads vs kv heads",
        lambda: spec_from_hf_config(config_with(num_key_value_heads=3)),
        r"num_attention_heads=4 is not a multiple of num_key_value_heads=3",
    ),
    (
        "hidden vs heads",
        lambda: spec_from_hf_config(config_with(num_attention_heads=3)),
        r"hidden_size=64 is not a multiple of num_attention_heads=3 and no head_dim",
    ),
    (
        "config dtype",
        lambda: spec_from_hf_config(config_with(torch_dtype="int4")),
        r"torch_dtype 'int4' is not one of bfloat16, float16, float32",
    ),
    ("dtype argument", lambda: spec_from_hf_config(LLAMA_CONFIG, dtype="fp8"), r"dtype argument 'fp8' is not one of"),
    (
        "tie flag",
        lambda: spec_from_hf_config(config_with(tie_word_embeddings="yes")),
        r"'tie_word_embeddings' must be true or false",
    ),
    ("config type", lambda: spec_from_hf_config(42), r"must be a dict, a config.json path or a directory, got int"),
    # planning
    (
        "world mismatch",
        lambda: plan_reallocation(TINY, Topology(tp=2), Topology(tp=4), Placement.blocks(4, 2)),
        r"source dp=1,tp=2,pp=1 has 2 ranks but destination dp=1,tp=4,pp=1 has 4",
    ),
    (
        "placement too small",
        lambda: plan_reallocation(TINY, Topology(tp=4), Topology(dp=4), Placement.blocks(2, 2)),
        r"src layout dp=1,tp=4,pp=1 has 4 ranks but placement has 2 workers",
    ),
    (
        "src worker twice",
        lambda: plan_reallocation(
            TINY, Topology(tp=2), Topology(tp=2), Placement.blocks(4, 2), src_workers=[0, 0], dst_workers=[2, 3]
        ),
        r"src_workers names worker\(s\) \[0\] more than once",
    ),
    (
        "dst worker twice",
        lambda: plan_reallocation(
            TINY, Topology(tp=2), Topology(tp=2), Placement.blocks(4, 2), src_workers=[0, 1], dst_workers=[3, 3]
        ),
        r"dst_workers names worker\(s\) \[3\] more than once",
    ),
    (
        "worker ids not ints",
        lambda: plan_reallocation(
            TINY, Topology(tp=2), Topology(tp=2), Placement.blocks(4, 2), src_workers="01", dst_workers=[2, 3]
        ),
        r"src_workers must be a sequence of non-negative worker ids",
    ),
    (
        "bucket too small",
        lambda: plan_reallocation(TINY, Topology(tp=2), Topology(dp=2), Placement.blocks(2, 1), bucket_bytes=512),
        r"bucket_bytes must be an integer of at least 1024",
    ),
    ("zero bandwidth", lambda: Bandwidths(inter_node=0), r"bandwidth inter_node must be positive, got 0"),
    ("negative bandwidth", lambda: Bandwidths(intra_node=-1.0), r"bandwidth intra_node must be positive"),
    (
        "box outside shape",
        lambda: plan_exchange([one((0,), (4, 0))], [one((1,), (4, 0))], Placement.blocks(2, 1), W),
        r"holdings: box offsets=\(4, 0\) sizes=\(8, 4\) is empty or outside 'w' of shape \(8, 4\)",
    ),
    (
        "unknown param",
        lambda: plan_exchange([one((0,), param="v")], [one((1,))], Placement.blocks(2, 1), W),
        r"holdings: unknown parameter 'v'",
    ),
    (
        "needed, not held",
        lambda: plan_exchange([one((0,), sizes=(4, 4))], [one((1,))], Placement.blocks(2, 1), W),
        r"needed boxes are held by no worker, e.g. \['w offsets=\(4, 0\) sizes=\(4, 4\)'\]",
    ),
    (
        "worker outside placement",
        lambda: plan_exchange([one((0,))], [one((5,))], Placement.blocks(2, 1), W),
        r"needs: worker ids \[5\] are not in the placement \(0..1\)",
    ),
    (
        "group without workers",
        lambda: plan_exchange([one(())], [one((1,))], Placement.blocks(2, 1), W),
        r"holdings: a group has no workers",
    ),
    (
        "planner dtype",
        lambda: plan_exchange([one((0,))], [one((1,))], Placement.blocks(2, 1), {"w": ((8, 4), "fp8")}),
        r"dtype 'fp8' is not one of",
    ),
    ("blocks 0 workers", lambda: Placement.blocks(0, 8), r"num_workers must be a positive integer, got 0"),
    ("blocks 0 per node", lambda: Placement.blocks(8, 0), r"per_node must be a positive integer, got 0"),
    ("empty placement", lambda: Placement(()), r"placement has no workers"),
    ("eta above 1", lambda: blend(1.5), r"blend eta must be a number within \[0, 1\], got 1.5"),
    ("eta below 0", lambda: blend(-0.1), r"blend eta must be a number within \[0, 1\], got -0.1"),
    ("plan format", lambda: Plan.from_json({"format": 99}), r"plan format 99 is not supported \(expected 1\)"),
]


@pytest.mark.parametrize("call, message", [pytest.param(c, m, id=i) for i, c, m in CASES])
def test_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_config_files(tmp_path: Path):
    with pytest.raises(ValueError, match=r"cannot read HF config '.*missing.json': No such file or directory"):
        spec_from_hf_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"cannot read HF config '.*empty-dir/config.json'"):
        (tmp_path / "empty-dir").mkdir()
        spec_from_hf_config(tmp_path / "empty-dir")
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"HF config '.*broken.json' is not valid JSON: .*line 1"):
        spec_from_hf_config(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object, got list"):
        spec_from_hf_config(listed)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(config_with(intermediate_size=...)))
    with pytest.raises(ValueError, match=r"HF config '.*partial.json': missing required field 'intermediate_size'"):
        spec_from_hf_config(partial)


def plan_args(src: str = "dp=2,tp=2", dst: str = "tp=4", *extra: str, model: str = "tiny") -> list[str]:
    return ["plan", "--model", model, "--src", src, "--dst", dst, *extra]


CLI_CASES = [
    ("bad src", plan_args("dp=0"), r"--src: topology dp must be a positive integer, got 0"),
    ("bad dst", plan_args("tp=2", "tp=2,tp=2"), r"--dst: topology 'tp=2,tp=2' gives tp twice"),
    (
        "world mismatch",
        plan_args("dp=2,tp=2", "dp=8"),
        r"--src dp=2,tp=2,pp=1 has 4 ranks but --dst dp=8,tp=1,pp=1 has 8; .*same dp\*tp\*pp",
    ),
    (
        "tp the model cannot take",
        plan_args("dp=5", "tp=5", model="llama-7b"),
        r"--dst dp=1,tp=5,pp=1: tp=5 does not fit llama-7b",
    ),
    ("pp too large", plan_args("pp=8", "dp=8"), r"--src dp=1,tp=1,pp=8: pp=8 is larger than the 4 layers"),
    (
        "unknown pp_split",
        plan_args("dp=2,pp=2,pp_split=even", "tp=4"),
        r"--src: unknown pp_split 'even'; allowed: vllm, megatron, balanced",
    ),
    (
        "megatron uneven",
        plan_args("dp=3", "pp=3,pp_split=megatron"),
        r"--dst dp=1,tp=1,pp=3,pp_split=megatron: tiny: pp_split='megatron' needs pp to divide the layer count",
    ),
    ("unknown preset", plan_args(model="gpt-5"), r"unknown model 'gpt-5': not a preset \(known: .*tiny\)"),
    (
        "missing config",
        plan_args(model="/nonexistent/config.json"),
        r"cannot read HF config '/nonexistent/config.json'",
    ),
    (
        "zero gpus per node",
        plan_args("dp=2,tp=2", "tp=4", "--gpus-per-node", "0"),
        r"--gpus-per-node must be a positive integer, got 0",
    ),
    ("zero bucket", plan_args("dp=2,tp=2", "tp=4", "--bucket-mb", "0"), r"--bucket-mb must be .* at least"),
    ("zero bandwidth", plan_args("dp=2,tp=2", "tp=4", "--inter-gbps", "0"), r"--inter-gbps must be a positive number"),
    ("nan bandwidth", plan_args("dp=2,tp=2", "tp=4", "--intra-gbps", "nan"), r"--intra-gbps must be a positive number"),
    (
        "vocab pad 0",
        plan_args("dp=2,tp=2", "tp=4", "--vocab-pad-multiple", "0"),
        r"--vocab-pad-multiple must be a positive integer, got 0",
    ),
    (
        "unknown vocab pad rule",
        plan_args("dp=2,tp=2", "tp=4", "--vocab-pad-rule", "sglang"),
        r"--vocab-pad-rule must be one of 'megatron', 'vllm', got 'sglang'",
    ),
    (
        "vllm rule tp cannot split",
        plan_args("dp=6", "tp=6", "--vocab-pad-rule", "vllm", "--vocab-pad-multiple", "64"),
        r"--dst dp=1,tp=6,pp=1: vocab_pad_rule='vllm': model.embed_tokens.weight of 1001 rows .* which tp=6 does not divide",
    ),
    (
        "verify too large",
        plan_args("dp=2", "tp=2", "--verify", model="llama-7b"),
        r"--verify would hold about .* GiB .* limit is 2 GiB",
    ),
]


@pytest.mark.parametrize("argv, message", [pytest.param(a, m, id=i) for i, a, m in CLI_CASES])
def test_cli_error(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert re.match(r"realloc: error: " + message, captured.err), captured.err


def test_cli_bad_config_directory(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert main(plan_args(model=str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.startswith("realloc: error: HF config") and "is not valid JSON" in err and err.count("\n") == 1


def test_cli_usage_errors_exit_2(capsys):
    assert main(plan_args("dp=2,tp=2", "tp=4", "--gpus-per-node", "eight")) == 2
    assert "invalid int value: 'eight'" in capsys.readouterr().err
    assert main(["plan", "--src", "tp=2", "--dst", "tp=2"]) == 2
    assert "--model" in capsys.readouterr().err
