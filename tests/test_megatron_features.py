"""Megatron-core's own dense ``GPTModel`` read by ``ShardSource.megatron`` (actors/trainer/source.py)
on 2 gloo processes, for the model features whose layout realloc restates: q/k/v biases fused
into ``linear_qkv`` per query group under tp, Megatron's padded vocabulary, and tied embeddings
with the output layer's copy on the last pipeline stage.

Oracles, Megatron's own code:

* where each local tensor sits in the global one: ``GPTModel.sharded_state_dict()`` (its
  ``ShardedTensor`` s' global offsets; a tied output layer on a last stage that is not the first
  is there the key of the embedding, a replica: ``tie_embeddings_and_output_weights_state_dict``
  in megatron/core/models/common/language_module/language_module.py). The model is filled
  through them from Megatron-format global tensors made of the HF checkpoint;
* what ``linear_qkv``'s rows mean: ``SelfAttention.get_query_key_value_tensors``
  (megatron/core/transformer/attention.py) of an input, against HF's ``q_proj``/``k_proj``/
  ``v_proj`` (bias included) of the same input, for the rank's heads. That checks the global
  fused tensors the model was filled from, so the holdings checked against the HF tensors are
  Megatron's meaning of them.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
from ports import free_port

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

V, HIDDEN, HEADS, GROUPS, HEAD_DIM, INTER, LAYERS = 100, 16, 4, 2, 4, 32, 2


def _hf_config(tied: bool, groups: int = GROUPS) -> dict:
    return dict(
        model_type="qwen2",  # q/k/v biases, no o bias: Megatron's add_qkv_bias without add_bias_linear
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=groups,
        vocab_size=V,
        tie_word_embeddings=tied,
    )


def _model(tp: int, pp: int, vocab: int, share: bool, groups: int = GROUPS):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=groups,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=INTER,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=True,
        params_dtype=torch.float32,
    )
    # a tied output layer on a last stage that is not the first is made equal to the embedding by an
    # all-reduce of the weight moved to CUDA (setup_embeddings_and_output_layer): on gloo, in place
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *args, **kwargs: self):
        return _gpt(GPTModel, config, vocab, share)


def _gpt(GPTModel, config, vocab: int, share: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=share,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def _megatron_global(full: dict, vocab: int, output: torch.Tensor | None = None, groups: int = GROUPS) -> dict:
    """Megatron's global tensors (distributed-checkpoint keys, layer axis first) of the HF
    checkpoint ``full``: the vocabulary padded with zero rows to ``vocab``; ``linear_qkv`` per
    query group its q heads, its k head, its v head (weight and bias); ``linear_fc1`` [gate; up];
    ``output``: the output layer's own values (a Megatron model that does not tie it)."""
    per = HEADS // groups

    def padded(t):
        return torch.cat([t, t.new_zeros((vocab - t.shape[0],) + tuple(t.shape[1:]))])

    def fused(i, suffix):
        q, k, v = (full[f"model.layers.{i}.self_attn.{x}_proj.{suffix}"] for x in "qkv")
        rest = tuple(q.shape[1:])
        parts = [q.reshape(groups, per * HEAD_DIM, *rest), k.reshape(groups, HEAD_DIM, *rest)]
        parts.append(v.reshape(groups, HEAD_DIM, *rest))
        return torch.cat(parts, 1).reshape(-1, *rest)

    def layers(f):
        return torch.stack([f(i) for i in range(LAYERS)])

    def hf(name):
        return lambda i: full[f"model.layers.{i}.{name}"]

    head = full.get("lm_head.weight", full["model.embed_tokens.weight"]) if output is None else output
    return {
        "embedding.word_embeddings.weight": padded(full["model.embed_tokens.weight"]),
        "output_layer.weight": padded(head),
        "decoder.final_layernorm.weight": full["model.norm.weight"],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": layers(hf("input_layernorm.weight")),
        "decoder.layers.self_attention.linear_qkv.weight": layers(lambda i: fused(i, "weight")),
        "decoder.layers.self_attention.linear_qkv.bias": layers(lambda i: fused(i, "bias")),
        "decoder.layers.self_attention.linear_proj.weight": layers(hf("self_attn.o_proj.weight")),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": layers(hf("post_attention_layernorm.weight")),
        "decoder.layers.mlp.linear_fc1.weight": layers(
            lambda i: torch.cat(
                [full[f"model.layers.{i}.mlp.gate_proj.weight"], full[f"model.layers.{i}.mlp.up_proj.weight"]]
            )
        ),
        "decoder.layers.mlp.linear_fc2.weight": layers(hf("mlp.down_proj.weight")),
    }


