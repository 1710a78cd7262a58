"""Private process groups: torch.distributed communicators that never touch the default group.

The transport must live in processes that also run user code which owns torch's global state (a
Megatron or FSDP trainer, a vLLM engine): ``dist.init_process_group`` replaces the default group,
``dist.new_group`` needs one, and a user's ``dist.destroy_process_group()`` destroys every group
registered in torch's global ``_world``. So this module builds groups the way vLLM's
``stateless_init_torch_distributed_process_group`` does (vllm/distributed/utils.py): a bare
``ProcessGroup`` on a ``PrefixStore`` over our own store, with one backend registered on it
(``ProcessGroupGloo`` for CPU tensors, ``ProcessGroupNCCL`` for CUDA ones; one code path), and
never registered in ``_world``. Such a group works with ``dist.all_reduce(t, group=pg)`` and the
other collectives, and survives the user's ``init_process_group``/``destroy_process_group``.

``dist.P2POp``/``batch_isend_irecv`` refuse unregistered groups, so :func:`exchange` does what
``batch_isend_irecv`` does underneath: ``pg.send``/``pg.recv`` on the group, wrapped for NCCL in
``pg._start_coalescing``/``pg._end_coalescing`` (torch's ``_coalescing_manager``), so two ranks
that send to each other at once cannot deadlock. gloo's send/recv are asynchronous and need no
coalescing.

torch only: no Ray here.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup

from realloc._checks import check_int, check_number, check_positive, is_int

log = logging.getLogger(__name__)

_TAG = 0

#: Point-to-point messages this process posted on private groups, cumulative: ``{direction:
#: {kind: [messages, bytes]}}`` with direction ``sent``/``received`` and kind ``data``
#: (:func:`exchange`: the plan's transfers) or ``control`` (:func:`post`: zero-copy handles,
#: fan-out readiness). Read on a worker with :func:`traffic` (``realloc bench-scale``).
TRAFFIC: dict[str, dict[str, list[int]]] = {d: {k: [0, 0] for k in ("data", "control")} for d in ("sent", "received")}


def traffic() -> dict[str, dict[str, list[int]]]:
    """A copy of :data:`TRAFFIC` (this process's messages and bytes so far)."""
    return {d: {k: list(v) for k, v in kinds.items()} for d, kinds in TRAFFIC.items()}


def _count(kind: str, sends, recvs) -> None:
    for direction, ops in (("sent", sends), ("received", recvs)):
        tally = TRAFFIC[direction][kind]
        for _, t in ops:
            tally[0] += 1
            tally[1] += t.numel() * t.element_size()


def _check_group_args(rank: int, size: int, device: torch.device, timeout_s: float) -> None:
    check_positive("size", size)
    check_int("rank", rank, 0, size - 1)
    if not isinstance(device, torch.device) or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a torch.device of type cpu or cuda, got {device!r}")
    check_number("timeout_s", timeout_s, positive=True)


def private_group(
    store: dist.Store, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float
) -> ProcessGroup:
    """A process group over ``size`` ranks that torch's global state does not know about.

    Collective: every one of the ``size`` ranks must call it with the same ``store`` (or stores
    reaching the same server) and ``prefix``; it returns once all have (gloo connects every pair
    here; NCCL creates its communicator here, eagerly, so that a later batch of point-to-point
    operations among a subset of the ranks does not need every rank). A ``prefix`` must not be
    reused on the same store: the rendezvous keys of an earlier group would pair the wrong ranks.

    Built as vLLM's ``stateless_init_torch_distributed_process_group`` (vllm/distributed/utils.py)
    builds its groups, not with ``dist.new_group`` (which needs the default group) nor
    ``dist.init_process_group`` (which takes the default group from the user, and whose groups a
    user's ``dist.destroy_process_group()`` would destroy): this group lives as long as the
    returned object, whatever the user does with torch.distributed.
    """
    if not isinstance(store, dist.Store):
        raise ValueError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty str, got {prefix!r}")
    _check_group_args(rank, size, device, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(f"{prefix}/", store)
    pg = ProcessGroup(prefixed, rank, size)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL

        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.group_name = prefix
        backend = ProcessGroupNCCL(prefixed, rank, size, options)
        backend_type = ProcessGroup.BackendType.NCCL
    else:
        from torch.distributed import ProcessGroupGloo

        # Reads GLOO_SOCKET_IFNAME (the interface its data sockets bind to) here.
        backend = ProcessGroupGloo(prefixed, rank, size, timeout=timeout)
        backend_type = ProcessGroup.BackendType.GLOO
    pg._set_default_backend(backend_type)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device(device.type), backend_type, backend)
    if device.type == "cpu" and torch.cuda.is_available():
        # as init_process_group("gloo") does: gloo also serves CUDA tensors (its collectives
        # stage them through host memory), so user code on workers that share a GPU can
        # all_reduce its CUDA tensors over ctx.groups
        pg._register_backend(torch.device("cuda"), backend_type, backend)
    pg._set_group_name(f"realloc:{prefix}")
    if device.type == "cuda":
        # What init_process_group(device_id=...) does: create the communicator now, while every
        # rank is here, and bind the group to this device.
        pg.bound_device_id = device
        backend.eager_connect_single_device(device)
    return pg


def exchange(
    pg: ProcessGroup, device: torch.device, send: tuple[int, torch.Tensor] | None, recv: tuple[int, torch.Tensor] | None
) -> list:
    """Post one send and/or one receive (group ranks, tensors) together; returns the Works to wait on.

    Coalesced where the backend supports it (NCCL: one group call, so a pair that sends to each
    other cannot deadlock); gloo posts both asynchronously. The peer must post the matching
    operations, in the same order for repeated transfers between the same pair.
    """
    if send is None and recv is None:
        return []
    size = pg.size()
    for what, op in (("send", send), ("recv", recv)):
        if op is not None and not (isinstance(op[0], int) and 0 <= op[0] < size):
            raise ValueError(f"{what} peer must be a rank of the group in [0, {size}), got {op[0]!r}")
    _count("data", [send] if send is not None else [], [recv] if recv is not None else [])
    coalesce = pg._get_backend(device).supports_coalescing
    if not coalesce:
        works = []
        if send is not None:
            works.append(pg.send([send[1]], send[0], _TAG))
        if recv is not None:
            works.append(pg.recv([recv[1]], recv[0], _TAG))
        return works
    pg._start_coalescing(device)
    try:
        if send is not None:
            pg.send([send[1]], send[0], _TAG)
        if recv is not None:
            pg.recv([recv[1]], recv[0], _TAG)
    finally:
        work = pg._end_coalescing(device)
    return [work] if work is not None else []


def post(
    pg: ProcessGroup,
    device: torch.device,
    sends: list[tuple[int, torch.Tensor]],
    recvs: list[tuple[int, torch.Tensor]],
    tag: int,
) -> list:
    """Post several sends and receives (group ranks, tensors) at once on ``tag``; returns the
    Works to wait on. Small control messages (handles, readiness) outside a plan's steps; one
    coalesced group call where the backend supports it (NCCL), all asynchronous on gloo."""
    if not sends and not recvs:
        return []
    _count("control", sends, recvs)
    if not pg._get_backend(device).supports_coalescing:
        return [pg.send([t], peer, tag) for peer, t in sends] + [pg.recv([t], peer, tag) for peer, t in recvs]
    pg._start_coalescing(device)
    try:
        for peer, t in sends:
            pg.send([t], peer, tag)
        for peer, t in recvs:
            pg.recv([t], peer, tag)
    finally:
        work = pg._end_coalescing(device)
    return [work] if work is not None else []


def barrier(pg: ProcessGroup, device: torch.device) -> None:
    """Wait until every rank of ``pg`` got here (an all-reduce of one element on ``device``, which
    works the same for gloo and NCCL and needs no device guess)."""
    pg.allreduce([torch.zeros(1, device=device)]).wait()


def close(pg: ProcessGroup | None) -> None:
    """Release ``pg``'s communicator, best effort. NCCL: abort it (a peer may be dead after a
    failure, so a graceful shutdown could wait for it); gloo: drop it (its sockets close with it).
    Never raises."""
    if pg is None:
        return
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - no CUDA backend registered: gloo
        return
    try:
        backend.abort()
    except Exception as exc:  # noqa: BLE001 - best effort
        log.warning("aborting NCCL communicator %s failed: %s", pg.group_name, exc)


class Communicators:
    """One worker's private process groups over subsets of one model group's ranks.

    ``store`` is shared by the ``world_size`` workers; ``generation`` prefixes every key this
    object writes to it (use a new generation after a failure, or for a new set of workers: keys
    of a group formed under an old generation must never pair with a new one). Groups are created
    on first use and cached by their (sorted) rank tuple, so alternating between layouts forms no
    new communicator after the first round.

    Not thread-safe: use it from one thread per worker.
    """

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float, generation: str
    ):
        if not isinstance(store, dist.Store):
            raise ValueError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        _check_group_args(rank, world_size, device, timeout_s)
        if not isinstance(generation, str) or not generation:
            raise ValueError(f"generation must be a non-empty str, got {generation!r}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.device, self.timeout_s, self.generation = device, float(timeout_s), generation
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        self.created = 0
        self.closed = False

    def _key(self, ranks) -> tuple[int, ...]:
        if not isinstance(ranks, (tuple, list)) or not ranks:
            raise ValueError(f"ranks must be a non-empty tuple of ints, got {ranks!r}")
        bad = [r for r in ranks if not is_int(r) or not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks must be ints in [0, {self.world_size}), got {bad} in {tuple(ranks)}")
        key = tuple(sorted(ranks))
        if len(set(key)) != len(key):
            raise ValueError(f"ranks must not repeat, got {tuple(ranks)}")
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not a member of the group {key}: only members may ask for it")
        return key

    def group(self, ranks: tuple[int, ...]) -> ProcessGroup:
        """The private group over ``ranks`` (their order does not matter; group rank i is the i-th
        smallest). Like ``dist.new_group``, creating it is collective over its members: every
        member must call ``group`` with the same ranks, and the first call of each returns only
        once all of them have (or raises after ``timeout_s``). Non-members do not take part.
        Later calls return the cached group without talking to anyone."""
        if self.closed:
            raise ValueError(f"Communicators of generation {self.generation!r} are closed")
        key = self._key(ranks)
        pg = self._groups.get(key)
        if pg is None:
            prefix = f"{self.generation}/{'-'.join(map(str, key))}"
            pg = private_group(self.store, prefix, key.index(self.rank), len(key), self.device, self.timeout_s)
            self._groups[key] = pg
            self.created += 1
            log.debug("rank %d formed private group %s", self.rank, prefix)
        return pg

    def group_rank(self, ranks: tuple[int, ...], rank: int) -> int:
        """The rank within ``group(ranks)`` of worker ``rank``."""
        key = self._key(ranks)
        if rank not in key:
            raise ValueError(f"rank {rank} is not a member of the group {key}")
        return key.index(rank)

    def close(self) -> None:
        """Close every group (best effort); the object cannot form groups afterwards."""
        groups, self._groups = list(self._groups.values()), {}
        self.closed = True
        for pg in groups:
            close(pg)
