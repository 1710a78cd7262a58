"""The ``vllm.general_plugins`` entry point of this package: registers the ``realloc`` backend, and
``gloo_bcast``, our stand-in for vLLM's ``nccl`` protocol on CPU (:mod:`actors.vllm.gloo_bcast`: trainer
rank 0 broadcasts every full tensor over gloo; realloc's code, for comparison, not vLLM's wire).

vLLM loads general plugins in its front-end process, its engine-core process and every worker
process (vllm/plugins/__init__.py ``load_general_plugins``, called from ``EngineArgs``,
``EngineCore`` and ``WorkerWrapperBase.init_worker``, before the worker builds its
weight-transfer engine), so ``WeightTransferConfig(backend="realloc")`` works with ``LLM``,
``AsyncLLM`` and ``vllm serve`` with nothing else to import. Registration is lazy (the engine
module is imported when a worker builds the engine) and idempotent.

The backend drives private parts of vLLM's layerwise reload, so it supports the vLLM versions in
:data:`SUPPORTED` only; another version fails here, at start, saying which.
"""

from __future__ import annotations

#: The vLLM releases the backend is tested with (``major.minor``).
SUPPORTED = ("0.32",)
#: The backend's name in ``WeightTransferConfig(backend=...)``.
BACKEND = "realloc"
#: Our stand-in for vLLM's ``nccl`` backend over gloo (``WeightTransferConfig(backend="gloo_bcast")``).
GLOO_BCAST = "gloo_bcast"


def check_version(version: str) -> None:
    """``RuntimeError`` unless vLLM ``version`` is one of :data:`SUPPORTED`."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise RuntimeError(
            f"realloc's vLLM backend supports vLLM {', '.join(v + '.*' for v in SUPPORTED)}; this is vLLM {version}. "
            "Install a supported vLLM (pip install 'realloc[vllm]')"
        )


def register() -> None:
    """Register ``realloc`` (and ``gloo_bcast``) in vLLM's weight-transfer engine factory and its
    trainer factory (once per process; the trainer side of ``realloc`` also registers itself when
    ``actors.trainer`` is imported)."""
    import vllm
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    check_version(vllm.__version__)
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "actors.vllm.engine", "ReallocWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "actors.trainer.engine", "ReallocTrainerWeightTransferEngine"
        )
    for factory, cls in (
        (WeightTransferEngineFactory, "GlooBcastWeightTransferEngine"),
        (WeightTransferTrainerFactory, "GlooBcastTrainerWeightTransferEngine"),
    ):
        if GLOO_BCAST not in factory._registry:
            factory.register_engine(GLOO_BCAST, "actors.vllm.gloo_bcast", cls)
