"""A simulated multi-node Ray cluster for the integration tests (one per test module)."""

from __future__ import annotations

import contextlib
import socket
from types import SimpleNamespace
from typing import Iterator

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int) -> Iterator[SimpleNamespace]:
    """``nodes`` raylets of ``cpus_per_node`` CPU slots each (distinct node ids, one machine), a
    head without CPUs, and this process connected as the driver; all of it torn down afterwards."""
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        added = [c.add_node(num_cpus=cpus_per_node) for _ in range(nodes)]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield SimpleNamespace(cluster=c, nodes=added)
    finally:
        ray.shutdown()
        c.shutdown()


def free_port() -> int:
    """A TCP port free on this machine now (for a user's own process group in the workers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
