"""realloc's vLLM layout against vLLM's own layers and weight loaders, in this process, at tp sizes
no engine test reaches (tp 4 and 8: kv heads replicated, vocabulary ranks with few or no real rows).

vLLM's layers (vllm/model_executor/layers/linear.py ``QKVParallelLinear``, ``RowParallelLinear``;
vocab_parallel_embedding.py ``VocabParallelEmbedding``, ``ParallelLMHead``, ``tie_weights``) are
built as vLLM's models build them, for tp rank ``r`` of ``tp``: vLLM reads both from its tp group
(vllm/distributed/parallel_state.py ``get_tp_group``), which is all that is stood in for here.
Each parameter is then loaded by its own ``weight_loader`` twice:

* from the full HF tensors: the rank's parameter must equal realloc's view of the rank's buffers
  (``fused_views(padding=True)`` of ``actors.driver.vllm.vllm_layout``), padding rows included
  (vLLM zeroes them; realloc's local padding is zeros);
* from vLLM's data-less stand-in (``FakeRDTTensor`` into a ``BakeSink``, what
  actors/vllm/bake.py records on a worker): :func:`actors.vllm.bake.chain_box` of each recorded
  copy must be the layout's box of that rank, as the driver's ``check_derived`` demands.

No engine, no processes: vLLM's import is the cost (about 10 s).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from actors.driver.vllm import vllm_layout  # noqa: E402
from actors.vllm.bake import chain_box  # noqa: E402
from realloc.shards import allocate_buffers, fused_views  # noqa: E402
from realloc.shards.store import local_tensor  # noqa: E402
from realloc.spec import decoder_spec  # noqa: E402

HIDDEN, HEAD_DIM = 16, 4


@contextmanager
def tp_rank(tp: int, rank: int):
    """vLLM's layers built (and loading) as tp rank ``rank`` of ``tp``."""
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config

    group = SimpleNamespace(rank_in_group=rank, world_size=tp)
    with mock.patch.object(ps, "get_tp_group", return_value=group), set_current_vllm_config(VllmConfig()):
        yield


def _spec(heads: int, kv_heads: int, vocab: int, tied: bool = False):
    return decoder_spec(
        "vllm-layers",
        hidden=HIDDEN,
        intermediate=32,
        layers=1,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        vocab=vocab,
        qkv_bias=True,
        tied=tied,
        dtype="float32",
    )


def _full(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g) for p in spec.params}


