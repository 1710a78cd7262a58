"""Tied embeddings and Megatron's padded vocabulary as a trainer source reads them, in-process.

* A transformers module names a tied head once (``named_parameters()`` keeps the embedding's
  name): a module that holds ``lm_head.weight`` as a parameter of its own does not tie it, and
  a spec that ties it (``tie_word_embeddings=True``) would send the embedding for it: refused.
  (A last pipeline stage that is not the first keeps its own copy of the tied embedding as
  ``lm_head.weight``: tests/test_megatron_features.py reads Megatron's.)
* Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``
  (megatron/training/tokenizer/tokenizer.py ``_vocab_size_with_padding``, restated below as the
  oracle: megatron.training is not installed here); the layout read from a ``GPTModel``'s
  ``vocab_size`` must give every rank ``padded / tp`` rows (``VocabParallelEmbedding``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from actors.trainer import ShardSource  # noqa: E402
from realloc.layout import Layout, Topology  # noqa: E402
from realloc.layout.conventions import check_megatron_tied, megatron_vocab_pad_multiple  # noqa: E402
from realloc.spec import decoder_spec, spec_from_hf_config  # noqa: E402

CONFIG = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=64,
)


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = {k: v for k, v in CONFIG.items() if k != "model_type"}
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tied, **config)).float()


def _spec(tied: bool):
    return spec_from_hf_config({**CONFIG, "tie_word_embeddings": tied}, dtype="float32")


def test_an_untied_module_under_a_tied_spec_is_refused_naming_its_own_head():
    untied = _llama(tied=False)
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    with pytest.raises(
        ValueError, match=r"holds \['lm_head.weight'\] as parameter\(s\) of its own.*tie_word_embeddings"
    ):
        ShardSource(untied, spec=_spec(tied=True)).holdings()


def test_a_tied_module_sends_its_embedding_once():
    tied = _llama(tied=True)
    held = ShardSource(tied).holdings()
    held.refresh()
    stored = held.store.shard_tensors()
    assert "lm_head.weight" not in stored
    assert torch.equal(stored["model.embed_tokens.weight"], tied.model.embed_tokens.weight)


def test_megatron_ties_must_be_the_specs():
    check_megatron_tied(_spec(tied=True), True)
    check_megatron_tied(_spec(tied=False), False)
    check_megatron_tied(_spec(tied=True), None)  # not known: not checked
    with pytest.raises(ValueError, match="share_embeddings_and_output_weights=False, but .* ties its lm head"):
        check_megatron_tied(_spec(tied=True), False)
    with pytest.raises(ValueError, match="share_embeddings_and_output_weights=True, but .* does not tie"):
        check_megatron_tied(_spec(tied=False), True)


def _megatron_lm_padded(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round up to ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([1, 2, 8, 64, 128, 256]), st.sampled_from([1, 2, 3, 4, 8]))
def test_megatrons_padded_vocabulary_gives_every_rank_padded_over_tp_rows(vocab, divisible_by, tp):
    spec = decoder_spec("v", hidden=8, intermediate=48, layers=1, heads=tp, vocab=vocab, dtype="float32")
    padded = _megatron_lm_padded(vocab, divisible_by, tp)
    m = megatron_vocab_pad_multiple(spec, padded, tp)
    assert m <= divisible_by
    layout = Layout(spec, Topology(tp=tp), m)
    for rank in range(tp):
        (embed,) = [s for s in layout.shards(rank) if s.param == "model.embed_tokens.weight"]
        assert embed.local_shape[0] == padded // tp
        assert embed.offsets[0] == min(rank * padded // tp, vocab)  # rows [r*P/tp, ...) of the vocabulary


def test_a_megatron_vocabulary_no_padding_gives_is_refused():
    spec = decoder_spec("v", hidden=8, intermediate=16, layers=1, heads=2, vocab=100, dtype="float32")
    assert megatron_vocab_pad_multiple(spec, None, 2) == 1 and megatron_vocab_pad_multiple(spec, 100, 2) == 1
    # 128 rows, 64 per rank: 16 is the smallest multiple giving it (100 rows to a multiple of 16 * 2)
    assert megatron_vocab_pad_multiple(spec, 128, 2) == 16
    for padded in (99, 101, 0):  # fewer rows than the vocabulary; a count tp does not divide
        with pytest.raises(ValueError, match=f"vocabulary of {padded} rows .* not v's 100 rows padded"):
            megatron_vocab_pad_multiple(spec, padded, 2)
