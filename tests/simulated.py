"""A simulated multi-node Ray cluster for the integration tests (kept between the modules of one
pytest process that ask for the same shape)."""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from types import SimpleNamespace
from typing import Iterator

import ray
from ports import free_port  # noqa: F401 - the tests' one port picker, handed on
from ray.cluster_utils import Cluster

#: The cluster this test process keeps between modules: ``(key, cluster, added nodes)``, or None.
#: Starting a simulated cluster (a GCS, a raylet, a dashboard agent and a runtime-env agent per
#: node) is most of a Ray module's setup on these 2 cores; modules asking for the same shape
#: reuse it (tests/conftest.py sends them to the same pytest process).
_kept: tuple | None = None


def _key(nodes: int, cpus_per_node: int, gpus_per_node: int) -> tuple:
    # RAY_* variables are read by the cluster's processes when they start (a test that sets one,
    # e.g. the metrics report interval, gets a cluster started with it)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("RAY_")))
    return nodes, cpus_per_node, gpus_per_node, env


def _intact(cluster: Cluster, added: list) -> bool:
    """Every node the cluster was started with, and only those, with all their processes alive."""
    now = cluster.list_all_nodes()
    started = [cluster.head_node, *added]
    return [n.unique_id for n in now] == [n.unique_id for n in started] and all(
        n.remaining_processes_alive() for n in now
    )


def _discard() -> None:
    global _kept
    if _kept is not None:
        _, cluster, _ = _kept
        _kept = None
        cluster.shutdown()


atexit.register(_discard)


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int = 0) -> Iterator[SimpleNamespace]:
    """``nodes`` raylets of ``cpus_per_node`` CPU slots each (distinct node ids, one machine), a
    head without CPUs, and this process connected as the driver. ``gpus_per_node``: GPUs each
    raylet announces (on a one-GPU machine every node hands out the same device, so two
    simulated nodes share it).

    On exit the driver disconnects, and Ray kills every actor it created. The cluster itself is
    kept for the next module of this process that asks for the same shape, unless the module
    changed it (a node added, removed or killed): then it is shut down."""
    global _kept
    if ray.is_initialized():
        ray.shutdown()
    key = _key(nodes, cpus_per_node, gpus_per_node)
    if _kept is not None and not (_kept[0] == key and _intact(_kept[1], _kept[2])):
        _discard()
    if _kept is None:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
        try:
            added = [c.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node) for _ in range(nodes)]
        except BaseException:
            c.shutdown()
            raise
        _kept = (key, c, added)
    _, c, added = _kept
    try:
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        _wait_for_free_cpus(nodes * cpus_per_node)
        yield SimpleNamespace(cluster=c, nodes=list(added))
    finally:
        ray.shutdown()
        if not _intact(c, added):
            _discard()


def _wait_for_free_cpus(total: int, timeout_s: float = 60) -> None:
    """Until the CPU slots the previous module's actors held are free again (Ray kills a
    departed driver's actors asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0)) < total:
        assert time.monotonic() < deadline, f"the kept cluster has {free} of {total} CPU slots free after {timeout_s} s"
        time.sleep(0.2)


def wait_for_dead_workers(group, timeout_s: float = 60) -> list[int]:
    """Poll until Ray reports some of ``group``'s workers dead (after a node was removed)."""
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


class KeptGroups:
    """Groups the tests of one module take in turn: starting a worker is ~1.7 CPU-seconds on this
    machine (importing torch most of it) and most of a Ray test's cost, while bringing a kept group
    to a layout and a seed's weights is a tenth of a second. ``make(name, topology, seed)`` creates
    a group; :meth:`take` returns the kept group of that name, checked and brought to
    ``topology`` with ``seed``'s weights (or a new one when the kept one is not healthy: a dead
    worker, an update staged, a failed step). A test that kills, stops or replaces workers, or
    needs other settings, makes its own group. :meth:`close` at the module's end."""

    def __init__(self, make):
        self._make = make
        self._kept: dict = {}

    def take(self, name: str, topology: str, seed: "int | None" = 1):
        from realloc import Topology

        group = self._kept.pop(name, None)
        if group is not None:
            try:
                assert not group.dead_workers() and group.ledger.staged is None and not group.ledger.closed
                group.release_resident()
                if group.layout.topology != Topology.parse(topology):
                    group.reallocate(topology)
                if seed is not None:
                    group.init_synthetic(seed)
            except Exception:  # noqa: BLE001 - a previous test left it broken: start a new one
                group.shutdown()
                group = None
        if group is None:
            self._room(Topology.parse(topology).world_size)
            group = self._make(name, topology, seed=seed)
        self._kept[name] = group
        return group

    def _room(self, workers: int) -> None:
        """Shut kept groups down, least recently taken first, until ``workers`` CPU slots are free
        (a kept group holds one per worker)."""
        import ray

        while self._kept and (free := ray.available_resources().get("CPU", 0)) < workers:
            group = self._kept.pop(next(iter(self._kept)))
            group.shutdown()
            # until its slots are back (Ray frees them asynchronously), so no second group goes for nothing
            _wait_for_free_cpus(min(workers, free + group.num_workers), timeout_s=30)

    def close(self) -> None:
        """Shut every kept group down (before a test that needs the cluster's slots for its own:
        its placement group waits for them)."""
        for group in self._kept.values():
            group.shutdown()
        self._kept.clear()
