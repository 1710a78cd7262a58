"""The ``vllm.general_plugins`` entry point of this package: registers the ``realloc`` backend.

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


def check_version(version: str) -> None:
    """``RuntimeError`` unless vLLM ``version`` is one of :data:`SUPPORTED`."""
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise RuntimeError(
            f"realloc's vLLM backend supports vLLM {', '.join(v + '.*' for v in SUPPORTED)}; this is vLLM {version}. "
            "Install a supported vLLM (pip install 'realloc[vllm]')"
        )


def register() -> None:
    """Register ``realloc`` in vLLM's weight-transfer engine factory and its trainer factory
    (once per process; the trainer side also registers itself when ``actors.trainer`` is imported)."""
    import vllm
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    check_version(vllm.__version__)
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "actors.vllm.engine", "ReallocWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "actors.trainer.engine", "ReallocTrainerWeightTransferEngine"
        )
