"""A simulated multi-node Ray cluster for the integration tests (one per test module)."""

from __future__ import annotations

import contextlib
import socket
from types import SimpleNamespace
from typing import Iterator

import ray
from ray.cluster_utils import Cluster


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int = 0) -> Iterator[SimpleNamespace]:
    """``nodes`` raylets of ``cpus_per_node`` CPU slots each (distinct node ids, one machine), a
    head without CPUs, and this process connected as the driver; all of it torn down afterwards.
    ``gpus_per_node``: GPUs each raylet announces (on a one-GPU machine every node hands out the
    same device, so two simulated nodes share it)."""
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    try:
        added = [c.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node) for _ in range(nodes)]
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


def wait_for_dead_workers(group, timeout_s: float = 60) -> list[int]:
    """Poll until Ray reports some of ``group``'s workers dead (after a node was removed)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (dead := group.dead_workers()):
        assert time.monotonic() < deadline, "Ray never noticed the lost node"
        time.sleep(0.5)
    return dead


def lose_node(env, node_id: str, group) -> list[int]:
    """Remove the simulated node ``node_id`` (``env`` from :func:`simulated_cluster`: ``cluster``
    and ``nodes``) and wait until ``group`` sees its workers dead; returns their ranks."""
    env.cluster.remove_node(next(n for n in env.nodes if n.node_id == node_id))
    return wait_for_dead_workers(group)
