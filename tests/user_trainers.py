"""Trainers as RL frameworks run them, for the tests: the FSDP2 trainer of
examples/fsdp2_vllm.py (plain Ray actors, no realloc actor, a gloo process group of their own;
``TrainerRank.init_transfer`` and ``send`` are the integration with vLLM's trainer API), so the
tests run the code the example gives users to copy."""

from __future__ import annotations

import os
import sys

import ray

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import fsdp2_vllm  # noqa: E402

ray.cloudpickle.register_pickle_by_value(fsdp2_vllm)
start_trainer = fsdp2_vllm.start_trainer
