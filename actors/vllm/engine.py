"""realloc as vLLM's weight-transfer backend, in each vLLM worker process.

vLLM builds one :class:`ReallocWeightTransferEngine` per worker (``WeightTransferConfig(
backend="realloc")``, registered by :mod:`actors.vllm.plugin`) and drives it through its
four-phase protocol (vllm/distributed/weight_transfer/base.py ``WeightTransferEngine``;
vllm/v1/worker/gpu_worker.py ``Worker.init_weight_transfer_engine`` ... ``finish_weight_update``).
What each phase does here:

``init_transfer_engine``
    :func:`~actors.vllm.bake.bake` the worker's layout from its own loaders, for the checkpoint
    names the driver sends, and post it to the driver's control store with the worker's ranks and how it
    holds the routed experts (:func:`~actors.vllm.bake.describe_experts`: expert parallelism, its
    rank and size, the placement) (the front ends return
    nothing from a worker: results travel through the store).
``start_weight_update``
    Opens a round. Nothing of the model changes (no parameter goes to the meta device).
``update_weights({"op": "stage", ...})``
    Checks the worker's share of the plan (``actors.wire.executor.checked_share``) and returns
    at once: a thread joins the update's private world (trainer ranks and vLLM workers) and
    receives the worker's boxes, and only them, into a *shadow* set of realloc buffers while the
    engine keeps generating; it posts its outcome (the error or none, bytes received, seconds)
    to the control store.
    ``{"op": "abort"}`` drops the round.
``finish_weight_update``
    The commit, inside one RPC between two forward steps: the staged shards go into the model
    through vLLM's layerwise reload (each module materialized, the bake's copies replayed from
    the shadow set, ``process_weights_after_loading``, the kernel tensors copied back in place:
    vllm/model_executor/model_loader/reload/layerwise.py ``_layerwise_process``, whose loader
    replay this replaces), then the modules that share a written tensor (a tied lm head) processed
    again. Refused, with the serving weights untouched, unless this round staged
    every byte; after an abort, or in a round that took no share (the driver's round that only
    sets vLLM's label), it changes nothing.

Serving weights are only written by the commit. A failure before it (a trainer rank dying, a
deadline) leaves the engine serving the old weights; the driver learns it from the store
(:mod:`actors.driver.vllm`).

No phase raises into vLLM: each answers through the store before its RPC returns (the
description or refusal of ``init``; ``<update id>/<index>/staging``: the share taken or refused;
``<update id>/<index>/commit``: switched, or why not) and the driver raises after reading every
worker's answer. A raise would put vLLM's RPC replies out of step at tp >= 2 (see
``init_transfer_engine``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from actors.lanes import STAGE
from actors.vllm.bake import Bake, bake, describe_experts
from actors.vllm.messages import OPS, control_key, decode
from actors.wire.delta import DeltaSides
from actors.wire.executor import Staging, StepRunner, checked_share
from actors.wire.transport import address_toward, connect_rendezvous, join_world
from realloc.shards import ShardStore
from realloc.shards.store import allocate_buffers

log = logging.getLogger(__name__)


@dataclass
class ReallocInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s payload (:func:`actors.vllm.messages.init_payload`)."""

    store_host: str
    store_port: int
    engine_id: str
    params: list = field(default_factory=list)
    timeout_s: float = 60.0


@dataclass
class ReallocUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' payload (one per worker, vLLM's list form): ``op`` (:data:`OPS`);
    for ``stage``, :func:`actors.vllm.messages.stage_payload`'s fields."""

    op: str
    update_id: str = ""
    version: int = 0
    world_id: str = ""
    addr: str = ""
    port: int = 0
    world_rank: int = -1
    world_size: int = 0
    share: str = ""
    base: int | None = None
    keep_base: bool = False


@dataclass
class _Round:
    """One update round on this worker (``start_weight_update`` to ``finish_weight_update``)."""

    update_id: str = ""
    version: int = 0
    thread: threading.Thread | None = None
    shadow: ShardStore | None = None
    error: str | None = None
    staged: bool = False
    aborted: bool = False
    seconds: float = 0.0
    received: int = 0
    delta: DeltaSides | None = None
    keep_base: bool = False
    shadow_rank: Any = None  # the RankLayout of the shadow set


