"""``gloo_bcast``: our stand-in for vLLM's ``nccl`` weight-transfer protocol on machines without
NCCL (CPU). It is realloc's code, not vLLM's code path on the wire: it measures the protocol vLLM
ships (trainer rank 0 broadcasts every full HF tensor to every engine worker, which loads it with
``load_weights``) over gloo, the wire this machine has. ``realloc bench --vllm-trainer`` labels it so.

It follows vLLM 0.32's dense NCCL backend step for step; the files followed:

- vllm/distributed/weight_transfer/nccl_engine.py: ``NCCLWeightTransferEngine`` (engine side:
  ``init_transfer_engine`` joins the group; ``start_weight_update`` = ``initialize_layerwise_reload``;
  ``receive_weights`` receives each ``(name, dtype, shape)`` of the update info by broadcast from
  rank 0, packed or one by one, into ``model.load_weights``; ``finish_weight_update`` =
  ``finalize_layerwise_reload``) and ``NCCLTrainerWeightTransferEngine`` (trainer side:
  ``trainer_init`` runs the engine's ``init_weight_transfer_engine`` on a side thread while rank 0
  opens its endpoint; ``send_weights`` = start, a side thread runs ``update_weights`` while rank 0
  broadcasts every full tensor of the ``WeightSource`` (every rank materializes them in lockstep,
  as ``ModuleSource`` does; only rank 0 is in the group with the engine's workers), then finish;
  ``_checked_iter``, the source checked against its metadata).
- vllm/distributed/weight_transfer/nccl_common.py: the worker's rank in the group
  (``worker_init_process_group``: data-parallel index x workers per replica + rank + offset 1).
- vllm/distributed/weight_transfer/packed_tensor.py: the packed wire (``pack_tensors`` and
  ``unpack_tensor`` used as they are; the chunking of ``packed_nccl_broadcast_consumer``: tensors
  are added to a chunk until it exceeds ``packed_buffer_size_bytes``). CPU has no streams, so one
  buffer at a time (vLLM's ``num_buffers`` double-buffers on CUDA streams).
- vllm/distributed/weight_transfer/base.py, factory.py: the engine, trainer engine, init/update
  info classes and their registration.
- vllm/distributed/utils.py: ``stateless_init_torch_distributed_process_group(..., backend="gloo")``,
  the stateless group (vLLM's NCCL path builds a ``StatelessProcessGroup`` then NCCL on it).

Differences, all on the side of not hanging: the group takes ``timeout_s`` (every gloo operation
and the rendezvous end by then, with an error naming who did not answer), the trainer waits for the
engine's ``update_weights`` at most ``timeout_s`` after its last broadcast, and the init and
update infos are checked (``ValueError`` naming the field and what is allowed) before any traffic.
As in vLLM's backend, a broadcast that fails midway leaves the engine inside its layerwise reload:
the next round's ``start_weight_update`` begins a new one.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar, Iterator

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

from actors.vllm.plugin import GLOO_BCAST

#: The backend's name in ``WeightTransferConfig(backend=...)`` and the trainer factory (``gloo_bcast``).
BACKEND = GLOO_BCAST
#: The dtypes the wire carries (``torch.<name>``).
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "uint8",
    "int32",
    "int64",
)


def _check_group(where: str, info) -> None:
    """``ValueError`` naming the first field of a group's description (an init info) that cannot work."""
    master_address, master_port, world_size = info.master_address, info.master_port, info.world_size
    timeout_s, packed_buffer_size_bytes = info.timeout_s, info.packed_buffer_size_bytes
    if not isinstance(master_address, str) or not master_address:
        raise ValueError(f"{where}: master_address must be a host name or address, got {master_address!r}")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"{where}: master_port must be a TCP port in 1..65535, got {master_port!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(
            f"{where}: world_size must be an int >= 2 (trainer rank 0 and the engine's workers), got {world_size!r}"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"{where}: timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    if isinstance(packed_buffer_size_bytes, bool) or not isinstance(packed_buffer_size_bytes, int):
        raise ValueError(f"{where}: packed_buffer_size_bytes must be an int > 0, got {packed_buffer_size_bytes!r}")
    if packed_buffer_size_bytes <= 0:
        raise ValueError(f"{where}: packed_buffer_size_bytes must be an int > 0, got {packed_buffer_size_bytes!r}")


@dataclass
class GlooBcastInitInfo(WeightTransferInitInfo):
    """The engine workers' init info (vLLM's ``NCCLWeightTransferInitInfo``, TCP rendezvous only):
    the group at ``master_address:master_port`` of ``world_size`` ranks, the workers from
    ``rank_offset``; the wire (``packed``, its buffer) as the trainer encodes it."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 60.0
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    def __post_init__(self) -> None:
        _check_group("gloo_bcast init info", self)
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int):
            raise ValueError(
                f"gloo_bcast init info: rank_offset must be an int in 1..world_size-1, got {self.rank_offset!r}"
            )
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(
                f"gloo_bcast init info: rank_offset must be in 1..{self.world_size - 1} (rank 0 is the trainer), "
                f"got {self.rank_offset}"
            )


@dataclass
class GlooBcastTrainerInitInfo(TrainerInitInfo):
    """The trainer's init info (vLLM's ``NCCLTrainerInitInfo``): rank 0 opens the group at
    ``master_address:master_port`` (a free port of its host) of ``world_size`` ranks (1 + the
    engine's workers); ``packed`` by default, as vLLM's trainer; every wait at most ``timeout_s``."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 60.0
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"gloo_bcast trainer init info: rank must be an int >= 0 (0 sends), got {self.rank!r}")
        _check_group("gloo_bcast trainer init info", self)