def _realloc_views(layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's tensors as realloc holds them: every shard's box of the full tensors, in the
    rank's buffers, seen through vLLM's fused names (padding rows: the buffer's zeros)."""
    buffers = {k: b.zero_() for k, b in allocate_buffers(layout, rank).items()}
    me = layout.at(rank)
    for s in me.shards():
        box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
        local_tensor(s, buffers)[tuple(slice(0, n) for n in s.sizes)] = full[s.param][box]
    return fused_views(me, buffers, padding=True)


def _layout_boxes(layout, rank: int, name: str) -> list:
    return sorted((s.offsets, s.sizes) for s in layout.shards(rank) if s.param == name)


def _baked_boxes(module, param: torch.nn.Parameter, pname: str, name: str, shape, *args) -> list:
    """The boxes of checkpoint tensor ``name`` that ``param``'s loader copies, as the bake
    records them (vLLM's stand-in, realloc's chain_box)."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor

    sink = BakeSink()
    sink.current = (module, pname)
    fake = FakeRDTTensor(name, torch.Size(shape), torch.float32, torch.device("cpu"), sink=sink)
    param.weight_loader(param, fake, *args)
    return sorted(chain_box(tuple(shape), torch.float32, c.src[1]) for c in sink.copies_by_layer[module])


#: (heads, kv heads, tp): kv heads split, one per rank, and replicated on 2, 4 and 8 ranks
GQA = [(8, 2, 1), (8, 2, 2), (8, 4, 4), (8, 2, 4), (8, 2, 8), (4, 1, 4), (8, 1, 8)]


@pytest.mark.parametrize("heads, kv_heads, tp", GQA)
def test_every_rank_holds_vllms_qkv_proj_and_o_proj_with_replicated_kv_heads(heads, kv_heads, tp):
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    spec = _spec(heads, kv_heads, vocab=64)
    layout, full = vllm_layout(spec, tp), _full(spec)
    a = "model.layers.0.self_attn."
    for rank in range(tp):
        with tp_rank(tp, rank):
            qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=True, params_dtype=torch.float32)
            o = RowParallelLinear(heads * HEAD_DIM, HIDDEN, bias=False, params_dtype=torch.float32)
            for part in "qkv":
                for suffix in ("weight", "bias"):
                    name = f"{a}{part}_proj.{suffix}"
                    param = getattr(qkv, suffix)
                    param.weight_loader(param, full[name], part)
                    baked = _baked_boxes(qkv, param, suffix, name, full[name].shape, part)
                    assert baked == _layout_boxes(layout, rank, name), (name, rank)
            o.weight.weight_loader(o.weight, full[a + "o_proj.weight"])
            baked = _baked_boxes(o, o.weight, "weight", a + "o_proj.weight", full[a + "o_proj.weight"].shape)
            assert baked == _layout_boxes(layout, rank, a + "o_proj.weight"), rank
        views = _realloc_views(layout, rank, full)
        assert torch.equal(views[a + "qkv_proj.weight"], qkv.weight.data), (tp, rank)
        assert torch.equal(views[a + "qkv_proj.bias"], qkv.bias.data), (tp, rank)
        assert torch.equal(views[a + "o_proj.weight"], o.weight.data), (tp, rank)
        if tp > kv_heads:  # the replicated kv head is head rank // (tp / kv_heads)
            head = rank // (tp // kv_heads)
            k_rows = slice(heads // tp * HEAD_DIM, (heads // tp + 1) * HEAD_DIM)
            want = full[a + "k_proj.weight"][head * HEAD_DIM : (head + 1) * HEAD_DIM]
            assert torch.equal(qkv.weight.data[k_rows], want), (tp, rank)


def test_a_tp_that_splits_neither_the_heads_nor_the_kv_heads_is_refused_as_vllm_refuses_it():
    from vllm.model_executor.layers.linear import QKVParallelLinear

    for heads, kv_heads, tp in [(8, 2, 3), (12, 4, 8), (8, 4, 16)]:  # 3 heads no rank count; 4 kv heads on 8 ranks
        with pytest.raises(ValueError, match="cannot be split"):
            vllm_layout(_spec(heads, kv_heads, vocab=64), tp)
        with tp_rank(tp, 0), pytest.raises(AssertionError):
            QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=True, params_dtype=torch.float32)


#: (vocabulary, tp): vLLM pads to a multiple of 64, then splits the padded rows evenly; 100 rows
#: at tp 8 leave rank 6 four real rows and rank 7 none, 1000 at tp 8 rank 7 104 of 128
VOCABS = [(64, 1), (100, 2), (1000, 2), (1000, 4), (1000, 8), (100, 8), (50, 4)]


@pytest.mark.parametrize("vocab, tp", VOCABS)
@pytest.mark.parametrize("tied", [False, True])
def test_every_rank_holds_vllms_padded_embedding_and_lm_head(vocab, tp, tied):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    spec = _spec(8, 2, vocab=vocab, tied=tied)
    layout, full = vllm_layout(spec, tp), _full(spec, seed=vocab)
    embed = "model.embed_tokens.weight"
    for rank in range(tp):
        with tp_rank(tp, rank):
            emb = VocabParallelEmbedding(vocab, HIDDEN, params_dtype=torch.float32)
            head = ParallelLMHead(vocab, HIDDEN, params_dtype=torch.float32)
            if tied:  # vllm/model_executor/models/llama.py: lm_head.tie_weights(model.embed_tokens)
                head = head.tie_weights(emb)
            emb.weight.weight_loader(emb.weight, full[embed])
            baked = _baked_boxes(emb, emb.weight, "weight", embed, full[embed].shape)
            assert baked == _layout_boxes(layout, rank, embed), (vocab, tp, rank)
            if not tied:
                head.weight.weight_loader(head.weight, full["lm_head.weight"])
                baked = _baked_boxes(head, head.weight, "weight", "lm_head.weight", full["lm_head.weight"].shape)
                assert baked == _layout_boxes(layout, rank, "lm_head.weight"), (vocab, tp, rank)
        views = _realloc_views(layout, rank, full)
        assert torch.equal(views[embed], emb.weight.data), (vocab, tp, rank)
        if tied:
            assert "lm_head.weight" not in views and head.weight is emb.weight
        else:
            assert torch.equal(views["lm_head.weight"], head.weight.data), (vocab, tp, rank)
