"""The GPU path on one GPU: workers with CUDA buffers sharing the device (``gpus_per_worker`` a
fraction), zero-copy reads of each other's buffers through CUDA IPC, packing on the GPU, and the
gloo transport staging through pinned host memory where zero-copy does not reach (another
simulated node, or ``zero_copy=False``). Skipped where torch sees no CUDA device (CI has none):
run on a GPU machine with ``python -m pytest -q tests/test_gpu_ray.py``.

Every move is checked element by element against the synthetic weights, on the device."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from simulated import simulated_cluster

from actors import ModelGroup, ReallocationError
from realloc import ModelSpec, Topology

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NODES, CPUS_PER_NODE = 2, 4
WALK = ["tp=4", "pp=2,tp=2", "fsdp=4", "dp=4", "dp=2,tp=2"]


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(NODES, CPUS_PER_NODE, gpus_per_node=1) as c:  # both nodes hand out the one GPU
        yield c


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.preset("tiny")


def _walk(group: ModelGroup, seed: int, expect_inter: bool) -> list:
    """Every layout of WALK in turn, each checked exactly; returns the stats."""
    out = []
    for dst in WALK:
        stats = group.reallocate(dst)
        assert group.topology == Topology.parse(dst)
        assert group.verify_synthetic(seed) == {}, dst
        if not expect_inter:
            assert stats.bytes_inter_node == 0, dst
        out.append(stats)
    return out


def test_workers_share_the_gpu_and_read_each_other_through_cuda_ipc(cluster, spec):
    g = ModelGroup.create(
        spec,
        "dp=2,tp=2",
        name="gpu-ipc",
        use_gpu=True,
        gpus_per_worker=0.25,
        strategy="STRICT_PACK",
        timeout_s=120,
        bucket_bytes=64 << 10,
    )
    try:
        infos = [ray.get(a.info.remote()) for a in g.actors]
        assert all(i["device"] == "cuda:0" and i["zero_copy"] for i in infos), infos
        assert g.placement.num_nodes == 1 and g.config.backend == "gloo"
        g.init_synthetic(seed=1)
        assert g.verify_synthetic(1) == {}
        stats = _walk(g, 1, expect_inter=False)
        assert all(s.bytes_inter_node == 0 for s in stats)
        assert sum(s.bytes_intra_node for s in stats) > 0  # read from peers' buffers, not sent
        devices = g.run(lambda ctx: sorted({t.device.type for t in ctx.tensors.values()}), writes=False)
        assert devices == [["cuda"]] * 4
    finally:
        g.shutdown()


def test_host_staged_gloo_between_workers_of_one_gpu(cluster, spec):
    g = ModelGroup.create(
        spec,
        "tp=4",
        name="gpu-staged",
        use_gpu=True,
        gpus_per_worker=0.25,
        strategy="STRICT_PACK",
        timeout_s=120,
        bucket_bytes=16 << 10,
        zero_copy=False,
    )
    try:
        g.init_synthetic(seed=2)
        stats = _walk(g, 2, expect_inter=False)
        assert sum(s.bytes_intra_node for s in stats) > 0
    finally:
        g.shutdown()


def test_two_nodes_sharing_the_gpu(cluster, spec):
    g = ModelGroup.create(
        spec,
        "dp=2,tp=2",
        name="gpu-nodes",
        use_gpu=True,
        gpus_per_worker=0.5,
        strategy="SPREAD",
        timeout_s=120,
        bucket_bytes=32 << 10,
    )
    try:
        assert g.placement.num_nodes == 2
        g.init_synthetic(seed=3)
        stats = _walk(g, 3, expect_inter=True)
        assert sum(s.bytes_inter_node for s in stats) > 0  # staged through host memory over gloo
        assert sum(s.bytes_intra_node for s in stats) > 0  # CUDA IPC inside each node
    finally:
        g.shutdown()


def test_resident_layouts_on_the_gpu(cluster, spec):
    g = ModelGroup.create(
        spec, "fsdp=4", name="gpu-keep", use_gpu=True, gpus_per_worker=0.25, strategy="STRICT_PACK", timeout_s=120
    )
    try:
        g.init_synthetic(seed=4)
        for mode in ("in_place", "host"):
            there = g.reallocate("tp=4", keep=mode)
            assert g.verify_synthetic(4) == {}
            back = g.reallocate("fsdp=4")
            assert back.resident_use == "adopted", (mode, back.as_dict())
            assert g.verify_synthetic(4) == {}
            assert there.seconds > 0
            g.release_resident()
    finally:
        g.shutdown()


def test_worker_exit_mid_transfer_on_the_gpu(cluster, spec):
    g = ModelGroup.create(
        spec,
        "tp=4",
        name="gpu-crash",
        use_gpu=True,
        gpus_per_worker=0.25,
        strategy="STRICT_PACK",
        timeout_s=30,
        bucket_bytes=4096,
        zero_copy=False,
    )
    try:
        g.init_synthetic(seed=5)
        g.reallocate("dp=2,tp=2")
        digests = ray.get([a.source_digest.remote() for a in g.actors])
        ray.get(g.actors[2].inject_fault.remote("exit_after_buckets", 3))
        with pytest.raises(ReallocationError, match="gpu-crash:rank2"):
            g.reallocate("dp=4")
        after = ray.get([g.actors[r].source_digest.remote() for r in (0, 1, 3)], timeout=60)
        assert after == [digests[r] for r in (0, 1, 3)]
        assert g.topology == Topology.parse("dp=2,tp=2")
    finally:
        g.shutdown()


def test_moves_leave_no_gpu_memory_behind(cluster):
    """After many moves each worker holds its layout, the rollback of the last move and its
    staging: nothing else. A CUDA IPC export that nobody opens keeps the block it names
    allocated after its owner frees it (torch's IPC limbo), so exporting a buffer to a peer
    that does not read it leaked one layout per move (bench-gpu ran out of memory)."""
    spec = ModelSpec.preset("small")  # 28-56 MB per worker: a leak of one buffer per move shows
    g = ModelGroup.create(
        spec,
        "fsdp=4",
        name="gpu-leak",
        use_gpu=True,
        gpus_per_worker=0.25,
        strategy="STRICT_PACK",
        timeout_s=120,
        bucket_bytes=1 << 20,
    )
    try:
        g.init_synthetic(seed=6)
        for _ in range(4):
            for dst in ("tp=4", "dp=2,tp=2", "fsdp=4"):
                g.reallocate(dst)
        assert g.verify_synthetic(6) == {}
        allocated = g.run(lambda ctx: torch.cuda.memory_allocated(ctx.device), writes=False)
        rollback = g.layout.with_topology(Topology.parse("dp=2,tp=2"))
        for r, n in enumerate(allocated):
            limit = g.layout.rank_bytes(r) + rollback.rank_bytes(r) + 2 * g.config.bucket_bytes + (16 << 20)
            assert n <= limit, f"rank {r}: {n / 2**20:.0f} MiB allocated, at most {limit / 2**20:.0f} MiB expected"
    finally:
        g.shutdown()


def _tp_all_reduce(ctx) -> list[float]:
    import torch.distributed as dist

    out = []
    for device in (ctx.device, torch.device("cpu")):
        t = torch.full((4,), float(ctx.rank + 1), device=device)
        dist.all_reduce(t, group=ctx.groups.tp)
        out.append(float(t[0]))
    return out


def test_user_groups_reduce_cuda_tensors_on_a_shared_gpu(cluster, spec):
    """Workers sharing a GPU get gloo groups (NCCL cannot pair two ranks of one device); the
    user's CUDA tensors go through them as through init_process_group('gloo') groups."""
    g = ModelGroup.create(
        spec, "dp=2,tp=2", name="gpu-user", use_gpu=True, gpus_per_worker=0.25, strategy="STRICT_PACK", timeout_s=120
    )
    try:
        got = g.run(_tp_all_reduce, writes=False)
        topo = g.topology
        for r, values in enumerate(got):
            tp_ranks = [topo.rank(topo.coords(r)[0], t, 0) for t in range(topo.tp)]
            assert values == [float(sum(x + 1 for x in tp_ranks))] * 2, (r, values)
    finally:
        g.shutdown()
