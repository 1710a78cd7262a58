"""What a model is: its parameters, how each one splits under tensor parallelism, and where a
spec comes from (a HF ``config.json``, a named preset, :func:`decoder_spec`). Pure: no torch."""

from realloc.spec.hf_config import hf_config_of, load_spec, spec_from_hf_config
from realloc.spec.model import (
    DTYPE_BYTES,
    ROLES,
    VOCAB_PAD_RULES,
    ModelSpec,
    ParamSpec,
    decoder_spec,
    describe_difference,
    preset,
    preset_names,
    vocab_units_per_rank,
)

__all__ = [
    "DTYPE_BYTES",
    "ROLES",
    "VOCAB_PAD_RULES",
    "ModelSpec",
    "ParamSpec",
    "decoder_spec",
    "describe_difference",
    "hf_config_of",
    "load_spec",
    "preset",
    "preset_names",
    "spec_from_hf_config",
    "vocab_units_per_rank",
]