def _fill(model, glob: dict) -> set:
    """Every local tensor from ``glob`` where Megatron's ``sharded_state_dict`` places it; the
    parameters filled (by identity)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    filled = set()
    with torch.no_grad():
        for sh in model.sharded_state_dict().values():
            for t in sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]:
                if not isinstance(t, ShardedTensor) or t.key not in glob:
                    continue
                n = t.prepend_axis_num
                box = tuple(t.global_offset[:n]) + tuple(
                    slice(o, o + s) for o, s in zip(t.global_offset[n:], t.local_shape)
                )
                t.data.copy_(glob[t.key][box].reshape(t.data.shape))
                filled.add(t.data.untyped_storage().data_ptr())
    return filled


def _qkv_meaning_is_hf(model, full: dict, tp_rank: int, tp: int, first_layer: int, groups: int) -> list[str]:
    """Megatron's q/k/v of an input (its own split of ``linear_qkv``'s output) vs HF's
    projections of it, for the rank's heads; the layers where they differ."""
    wrong = []
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1, HIDDEN, generator=gen)  # [sequence, batch, hidden]
    heads = HEADS // tp
    # the rank's query groups: groups / tp of them, or (tp a multiple of them) group rank // (tp / groups)
    first_group, count = (tp_rank * groups // tp, groups // tp) if groups >= tp else (tp_rank // (tp // groups), 1)
    for j, layer in enumerate(model.decoder.layers):
        i = first_layer + j
        # (tp a multiple of the groups: Megatron all-gathers linear_qkv's output into a buffer on
        # torch.cuda.current_device(); on gloo, the CPU)
        with torch.no_grad(), mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
            q, k, v = layer.self_attention.get_query_key_value_tensors(x)[:3]
        for got, part, first, n in (
            (q, "q", tp_rank * heads, heads),
            (k, "k", first_group, count),
            (v, "v", first_group, count),
        ):
            w = full[f"model.layers.{i}.self_attn.{part}_proj.weight"]
            b = full[f"model.layers.{i}.self_attn.{part}_proj.bias"]
            want = (x @ w.T + b).reshape(3, 1, -1, HEAD_DIM)[:, :, first : first + n]
            if not torch.allclose(got.reshape(want.shape), want, atol=1e-5):
                wrong.append(f"layer {i} {part}")
    return wrong


#: (name, tp, pp, Megatron's vocabulary, HF tied, Megatron tied, query groups)
CASES = [
    ("tp2", 2, 1, V, False, False, GROUPS),
    ("tp2-padded-vocab", 2, 1, 256, False, False, GROUPS),  # make_vocab_size_divisible_by 128 at tp=2
    ("pp2-tied", 1, 2, V, True, True, GROUPS),
    ("pp2-tied-padded", 1, 2, 128, True, True, GROUPS),
    ("pp2-megatron-untied", 1, 2, V, True, False, GROUPS),  # an HF model that ties, a Megatron model that does not
    # megatron-core 0.16: tp a multiple of the query groups; linear_qkv's 24 rows (q heads 0-3, k, v)
    # cut in two: rank 0 q heads 0-2, rank 1 q head 3, k and v
    ("tp2-one-query-group", 2, 1, V, False, False, 1),
]


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for name, tp, pp, vocab, tied, share, groups in CASES:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        spec = spec_from_hf_config(_hf_config(tied, groups), dtype="float32")
        gen = torch.Generator().manual_seed(0)
        full = {p.name: torch.randn(p.shape, generator=gen) for p in spec.params}
        torch.manual_seed(0)
        model = _model(tp, pp, vocab, share, groups)
        own = None if tied == share else torch.randn(V, HIDDEN, generator=gen)  # an untied output layer's values
        filled = _fill(model, _megatron_global(full, vocab, own, groups))
        unfilled = sorted(n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() not in filled)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        first = pp_rank * LAYERS // pp
        result = {"unfilled": unfilled, "qkv": _qkv_meaning_is_hf(model, full, tp_rank, tp, first, groups)}
        try:
            held = ShardSource.megatron(model, spec).holdings()
            held.refresh()
            result["wrong"] = sorted(
                s.slot
                for s in held.me.shards()
                if not torch.equal(
                    held.store.views(s.param, s.offsets, s.sizes)[0],
                    full[s.param][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))],
                )
            )
            result["slots"] = sorted({s.slot for s in held.me.shards()})
        except ValueError as err:
            result["refused"] = str(err)
        results[name] = result
        del model
        ps.destroy_model_parallel()
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _main(rank: int, port: int, outs: list[str]) -> None:
    _rank(rank, port, outs[rank])


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-features")
    port = free_port()
    outs = [str(root / f"rank{r}.json") for r in range(2)]
    torch.multiprocessing.start_processes(_main, args=(port, outs), nprocs=2, start_method="spawn", join=True)
    return [json.loads(open(o).read()) for o in outs]


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[4] == c[5]])
def test_every_rank_sends_the_hf_tensors_megatron_holds(found, case):
    for rank, results in enumerate(found):
        r = results[case]
        assert r["unfilled"] == [], (case, rank, r["unfilled"])  # the oracle reached every parameter
        assert r["qkv"] == [], (case, rank, r["qkv"])  # linear_qkv means HF's q/k/v (bias included)
        assert "refused" not in r, (case, rank, r.get("refused"))
        assert r["wrong"] == [] and r["slots"], (case, rank, r["wrong"])
    if case.startswith("pp2-tied"):  # the last stage's output layer is its copy of the embedding
        assert "lm_head.weight" in found[1][case]["slots"] and "model.embed_tokens.weight" in found[0][case]["slots"]


def test_a_megatron_output_layer_untied_from_a_tied_hf_embedding_is_refused(found):
    """HF ties the head to the embedding (one tensor); Megatron's model keeps its own output
    layer. On the last stage that layer was read as the embedding's copy, so the embedding could
    be sent from the untied output layer's values."""
    last = found[1]["pp2-megatron-untied"]
    assert "refused" in last and "share_embeddings_and_output_weights" in last["refused"], last