@dataclass
class GlooBcastUpdateInfo(WeightTransferUpdateInfo):
    """One round's parameters, in the order rank 0 broadcasts them (vLLM's
    ``NCCLWeightTransferUpdateInfo``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(
                f"gloo_bcast update info: names, dtype_names and shapes must have one entry per parameter, "
                f"got {n}, {len(self.dtype_names)} and {len(self.shapes)}"
            )
        for name, dtype, shape in zip(self.names, self.dtype_names, self.shapes):
            if dtype not in DTYPES:
                raise ValueError(f"gloo_bcast update info: {name}: dtype must be one of {DTYPES}, got {dtype!r}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(
                    f"gloo_bcast update info: {name}: shape must be a list of ints >= 0, got {list(shape)!r}"
                )

    def metas(self) -> list[tuple[str, list[int], torch.dtype]]:
        return [(n, list(s), getattr(torch, d)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


# -- the group ---------------------------------------------------------------------------------
def _join(address: str, port: int, rank: int, world: int, timeout_s: float, me: str):
    """This process in the stateless gloo group (vLLM's ``stateless_init_torch_distributed_process_group``)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    try:
        return stateless_init_torch_distributed_process_group(
            address, port, rank, world, backend="gloo", timeout=timedelta(seconds=timeout_s)
        )
    except Exception as err:  # noqa: BLE001 - store and gloo errors: said with who did not come
        raise RuntimeError(
            f"gloo_bcast: {me} (rank {rank}): the group at {address}:{port} of {world} ranks (trainer rank 0, the "
            f"engine's workers 1..{world - 1}) did not form within {timeout_s} s: {type(err).__name__}: {err}"
        ) from None


def _broadcast(group, tensor: torch.Tensor, what: str, timeout_s: float, me: str, peers: str) -> None:
    """Broadcast ``tensor`` from rank 0 of ``group``; the group's timeout bounds it."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    try:
        group.broadcast([tensor], opts).wait()
    except Exception as err:  # noqa: BLE001 - gloo's timeout or a closed peer, named
        raise RuntimeError(
            f"gloo_bcast: {me}: the broadcast of {what} did not complete: {peers} did not answer within {timeout_s} s, "
            f"or left: "
            f"{type(err).__name__}: {err}"
        ) from None


def _destroy(group) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    stateless_destroy_torch_distributed_process_group(group)


def _chunks(metas: list[tuple[str, list[int], torch.dtype]], buffer_size: int) -> Iterator[list]:
    """The packed chunks of ``metas``: vLLM's ``packed_nccl_broadcast_consumer`` adds tensors to a
    chunk until its size exceeds ``buffer_size`` (``pack_tensors``, the producer, cuts alike)."""
    chunk, size = [], 0
    for name, shape, dtype in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk.append((name, shape, dtype, nbytes))
        size += nbytes
        if size > buffer_size:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} tensors {names[0]} .. {names[-1]}"


# -- the engine's workers ---------------------------------------------------------------------------
class GlooBcastWeightTransferEngine(WeightTransferEngine[GlooBcastInitInfo, GlooBcastUpdateInfo]):
    """Each vLLM worker's side (vLLM's ``NCCLWeightTransferEngine`` over gloo): receives every full
    tensor broadcast by trainer rank 0 and loads it with the model's ``load_weights`` inside vLLM's
    layerwise reload."""

    init_info_cls = GlooBcastInitInfo
    update_info_cls = GlooBcastUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.info: GlooBcastInitInfo | None = None
        self.rank = -1

    def init_transfer_engine(self, init_info: GlooBcastInitInfo) -> None:
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        if rank >= init_info.world_size:
            raise ValueError(
                f"gloo_bcast: this vLLM worker is rank {rank} of the group, whose world_size is {init_info.world_size}: "
                f"world_size must be 1 + every worker of the engine ({pc.data_parallel_size} x {pc.world_size})"
            )
        self.shutdown()  # a new trainer: a new group
        self.group = _join(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
            "vLLM worker",
        )
        self.info, self.rank = init_info, rank

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooBcastUpdateInfo) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.group is None or self.info is None:
            raise RuntimeError("gloo_bcast: update_weights before init_weight_transfer_engine")
        info, me = self.info, f"vLLM worker (rank {self.rank})"
        peers = "trainer rank 0"
        with disable_mtp_completeness_check():
            if info.packed:
                for chunk in _chunks(update_info.metas(), info.packed_buffer_size_bytes):
                    names, shapes, dtypes, sizes = (list(x) for x in zip(*chunk))
                    packed = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
                    _broadcast(self.group, packed, _span(names), info.timeout_s, me, peers)
                    self.model.load_weights(unpack_tensor(packed, names, shapes, dtypes, sizes))
            else:
                for name, shape, dtype in update_info.metas():
                    weight = torch.empty(shape, dtype=dtype, device=self.device)
                    _broadcast(self.group, weight, name, info.timeout_s, me, peers)
                    self.model.load_weights([(name, weight)])
                    del weight

    def shutdown(self) -> None:
        if self.group is not None:
            _destroy(self.group)
            self.group = None


# -- the trainer --------------------------------------------------------------------------------
class GlooBcastTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooBcastTrainerInitInfo]):
    """The trainer's side (vLLM's ``NCCLTrainerWeightTransferEngine`` over gloo), on every rank:
    rank 0 drives the round and broadcasts; the others only materialize each tensor with it.

    ``sent_bytes``: what the last round's broadcasts sent from this rank, counted as the payload
    times the receivers (a broadcast from the root to each worker); 0 on the other ranks."""

    init_info_cls = GlooBcastTrainerInitInfo

    def __init__(self, *, client, source, info: GlooBcastTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        self.group = None
        self.sent_bytes = 0

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if not isinstance(init_info, GlooBcastTrainerInitInfo):
            raise ValueError(
                f"gloo_bcast: init_info must be a GlooBcastTrainerInitInfo, got {type(init_info).__name__}"
            )
        if source is None:
            raise ValueError("gloo_bcast: trainer_init needs a WeightSource (vLLM's ModuleSource, for one)")
        engine = cls(client=client, source=source, info=init_info)
        if not engine.is_sender:
            return engine  # not in the group: it only materializes tensors with rank 0
        worker_info = GlooBcastInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
        )
        # the workers join inside init_weight_transfer_engine: on a side thread while rank 0 opens the group
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = _join(
                    init_info.master_address,
                    init_info.master_port,
                    0,
                    init_info.world_size,
                    init_info.timeout_s,
                    "trainer",
                )
            except RuntimeError:
                if future.done() and future.exception() is not None:
                    raise future.exception() from None  # the engine refused: its reason, not the timeout
                raise
            _result(future, init_info.timeout_s, "the engine's init_weight_transfer_engine")
        finally:
            exe.shutdown(wait=False)
        return engine

    def send_weights(self) -> None:
        with torch.no_grad():  # the full tensors are sent, not differentiated
            self._send()

    def _send(self) -> None:
        source, info = self.source, self.info
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:  # every rank materializes each tensor with rank 0 (a collective)
                pass
            return
        if self.group is None:
            raise RuntimeError("gloo_bcast: send_weights after shutdown")
        update = GlooBcastUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.sent_bytes = 0
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(update))
            if future.done():
                future.result()  # refused before any broadcast
            self._broadcast(_checked(source, meta))
            _result(future, info.timeout_s, "the engine's update_weights")
        finally:
            exe.shutdown(wait=False)  # a worker stuck in a broadcast must not hang the trainer
        self.client.finish_weight_update()

    def _broadcast(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        info = self.info
        receivers = info.world_size - 1
        peers = f"the engine's workers (ranks 1..{receivers})"
        if info.packed:
            while (chunk := pack_tensors(pairs, lambda item: item[1], info.packed_buffer_size_bytes)) is not None:
                _broadcast(self.group, chunk.packed_tensor, _span(chunk.names), info.timeout_s, "trainer rank 0", peers)
                self.sent_bytes += chunk.packed_tensor.numel() * receivers
        else:
            for name, tensor in pairs:
                send = tensor if tensor.is_contiguous() else tensor.contiguous()
                _broadcast(self.group, send, name, info.timeout_s, "trainer rank 0", peers)
                self.sent_bytes += send.numel() * send.element_size() * receivers

    def shutdown(self) -> None:
        if self.group is not None:
            _destroy(self.group)
            self.group = None


def _result(future, timeout_s: float, what: str) -> None:
    try:
        future.result(timeout=timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"gloo_bcast: {what} did not return within {timeout_s} s") from None


def _checked(source, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against its metadata (what the workers were told to
    receive): vLLM's ``NCCLTrainerWeightTransferEngine._checked_iter``."""
    sent = 0
    for name, tensor in source:
        if sent >= len(meta):
            raise ValueError(
                f"gloo_bcast: the WeightSource yielded more than the {len(meta)} parameters its metadata declared ({name!r})"
            )
        want = meta[sent]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(
                f"gloo_bcast: the WeightSource's metadata declared {want.name!r} {want.dtype} {tuple(want.shape)} at "
                f"index {sent}, its iteration yielded {name!r} {tensor.dtype} {tuple(tensor.shape)}"
            )
        sent += 1
        yield name, tensor
    if sent != len(meta):
        raise ValueError(f"gloo_bcast: the WeightSource yielded {sent} parameters, its metadata declared {len(meta)}")
