"""``actors/wire/`` runs in any process, with no ``ShardWorker`` and no Ray (issue 36).

Two plain processes (``torch.multiprocessing``, spawn) each hold a shard store and run their
share of a plan through the wire alone: the test plans the move (``realloc.plan``), cuts every
worker's share as the driver does (:func:`actors.wire.shares.worker_shares`: a ``PlanSlice`` and
a ``PeerTable``, shipped to the process pickled, in their packed form), and each process checks
its share, opens a :class:`~actors.wire.transport.Transport` (a private gloo group on a TCPStore
the test opened on an OS-chosen port), and runs its local copies and every step with a
:class:`~actors.wire.executor.StepRunner`. It moves twice: whole (version 1), then as deltas
against the weights of the first move (version 2, :class:`~actors.wire.delta.DeltaSides`). The
test checks every destination shard against the oracle (tests/oracle.py) byte for byte.

Spawns processes: run it under the shared lock (``flock /tmp/ray.lock ...``). Every wait has a
deadline (the transport's timeout, and the test's own on the processes).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import processes
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.wire.delta import DeltaSides
from actors.wire.executor import Staging, StepRunner
from actors.wire.shares import PeerView, worker_shares
from actors.wire.transport import Transport
from realloc.layout import Layout, Topology
from realloc.plan import Placement, plan_reallocation
from realloc.shards import ShardStore, allocate_buffers, copy_local, zero_padding

try:
    from tests import oracle
except ImportError:  # run from tests/ (pytest's rootdir-relative imports)
    import oracle

CPU = torch.device("cpu")
TIMEOUT_S = 30.0
DECODER = oracle.Decoder(
    hidden=16, intermediate=40, layers=4, heads=4, kv_heads=2, head_dim=4, vocab=37, dtype="float32"
)
PAD = 1
#: (source topology, destination topology, source workers, destination workers): a group that
#: changes layout on its two workers, and a copy from one worker's group into the other's.
CASES = {
    "reallocate tp=2 -> pp=2": (Topology(tp=2), Topology(pp=2), None, None),
    "copy worker 0 -> worker 1": (Topology(), Topology(), [0], [1]),
}


def _store(full: dict, topo: Topology, rank: int) -> ShardStore:
    """Rank ``rank`` of ``topo`` holding the weights ``full``, as the oracle slices them."""
    layout = Layout(DECODER.spec(), topo, PAD)
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    want = oracle.local_tensors(
        DECODER, full, topo.dp, topo.tp, topo.pp, oracle.pipeline_stages(DECODER.layers, topo.pp), rank, PAD
    )
    tensors = store.shard_tensors()
    for slot, value in want.items():
        tensors[slot].copy_(value)
    return store


def _versions() -> tuple[dict, dict]:
    v1 = oracle.full_tensors(DECODER, seed=7)
    return v1, oracle.changed_version(v1, 0.02, seed=3)


def _worker(rank: int, port: int, n: int, case: str, share, out: str) -> None:
    """One plain process: its share of the plan, moved over the wire twice (whole, then deltas)."""
    torch.set_num_threads(1)
    src_topo, dst_topo, src_workers, dst_workers = CASES[case]
    src_workers = src_workers if src_workers is not None else list(range(src_topo.world_size))
    dst_workers = dst_workers if dst_workers is not None else list(range(dst_topo.world_size))
    plan, peers = share
    plan.validate(n, rank)  # what a worker checks before any traffic (wire/executor.py received_share)
    plan.unpack()
    v1, v2 = _versions()
    src_rank = src_workers.index(rank) if rank in src_workers else None
    dst_rank = dst_workers.index(rank) if rank in dst_workers else None
    dst_layout = Layout(DECODER.spec(), dst_topo, PAD)
    transport = Transport("127.0.0.1", port, rank, n, CPU, TIMEOUT_S)
    staging = Staging(CPU)
    report = {}
    try:
        held = None  # what this process's destination holds after the first move (the delta's base)
        for version, full in ((1, v1), (2, v2)):
            src = _store(full, src_topo, src_rank) if src_rank is not None else None
            dst = None
            if dst_rank is not None:
                dst = ShardStore(dst_layout.shards(dst_rank), allocate_buffers(dst_layout, dst_rank))
                zero_padding(dst)
            sides = None
            if version == 2:  # the senders' bases: what they sent at version 1
                base = _store(v1, src_topo, src_rank) if src_rank is not None else None
                sides = DeltaSides(base, held)
            runner = StepRunner(transport, CPU, plan, rank, peers, src, dst, staging=staging, delta=sides)
            for j in plan.local:
                copy_local(src, dst, plan.segment_list(j))
            for step, routes in sorted(plan.routes_by_step().items()):
                runner.run_step(step, routes)
            if dst is not None:
                torch.save({k: t.clone() for k, t in dst.shard_tensors().items()}, Path(out) / f"v{version}-{rank}.pt")
            held = dst
            if sides is not None:
                report[version] = sides.stats
    finally:
        transport.close()
    (Path(out) / f"stats-{rank}.json").write_text(json.dumps(report))


def _run(case: str, shares: list, out: Path, timeout_s: float = 120.0) -> None:
    """Run :func:`_worker` in one spawned process per share; fail on any error or on the deadline."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    ctx = mp.start_processes(
        _entry,
        args=(store.port, len(shares), case, shares, str(out)),
        nprocs=len(shares),
        join=False,
        start_method=processes.start_method(),
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{case}: the plain processes did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _entry(rank: int, port: int, n: int, case: str, shares: list, out: str) -> None:
    _worker(rank, port, n, case, shares[rank], out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_move_between_two_plain_processes_lands_what_the_oracle_says(case, tmp_path):
    src_topo, dst_topo, src_workers, dst_workers = CASES[case]
    placement = Placement(nodes=("node-a", "node-b"))  # two nodes: every route goes over the transport
    kwargs = {} if src_workers is None else {"src_workers": src_workers, "dst_workers": dst_workers}
    plan = plan_reallocation(
        DECODER.spec(), src_topo, dst_topo, placement, vocab_pad_multiple=PAD, bucket_bytes=2048, **kwargs
    )
    assert plan.routes(), "the plan moves nothing over the wire: the case tests nothing"
    spec = DECODER.spec()
    src_workers = src_workers if src_workers is not None else list(range(src_topo.world_size))
    dst_workers = dst_workers if dst_workers is not None else list(range(dst_topo.world_size))
    a, b = Layout(spec, src_topo, PAD), Layout(spec, dst_topo, PAD)
    peers = [
        PeerView(
            w,
            placement.nodes[w],
            a.at(src_workers.index(w)) if w in src_workers else None,
            b.at(dst_workers.index(w)) if w in dst_workers else None,
            shared=False,
        )
        for w in range(2)
    ]
    _run(case, worker_shares(plan, peers), tmp_path)

    v1, v2 = _versions()
    stages = oracle.pipeline_stages(DECODER.layers, dst_topo.pp)
    for version, full in ((1, v1), (2, v2)):
        for rank, w in enumerate(dst_workers):
            want = oracle.local_tensors(DECODER, full, dst_topo.dp, dst_topo.tp, dst_topo.pp, stages, rank, PAD)
            got = torch.load(tmp_path / f"v{version}-{w}.pt")
            assert want.keys() <= got.keys()
            for slot, value in want.items():
                assert torch.equal(got[slot].view(torch.uint8), value.view(torch.uint8)), (
                    f"{case}: version {version}, destination worker {w}: {slot} differs from the oracle"
                )
    stats = [json.loads((tmp_path / f"stats-{w}.json").read_text())["2"] for w in dst_workers]
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    assert total["buckets"] == sum(len(plan.buckets(j)) for _, _, _, j in plan.routes())
    assert total["buckets"] == total["delta"] + total["whole"] + total["repaired"]
    assert total["delta"] > 0 and total["repaired"] == 0, total  # the second move did travel as deltas
