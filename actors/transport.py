"""Point-to-point transport between the workers of one group: one torch.distributed process group.

NCCL when the worker's buffers live on a GPU, gloo otherwise; the calls are the same
(``batch_isend_irecv``), so CPU CI runs every line here except the device-specific setup.
One process group per model group and generation (re-created only after a failure), never one
per step or per pair: NCCL opens a connection per peer pair lazily inside that one communicator.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def host_store(addr: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, created by rank 0 on a port the OS picks (no port race)."""
    return dist.TCPStore(addr, 0, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


#: NCCL error handling for the transport's process groups. torch's default (3, SkipCleanUp) tears
#: the process down when a collective times out: every survivor of a failed peer would die and
#: lose its weights. 2 (CleanUpOnly) aborts the communicator and raises instead, and blocking wait
#: makes ``work.wait()`` raise on the timeout, so the protocol can roll the survivors back. (Ray
#: Train sets 1, TearDown, because it restarts the whole worker group from a checkpoint anyway.)
#: Values from ``ErrorHandlingMode`` in torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp.
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}


def process_group_environment(backend: str) -> dict[str, str]:
    """Environment variables the transport sets (unless the user did) before creating a group."""
    return dict(NCCL_ENVIRONMENT) if backend == "nccl" else {}


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Transport:
    """This worker's membership in the group's process group."""

    def __init__(self, store_addr: str, store_port: int, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, store: dist.TCPStore | None = None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = backend_for(device)
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(store_addr, store_port, world_size, is_master=False, timeout=timeout)
        # gloo binds its data sockets to the interface of the hostname unless told otherwise; on
        # hosts whose name resolves to 127.0.0.1 that breaks multi-node, so pin the node's NIC.
        ifname = _interface_of(ray_node_ip())
        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        for key, value in process_group_environment(self.backend).items():
            os.environ.setdefault(key, value)
        kwargs = {"device_id": device} if self.backend == "nccl" else {}
        dist.init_process_group(backend=self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
        self.store = store

    def exchange(self, send: tuple[int, torch.Tensor] | None, recv: tuple[int, torch.Tensor] | None) -> list:
        """Post one send and/or one receive together; returns the requests to wait on."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send[1], send[0]))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv[1], recv[0]))
        return dist.batch_isend_irecv(ops) if ops else []

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def ray_node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _interface_of(addr: str) -> str | None:
    try:
        import psutil  # shipped with ray[default]
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None
