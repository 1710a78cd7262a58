"""Point-to-point transport between the workers of one world: a private torch.distributed group.

NCCL when the worker's buffers live on a GPU (one GPU per worker), gloo otherwise; the calls
are the same (``communicator.exchange``: send and receive posted together), so CPU CI runs every
line here except the device-specific setup. GPU buffers over gloo (workers sharing a GPU, where
NCCL refuses to pair two ranks of one device) are staged through pinned host memory
(:class:`HostStaging`), which the CPU suite also runs by staging host tensors. One process group per world and generation (re-created only
after a failure or when the set of actors changes), never one per step or per pair.

The group is *private* (``actors/wire/communicator.py``, built like vLLM's stateless process groups):
a ``ProcessGroup`` on a ``PrefixStore(prefix, store)`` with a gloo or NCCL backend registered
on it, never registered in torch's global state. So the worker process stays free for user code
that owns torch.distributed's default group (Megatron, FSDP, a vLLM engine): the transport never
calls ``init_process_group``/``destroy_process_group``, and the user's calls to them leave it
working. Two transports (two worlds, e.g. two model groups) can live in one process.

Measured here (``python benchmarks/transport_construction.py``, gloo, 2 and 4 processes on this
2-core machine; numbers in docs/architecture.md, "Private transport"): constructing a private
group costs about what ``init_process_group`` or ``new_group`` costs, and one 64 MiB exchange
moves as fast over it as over a registered group: the backend is the same object either way.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from actors.wire import communicator


def host_rendezvous(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, created by rank 0 on a port the OS picks (no port race)."""
    return dist.TCPStore(
        addr, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


#: NCCL error handling for the transport's process groups. torch's default (3, SkipCleanUp) tears
#: the process down when a collective times out: every survivor of a failed peer would die and
#: lose its weights. 2 (CleanUpOnly) aborts the communicator and raises instead, and blocking wait
#: makes ``work.wait()`` raise on the timeout, so the protocol can roll the survivors back. (Ray
#: Train sets 1, TearDown, because it restarts the whole worker group from a checkpoint anyway.)
#: Values from ``ErrorHandlingMode`` in torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp.
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}


