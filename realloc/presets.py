"""Named model specs (shapes as published in the models' HF configs)."""

from __future__ import annotations

from realloc.spec import ModelSpec, decoder_spec

_PRESETS = {
    # tiny: GQA (12 heads, 2 kv heads: tp 4 -> 6 works, tp 4+ replicates kv), tied embeddings, odd vocab, fp32 norms; for tests and demos.
    "tiny": dict(hidden=96, intermediate=192, layers=4, heads=12, kv_heads=2, vocab=1001, tied=True,
                 norm_dtype="float32"),
    # small: ~56M parameters (112 MB bf16), the default model of `realloc demo`.
    "small": dict(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4, vocab=32000),
    # bench-1gb: ~542M parameters, 1.08 GB bf16, the model of `realloc bench`.
    "bench-1gb": dict(hidden=2048, intermediate=5632, layers=8, heads=16, kv_heads=8, vocab=32000),
    "llama-7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, vocab=32000),
    "llama-13b": dict(hidden=5120, intermediate=13824, layers=40, heads=40, vocab=32000),
    "llama-70b": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000),
    "qwen2.5-7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064,
                       qkv_bias=True),
    "qwen2.5-72b": dict(hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8, vocab=152064,
                        qkv_bias=True),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset(name: str) -> ModelSpec:
    """The spec of a named model (``realloc.presets.preset_names()`` lists them)."""
    if not isinstance(name, str) or name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}")
    return decoder_spec(name, **_PRESETS[name])