class ReallocWeightTransferEngine(WeightTransferEngine[ReallocInitInfo, ReallocUpdateInfo]):
    init_info_cls = ReallocInitInfo
    update_info_cls = ReallocUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: ReallocInitInfo | None = None
        self.layout: Bake | None = None
        self.control = None
        self.index = -1
        self.round: _Round | None = None
        self.committed = 0  # the version of the last commit (0: the weights vLLM loaded)
        #: the shadow set of the last commit, kept as the next delta's base (``keep_base``), and its rank
        self.held: ShardStore | None = None
        self.held_rank = None
        self._by_module: list[tuple[torch.nn.Module, list, set[str]]] = []  # module, its copies, tensors to zero
        self._tied: list[torch.nn.Module] = []  # modules no copy writes that share a written tensor (a tied lm_head)

    # -- init -------------------------------------------------------------------------------
    # No method vLLM calls here raises: each answers through the driver's control store and
    # returns normally. vLLM 0.32's multiproc executor reads the workers' replies in rank order
    # and stops at the first failed one (vllm/v1/executor/multiproc_executor.py
    # ``MultiprocExecutor.collective_rpc``, ``get_response``), leaving the later workers' replies
    # queued: the next RPC reads them instead of its own, and every RPC after it too. So a failure
    # on tp rank 0 (or on every rank) at tp >= 2 would put the engine's RPCs out of step for good;
    # and a raise inside vLLM's worker methods leaves its round flag as the driver does not expect
    # (``update_weights`` clears it, ``finish_weight_update`` keeps it).
    def init_transfer_engine(self, init_info: ReallocInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        try:  # a refused or failed init leaves this worker as it was
            control = connect_rendezvous(init_info.store_host, init_info.store_port, 1, init_info.timeout_s)
        except Exception:  # noqa: BLE001 - nothing to answer through: the driver's read names this worker
            log.error(
                "realloc: this vLLM worker could not reach the driver's control store at %s:%d",
                init_info.store_host,
                init_info.store_port,
                exc_info=True,
            )
            return
        index = get_world_group().rank_in_group
        try:
            described = self._init(init_info, control, index)
        except Exception as err:  # noqa: BLE001 - answered: the driver raises it
            described = {"error": f"vLLM worker {index}: init failed: {type(err).__name__}: {err}", "failed": True}
            log.warning("realloc: %s", described["error"], exc_info=True)
        try:
            control.set(control_key(init_info.engine_id, "worker", index), json.dumps(described))
        except Exception:  # noqa: BLE001 - the driver's read names this worker
            log.error("realloc: vLLM worker %d could not post its description", index, exc_info=True)

    def _init(self, init_info: ReallocInitInfo, control, index: int) -> dict:
        """Bake the layout and keep it: the worker's description for the driver, or its refusal
        (``{"error": ...}``)."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group

        if self.parallel_config.data_parallel_size != 1:
            return {
                "error": f"the realloc backend serves one data-parallel replica per engine (data_parallel_size="
                f"{self.parallel_config.data_parallel_size}); start one engine per replica (data_parallel_size=1) and update each one (trainer.copy_to(engine)); a Fleet takes realloc groups only"
            }
        params = [(str(n), tuple(int(x) for x in shape), str(d)) for n, shape, d in init_info.params]
        try:
            layout = bake(self.model, params, self.device)
        except Exception as err:  # the trainer's model is not the one vLLM serves: say so to the driver
            message = f"vLLM worker {index}: {err}: the trainer's model is not the one vLLM serves"
            log.warning("realloc: %s", message)
            return {"error": message}
        try:  # the experts' placement, as vLLM's own MoE layers hold them (the driver lays the engine out by it)
            experts = describe_experts(self.model, self.parallel_config)
        except ValueError as err:
            return {"error": f"vLLM worker {index}: {err}"}
        modules = dict(self.model.named_modules())
        grouped: dict[str, list] = {}
        for s in layout.scatters:
            grouped.setdefault(s.module, []).append(s)
        by_module = [(modules[m], scatters, _partly_written(modules[m], scatters)) for m, scatters in grouped.items()]
        tied = _sharing_modules(self.model, [m for m, _, _ in by_module])
        described = {
            "index": index,
            "workers": get_world_group().world_size,
            "tp_rank": get_tp_group().rank_in_group,
            "tp_size": get_tp_group().world_size,
            "pp_rank": get_pp_group().rank_in_group,
            "pp_size": get_pp_group().world_size,
            **experts,  # expert_parallel, ep_size, ep_rank, expert_tp_size, expert_placement, eplb, ...
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "boxes": {n: [[list(o), list(s)] for o, s in b] for n, b in layout.boxes().items()},
            "unread": list(layout.unread),
            "missing": list(layout.missing),
            "pid": os.getpid(),
            "ip": address_toward(init_info.store_host),
        }
        self.layout, self.info, self.index, self.control = layout, init_info, index, control
        self._by_module, self._tied = by_module, tied
        return described

    # -- a round ------------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        # A failed round's thread may still wait for a dead peer (until its transport's
        # deadline): it writes only its own shadow set, which nothing reads any more. On a worker
        # with no layout the round's update_weights refuses the share (never a raise: see init).
        self.round = _Round()

    def update_weights(self, update_info: dict) -> None:
        """vLLM's ``update_weights`` (parse, receive), answering instead of raising (see
        ``init_transfer_engine``): for a ``stage``, ``<update id>/<index>/staging`` says whether
        this worker took its share (``{"error": None}``) or why it refused it, before this RPC
        returns. No device synchronize: nothing is received on the RPC's thread."""
        update_id = update_info.get("update_id") if isinstance(update_info, dict) else None
        try:
            error = self._receive(self.parse_update_info(update_info))
        except Exception as err:  # noqa: BLE001 - answered: the driver raises it
            error = f"{type(err).__name__}: {err}"
            log.warning("realloc: update_weights failed on worker %d", self.index, exc_info=True)
        if error is not None:
            log.warning("realloc: worker %d refused update %s: %s", self.index, update_id, error)
        if update_id and self.info is not None:
            self._answer(update_id, "staging", {"error": error})

    def receive_weights(self, update_info: ReallocUpdateInfo) -> None:
        """``update_weights``' work (vLLM calls :meth:`update_weights`): raises the refusal."""
        error = self._receive(update_info)
        if error is not None:
            raise RuntimeError(error)

    def _receive(self, info: ReallocUpdateInfo) -> str | None:
        """Take this worker's share (start the stage thread) or drop the round; why it refuses, or None."""
        rnd = self.round
        if info.op == "abort":
            if rnd is not None:
                rnd.aborted = True
            return None
        if info.op != "stage":
            return f"ValueError: realloc: update_weights op must be one of {OPS}, got {info.op!r}"
        if self.layout is None:
            return "RuntimeError: realloc: init_weight_transfer_engine has not run on this worker (or refused)"
        if rnd is None:
            return "RuntimeError: realloc: update_weights outside a round (call start_weight_update first)"
        if rnd.thread is not None:
            return f"RuntimeError: realloc: update {rnd.update_id} is already staging in this round"
        rnd.update_id, rnd.version = info.update_id, info.version
        try:
            plan, peers = checked_share(*decode(info.share), info.world_rank)
            dst = peers[info.world_rank].dst
            if dst is None:
                raise ValueError(f"realloc: worker {self.index} receives nothing in update {info.update_id}")
            self._check_boxes(dst)
            shadow = ShardStore(dst.shards(), allocate_buffers(dst.layout, dst.rank))
        except Exception as err:  # refused before any traffic: its outcome too says why
            rnd.error = f"{type(err).__name__}: {err}"
            self._post(rnd)
            return rnd.error
        rnd.shadow, rnd.shadow_rank = shadow, dst
        rnd.keep_base = info.keep_base
        if info.base is not None:  # deltas against what this worker committed last, if that is the base
            same = self.held is not None and self.held_rank == dst and self.committed == info.base
            rnd.delta = DeltaSides(None, self.held if same else None)  # no base: every bucket is resent whole
        rnd.thread = threading.Thread(
            target=self._stage, args=(rnd, info, plan, peers), name=f"realloc-stage-{info.update_id}", daemon=True
        )
        rnd.thread.start()
        return None

    def _stage(self, rnd: _Round, info: ReallocUpdateInfo, plan, peers) -> None:
        """The stage thread: join the update's world, receive this worker's boxes into the
        shadow set, post the outcome."""
        started = time.perf_counter()
        timeout_s = self.info.timeout_s
        transport = None
        try:
            transport = join_world(
                info.addr,
                info.port,
                info.world_id,
                info.world_rank,
                info.world_size,
                timeout_s,
                STAGE.prefix,
                lambda: rnd.aborted,
            )
            cpu = torch.device("cpu")
            runner = StepRunner(
                transport, cpu, plan, info.world_rank, peers, None, rnd.shadow, staging=Staging(cpu), delta=rnd.delta
            )
            for step, routes in sorted(plan.routes_by_step().items()):
                for _, nbytes in runner.run_step(step, routes):
                    rnd.received += nbytes
            rnd.staged = True
        except BaseException as err:  # noqa: BLE001 - the outcome goes to the driver
            rnd.error = f"{type(err).__name__}: {err}"
            log.warning("realloc: update %s failed on worker %d: %s", info.update_id, self.index, rnd.error)
            # the traceback only where debug logging is on: formatting one parses source with ast
            # (3.11's carets), whose state CPython 3.11 shares between threads, so a stage thread
            # formatting while vLLM's main thread parses can raise SystemError in either
            # (python/cpython#106905, pytest-dev/pytest#10763)
            log.debug("realloc: update %s on worker %d", info.update_id, self.index, exc_info=True)
        finally:
            if transport is not None:
                transport.close()
            rnd.seconds = time.perf_counter() - started
        self._post(rnd)

    def _post(self, rnd: _Round) -> None:
        """The outcome of ``rnd``'s transfer, for the driver (the error or None, bytes, seconds)."""
        outcome = {
            "error": rnd.error,
            "received_bytes": rnd.received,
            "shadow_bytes": sum(b.numel() * b.element_size() for b in rnd.shadow.buffers.values()) if rnd.shadow else 0,
            "seconds": rnd.seconds,
            "delta": rnd.delta.stats if rnd.delta is not None else None,
        }
        try:
            self.control.set(control_key(self.info.engine_id, rnd.update_id, self.index), json.dumps(outcome))
        except Exception as err:  # noqa: BLE001 - the driver's wait then names this worker
            # no traceback: this runs on the stage thread too (see _stage)
            log.warning(
                "realloc: could not post the outcome of update %s: %s: %s", rnd.update_id, type(err).__name__, err
            )

    def _answer(self, update_id: str, call: str, answer: dict) -> None:
        """This worker's answer to ``call`` of round ``update_id``, posted before the RPC returns."""
        try:
            self.control.set(control_key(self.info.engine_id, update_id, self.index, call), json.dumps(answer))
        except Exception:  # noqa: BLE001 - the driver's read names this worker
            log.warning("realloc: could not post the answer to %s of update %s", call, update_id, exc_info=True)

    def finish_weight_update(self) -> None:
        """The commit; answers ``<update id>/<index>/commit``: ``error`` (None: switched) and
        ``touched`` (whether the serving weights were written at all), never raises (see
        ``init_transfer_engine``: vLLM closes its round all the same)."""
        rnd, self.round = self.round, None
        if rnd is None or rnd.aborted or not rnd.update_id:
            # an aborted round, or one that took no share (the driver's empty round that only
            # gives vLLM back its label after a refused commit: actors/driver/vllm.py
            # ``VLLMEngine._relabel``), changes nothing and answers nothing
            return
        answer: dict[str, Any] = {"error": None, "touched": False}
        if rnd.thread is None or not rnd.staged:  # staged: every byte is in the shadow set
            rnd.aborted = True  # the round is over: its thread leaves at its next check
            answer["error"] = (
                f"realloc: update {rnd.update_id} is not staged on worker {self.index} "
                f"({rnd.error or 'its transfer is still running'}); it serves the weights of version "
                f"{self.committed}, untouched"
            )
        else:
            answer["touched"] = True
            try:
                self._commit(rnd.shadow)
            except Exception as err:  # noqa: BLE001 - answered: the driver raises it
                answer["error"] = f"{type(err).__name__}: {err}"
                self.held = self.held_rank = None  # what it serves is not known: no delta base
                log.error(
                    "realloc: the commit of update %s failed on worker %d", rnd.update_id, self.index, exc_info=True
                )
            else:
                self.committed = rnd.version
                if rnd.keep_base:
                    self.held, self.held_rank = rnd.shadow, rnd.shadow_rank
                else:
                    self.held = self.held_rank = None
        if rnd.update_id:
            self._answer(rnd.update_id, "commit", answer)

    # -- the commit -----------------------------------------------------------------------------
    @torch.no_grad()
    def _commit(self, shadow: ShardStore) -> None:
        """Put ``shadow`` into the model module by module, as vLLM's layerwise reload does."""
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _copy_and_restore_kernel_tensors,
            _get_original_loader,
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        with torch.device(self.device):
            initialize_layerwise_reload(self.model)
            for layer, scatters, partly in self._by_module:
                info = LAYERWISE_INFO[layer]
                materialize_layer(layer, info)
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                for name, t in get_layer_tensors(layer).items():
                    t.weight_loader = _get_original_loader(t)
                    if name in partly:  # what no copy writes is padding: vLLM's loaders zero it
                        t.data.zero_()
                for s in scatters:
                    dst = getattr(layer, s.param).data.as_strided(s.shape, s.stride, s.offset)
                    dst.copy_(shadow.view(s.name, s.offsets, s.sizes).reshape(s.shape))
                quant = getattr(layer, "quant_method", None)
                if isinstance(quant, QuantizeMethodBase):
                    quant.process_weights_after_loading(layer)
                    if hasattr(layer, "update_param_tp_status"):
                        layer.update_param_tp_status()
                if info.kernel_tensors is not None:
                    _copy_and_restore_kernel_tensors(layer, info)
                info.reset()
            finalize_layerwise_reload(self.model, self.model_config)
            # A module that shares a written tensor (lm_head tied to embed_tokens: ParallelLMHead.
            # tie_weights shares the embedding's Parameter) gets no copy, and the reload above puts
            # its kernel tensors, the shared ones now holding the new values, back unprocessed
            # (finalize_layerwise_processing: nothing loaded -> _place_kernel_tensors). Its
            # processing may keep its own copy of them (on CPU UnquantizedEmbeddingMethod's
            # dispatch_cpu_unquantized_gemm packs the weight into a oneDNN handler), so it is
            # processed again on the new values, as vLLM's first load processes every module
            # once all weights are in (vllm/model_executor/model_loader/utils.py
            # process_weights_after_loading). On GPU the unquantized lm head reads the shared
            # Parameter and its processing does nothing.
            for layer in self._tied:
                if hasattr(layer, "_already_called_process_weights_after_loading"):
                    delattr(layer, "_already_called_process_weights_after_loading")
                layer.quant_method.process_weights_after_loading(layer)

    def _check_boxes(self, dst) -> None:
        """``ValueError`` unless every box the loaders copy is in the shadow set of ``dst``."""
        held: dict[str, list] = {}
        for s in dst.shards():
            held.setdefault(s.param, []).append(s)
        for s in self.layout.scatters:
            inside = any(
                all(o >= ho and o + n <= ho + hn for o, n, ho, hn in zip(s.offsets, s.sizes, h.offsets, h.sizes))
                for h in held.get(s.name, ())
            )
            if not inside:
                raise ValueError(
                    f"realloc: the plan gives worker {self.index} no shard holding {s.name} box "
                    f"offsets={s.offsets} sizes={s.sizes}, which its loader copies into {s.module}.{s.param}"
                )

    def shutdown(self) -> None:
        rnd, self.round = self.round, None
        if rnd is not None:
            rnd.aborted = True
        self.control = None


def _sharing_modules(model: torch.nn.Module, written: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of ``model`` with a quantization method that no copy writes but that hold a
    tensor sharing storage with a tensor of a ``written`` module (a tied lm head): the commit
    processes them again."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    def storages(m: torch.nn.Module) -> set[int]:
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        return {t.untyped_storage().data_ptr() for t in tensors if t.numel() > 0 and not t.is_meta}

    shared = set().union(*(storages(m) for m in written)) if written else set()
    ids = {id(m) for m in written}
    return [
        m
        for m in model.modules()
        if id(m) not in ids
        and isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
        and storages(m) & shared
    ]


def _partly_written(module: torch.nn.Module, scatters: list) -> set[str]:
    """The tensors of ``module`` the copies do not cover whole (a padded vocabulary): zeroed
    before a commit writes them (materialized memory is uninitialized)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params, buffers = get_layerwise_info(module).restore_metadata  # model format (the kernel's may differ)
    written: dict[str, int] = {}
    for s in scatters:
        written[s.param] = written.get(s.param, 0) + math.prod(s.shape)
    return {n for n, t in {**params, **buffers}.items() if written.get(n, 0) < t.numel()}