def connect_rendezvous(addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of a store :func:`host_rendezvous` opened (every member but the host)."""
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


#: How often a member waiting for the others at a world's rendezvous checks whether it was aborted.
CHECK_IN_POLL_S = 0.02


def check_in_keys(world_id: str) -> tuple[str, str]:
    """The store keys of ``world_id``'s check-in: the count of members arrived, and the abort mark."""
    return f"realloc-check-in/{world_id}/joined", f"realloc-check-in/{world_id}/abort"


def check_in(store: dist.Store, world_id: str, world_size: int, timeout_s: float, aborted: Callable[[], bool]) -> None:
    """Count this member in at ``world_id``'s rendezvous and wait until all ``world_size`` are,
    before any process group is built over the store (which would block up to ``timeout_s``
    on a member that never comes: a dead one). Leaves at once, with ``RuntimeError``, when the
    formation was aborted (``aborted()``, or the mark in the store: the driver gave up on a
    member), so the members that are alive are free again for the next formation within
    :data:`CHECK_IN_POLL_S`; ``TimeoutError`` after ``timeout_s``."""
    joined, abort = check_in_keys(world_id)
    store.add(joined, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if aborted() or store.check([abort]):
            raise RuntimeError(
                f"the formation of world {world_id} was aborted (a member did not join, or refused its share)"
            )
        arrived = store.add(joined, 0)
        if arrived >= world_size:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"world {world_id}: {arrived} of {world_size} members joined its rendezvous within {timeout_s:.0f}s"
            )
        time.sleep(CHECK_IN_POLL_S)


def abort_formation(store: dist.Store, world_id: str) -> None:
    """Mark ``world_id``'s formation aborted on its rendezvous ``store``: every member waiting at
    its check-in, and every one that comes later, leaves at once (:func:`check_in`). What a
    member that refuses its share before joining does, so the others do not wait for it until
    their deadline; and what the driver does when it gives up on a member."""
    store.set(check_in_keys(world_id)[1], "1")


def process_group_environment(backend: str) -> dict[str, str]:
    """Environment variables the transport sets (unless the user did) before creating a group."""
    return dict(NCCL_ENVIRONMENT) if backend == "nccl" else {}


def backend_for(device: torch.device) -> str:
    """The default backend for buffers on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where the tensors a ``backend`` group sends must live: the buffers' own device for NCCL,
    host memory for gloo (whose send/recv read raw host pointers)."""
    return device if backend == "nccl" else torch.device("cpu")


class HostStaging:
    """Carries device tensors over a host-memory backend (gloo between workers that share a GPU,
    or whose GPUs NCCL cannot pair): a send is copied into a host buffer first, a receive lands
    in one and is copied to its device tensor when its request is waited on.

    Two host buffers, ``send`` and ``recv``, kept and grown to the largest message (one bucket
    each at most: the executor's messages are bucket-bounded), pinned when CUDA is there so the
    copies run at full PCIe speed. ``always``: stage host tensors too (tests: the CPU suite runs
    every line the GPU path runs, with host copies in place of the device ones).
    """

    def __init__(self, always: bool = False):
        self.always = always
        self.buffers: dict[str, torch.Tensor] = {}

    def needed(self, t: torch.Tensor) -> bool:
        return self.always or t.device.type != "cpu"

    def host(self, slot: str, nbytes: int) -> torch.Tensor:
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buf[:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def outgoing(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s bytes in the host send buffer (a blocking copy: the buffer is reused next message)."""
        src = t.reshape(-1).view(torch.uint8)
        host = self.host("send", src.numel())
        host.copy_(src)
        return host

    def incoming(self, t: torch.Tensor) -> tuple[torch.Tensor, "_Landing"]:
        """The host buffer to receive ``t``'s bytes into, and what copies them to ``t`` afterwards."""
        dst = t.reshape(-1).view(torch.uint8)
        return self.host("recv", dst.numel()), _Landing(dst)


class _Landing:
    """Wraps a receive's request: ``wait()`` waits for the bytes, then copies them to the device
    tensor (blocking, so the host buffer is free for the next message when it returns)."""

    def __init__(self, dst: torch.Tensor):
        self.dst, self.host, self.work = dst, None, None

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.dst.copy_(self.host)
        return True


class Transport:
    """This worker's membership in a world's private process group (``self.pg``).

    ``backend``: ``"nccl"`` or ``"gloo"`` (default: :func:`backend_for` the buffers' device). With
    gloo and device buffers, messages are staged through host memory (:class:`HostStaging`).
    """

    def __init__(
        self,
        store_addr: str,
        store_port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        store: dist.TCPStore | None = None,
        *,
        prefix: str = "realloc",
        backend: str | None = None,
        staging: HostStaging | None = None,
    ):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = backend if backend is not None else backend_for(device)
        if self.backend not in ("nccl", "gloo") or (self.backend == "nccl" and device.type != "cuda"):
            raise ValueError(
                f"backend {self.backend!r} cannot carry buffers on {device}; allowed: 'gloo', or "
                "'nccl' for CUDA buffers"
            )
        self.wire = wire_device(self.backend, device)
        self.host_staging = staging if staging is not None else HostStaging()
        if store is None:
            store = connect_rendezvous(store_addr, store_port, world_size, timeout_s)
        # gloo binds its data sockets to the interface of the hostname unless told otherwise; on
        # hosts whose name resolves to 127.0.0.1 that breaks multi-node, so pin the node's NIC.
        ip = ray_node_ip()
        ifname = _interface_of(ip) if ip else None
        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        for key, value in process_group_environment(self.backend).items():
            os.environ.setdefault(key, value)
        self.pg = communicator.private_group(store, prefix, rank, world_size, self.wire, timeout_s)
        self.store = store

    def exchange(self, send: tuple[int, torch.Tensor] | None, recv: tuple[int, torch.Tensor] | None) -> list:
        """Post one send and/or one receive together; returns the requests to wait on (a staged
        receive's bytes are in its tensor once its request's ``wait()`` returned)."""
        if self.wire.type == "cuda":
            return communicator.exchange(self.pg, self.wire, send, recv)
        staging, landing = self.host_staging, None
        if send is not None and staging.needed(send[1]):
            send = (send[0], staging.outgoing(send[1]))
        if recv is not None and staging.needed(recv[1]):
            host, landing = staging.incoming(recv[1])
            recv = (recv[0], host)
        works = communicator.exchange(self.pg, self.wire, send, recv)
        if landing is not None:
            landing.host, landing.work = recv[1], works.pop()  # the receive is posted last
            works.append(landing)
        return works

    def posts_ahead(self, t: torch.Tensor) -> bool:
        """Whether a message of ``t`` may be posted while earlier messages between the same pair
        are still in flight: gloo posts asynchronously and matches a pair's messages in posting
        order, and a host tensor needs none of the host staging buffers (one per direction).
        Not on NCCL: its sends and receives outside one group call can block each other."""
        return self.wire.type != "cuda" and self.backend == "gloo" and not self.host_staging.needed(t)

    def barrier(self) -> None:
        communicator.barrier(self.pg, self.wire)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        communicator.close(pg)


def ray_node_ip() -> str | None:
    """This node's Ray IP inside a Ray worker; None elsewhere (the transport does not need Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.util.get_node_ip_address()


def address_toward(peer: str) -> str:
    """This host's address on the route to ``peer`` (no packet is sent; 127.0.0.1 without a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _interface_of(addr: str) -> str | None:
    try:
        import psutil  # shipped with ray[default]
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


def join_world(
    addr: str,
    port: int,
    world_id: str,
    rank: int,
    size: int,
    timeout_s: float,
    prefix: str,
    aborted: Callable[[], bool] = lambda: False,
    store: dist.TCPStore | None = None,
) -> Transport:
    """Join world ``world_id`` (rendezvous ``addr:port``; ``store``: the host's own) as ``rank`` of
    ``size`` over gloo on host memory: check in (leaving when ``aborted()``), then the transport,
    keyed ``<prefix>/<world id>``, returned once every member has built it (:func:`built_by_all`).
    What a process outside realloc's actors runs (a vLLM worker, a user's trainer rank)."""
    if store is None:
        store = connect_rendezvous(addr, port, size, timeout_s)
    started = time.monotonic()
    check_in(store, world_id, size, timeout_s, aborted)
    return built_together(
        store,
        world_id,
        rank,
        size,
        max(timeout_s - (time.monotonic() - started), 0.1),
        lambda: Transport(
            addr,
            port,
            rank,
            size,
            torch.device("cpu"),
            timeout_s,
            store=store,
            prefix=f"{prefix}/{world_id}",
            backend="gloo",
        ),
    )


def built_together(
    store: dist.Store, world_id: str, rank: int, world_size: int, timeout_s: float, build: Callable[[], "Transport"]
) -> "Transport":
    """This member's transport of ``world_id`` (``build()``), returned once every member has built
    its own (:func:`built_by_all`); a member whose ``build()`` fails says so to the others, who
    leave at once. Every member of a world, whatever process it is in, builds through here."""
    try:
        transport = build()
    except BaseException as err:
        _post_quietly(
            store, built_keys(world_id)[1], f"member {rank} could not build its group: {type(err).__name__}: {err}"
        )
        raise
    try:
        built_by_all(store, world_id, world_size, timeout_s)
    except BaseException:
        transport.close()
        raise
    return transport


def built_keys(world_id: str) -> tuple[str, str]:
    """The store keys of ``world_id``'s second count: the members whose group is built, and the
    outcome (``"all"``, or what a member that could not build its group said)."""
    return f"realloc-built/{world_id}/count", f"realloc-built/{world_id}/outcome"


def built_by_all(store: dist.Store, world_id: str, world_size: int, timeout_s: float) -> None:
    """Count this member's group of ``world_id`` built and wait until every member's is.

    A member whose own group is built may still be a pair another member is connecting to:
    gloo connects every pair while the group is constructed, and a member that leaves (closes its
    group) before the others are done makes their construction fail with "Connection closed by
    peer" (seen when a member has nothing to send and leaves at once). So no member uses, or
    leaves, a world before all have built it. ``RuntimeError`` with what a member that could not
    build its group said; ``TimeoutError`` naming how many did within ``timeout_s``."""
    count, outcome = built_keys(world_id)
    if store.add(count, 1) >= world_size:
        store.set(outcome, "all")
    try:
        store.wait([outcome], datetime.timedelta(seconds=timeout_s))
    except Exception as err:  # noqa: BLE001 - torch raises DistStoreError (a RuntimeError) on timeout
        try:
            built = f"{store.add(count, 0)} of {world_size}"
        except Exception:  # noqa: BLE001 - the store itself is gone: say so
            built = f"(the store did not answer) of {world_size}"
        raise TimeoutError(f"world {world_id}: {built} members built its group within {timeout_s:.0f}s") from err
    said = store.get(outcome).decode()
    if said != "all":
        raise RuntimeError(f"world {world_id}: {said}")


def _post_quietly(store: dist.Store, key: str, value: str) -> None:
    try:
        store.set(key, value)
    except Exception:  # noqa: BLE001 - best effort: the others time out on their own
        pass
