"""Starting Ray for the commands: attach to a cluster, or simulate nodes on this machine."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import ray


@contextlib.contextmanager
def ray_for_command(
    address: str | None,
    num_nodes: int,
    cpus_per_node: int,
    object_store_bytes: int | None = None,
    gpus_per_node: int = 0,
) -> Iterator[str]:
    """Attach to ``address``, or start ``num_nodes`` simulated nodes (distinct Ray node ids).

    Yields a description of what it started. Simulated nodes share this machine but are real
    raylets, so placement, node ids and node loss behave as on a cluster. They get 150 MiB
    object stores unless ``object_store_bytes`` says otherwise.
    """
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if address:
        ray.init(address=address, log_to_driver=False)
        try:
            yield f"attached to {address} ({len(ray.nodes())} nodes)"
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    store = {"object_store_memory": object_store_bytes} if object_store_bytes else {}
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False, **store}
    )
    try:
        for _ in range(num_nodes):
            cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node, **store)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        stores = f", object stores {object_store_bytes / 2**30:.1f} GiB" if object_store_bytes else ""
        gpus = f" and {gpus_per_node} GPU" if gpus_per_node else ""
        yield f"local Ray, {num_nodes} simulated nodes x {cpus_per_node} CPU slots{gpus}{stores}"
    finally:
        ray.shutdown()
        cluster.shutdown()
