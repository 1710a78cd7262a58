"""The private transport (actors/wire/communicator.py, actors/wire/transport.py) beside user code that owns
torch.distributed's default group. Pure torch, no Ray: processes from torch.multiprocessing spawn
over gloo, one TCPStore opened by the test on an OS-chosen port; every wait has a timeout."""

from __future__ import annotations

import datetime
import threading
import time

import processes
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.wire import communicator
from actors.wire import transport as transport_module
from actors.wire.communicator import Communicators, private_group
from actors.wire.transport import HostStaging, Transport, built_by_all, built_keys, check_in, check_in_keys

CPU = torch.device("cpu")
TIMEOUT_S = 10.0


def _spawn(fn, n: int, *args, timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, port, n, *args)`` in ``n`` spawned processes; fail on any error or timeout."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    ctx = mp.start_processes(
        _entry, args=(fn, store.port, n, args), nprocs=n, join=False, start_method=processes.start_method()
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{fn.__name__} over {n} processes did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _entry(rank: int, fn, port: int, n: int, args) -> None:
    torch.set_num_threads(1)
    fn(rank, port, n, *args)


def _client(port: int, n: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def _payload(sender: int, receiver: int, dtype: torch.dtype) -> torch.Tensor:
    """What ``sender`` sends ``receiver``: the size and values depend on both, so a mix-up shows."""
    numel = 1000 + 337 * sender + 101 * receiver
    return (torch.arange(numel, dtype=torch.float64) % 97 + 1000 * sender + receiver).to(dtype)


def _swap(pg, rank: int, send_to: int | None, recv_from: int | None, dtype: torch.dtype) -> None:
    send = (send_to, _payload(rank, send_to, dtype)) if send_to is not None else None
    expected = _payload(recv_from, rank, dtype) if recv_from is not None else None
    into = torch.empty_like(expected) if expected is not None else None
    works = communicator.exchange(pg, CPU, send, (recv_from, into) if recv_from is not None else None)
    for w in works:
        w.wait()
    if expected is not None:
        assert torch.equal(into, expected), f"rank {rank} received wrong data from {recv_from} ({dtype})"


def _user_default_group(rank: int, store: dist.Store, n: int) -> None:
    """What a trainer does: its own default group (through MASTER_ADDR-free store init)."""
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("user", store),
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == n * (n + 1) / 2
    gathered = [torch.zeros(1) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    assert [g.item() for g in gathered] == list(range(n))


# -- exchange ------------------------------------------------------------------------------------


def _exchange_worker(rank: int, port: int, n: int) -> None:
    pg = private_group(_client(port, n), "exchange", rank, n, CPU, TIMEOUT_S)
    assert not dist.is_initialized()
    for a, b in ((0, 1), (1, 2), (0, 2)):  # every pair sends to each other at the same time
        if rank in (a, b):
            peer = b if rank == a else a
            for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
                _swap(pg, rank, peer, peer, dtype)
    for dtype in (torch.float16, torch.int32):
        _swap(pg, rank, (rank + 1) % n, (rank - 1) % n, dtype)  # a ring, uneven sizes
    if rank == 0:  # send only / receive only
        _swap(pg, rank, 2, None, torch.float32)
    elif rank == 2:
        _swap(pg, rank, None, 0, torch.float32)
    assert communicator.exchange(pg, CPU, None, None) == []
    with pytest.raises(ValueError, match="send peer"):
        communicator.exchange(pg, CPU, (n, torch.zeros(1)), None)
    communicator.barrier(pg, CPU)
    communicator.close(pg)
    assert not dist.is_initialized()


def test_exchange_pairs_ring_and_one_way():
    _spawn(_exchange_worker, 3)


# -- user code owns the default group ------------------------------------------------------------


def _user_before_worker(rank: int, port: int, n: int) -> None:
    store = _client(port, n)
    _user_default_group(rank, store, n)
    pg = private_group(store, "after-user", rank, n, CPU, TIMEOUT_S)
    _swap(pg, rank, 1 - rank, 1 - rank, torch.float32)
    _user_default_group_collectives(rank, n)
    _swap(pg, rank, 1 - rank, 1 - rank, torch.bfloat16)
    dist.destroy_process_group()
    assert not dist.is_initialized()
    _swap(pg, rank, 1 - rank, 1 - rank, torch.int64)
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)  # collectives through torch's API take the private group too
    assert t.item() == n
    communicator.barrier(pg, CPU)


def _user_default_group_collectives(rank: int, n: int) -> None:
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    assert t.item() == n
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    assert b.item() == 1.0


def _user_after_worker(rank: int, port: int, n: int) -> None:
    store = _client(port, n)
    pg = private_group(store, "before-user", rank, n, CPU, TIMEOUT_S)
    _swap(pg, rank, 1 - rank, 1 - rank, torch.float32)
    _user_default_group(rank, store, n)
    _swap(pg, rank, 1 - rank, 1 - rank, torch.float16)
    _user_default_group_collectives(rank, n)
    dist.destroy_process_group()
    _swap(pg, rank, 1 - rank, 1 - rank, torch.uint8)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, group=pg, group_src=0)
    assert b.item() == 0.0
    # the user can form a default group again; ours still works
    _user_default_group(rank, dist.PrefixStore("again", store), n)
    _swap(pg, rank, 1 - rank, 1 - rank, torch.int32)
    dist.destroy_process_group()
    communicator.barrier(pg, CPU)


def test_user_default_group_formed_before_the_private_group():
    _spawn(_user_before_worker, 2)


def test_user_default_group_formed_and_destroyed_after_the_private_group():
    _spawn(_user_after_worker, 2)


# -- Communicators -------------------------------------------------------------------------------


def _communicators_worker(rank: int, port: int, n: int) -> None:
    comms = Communicators(_client(port, n), rank, n, CPU, TIMEOUT_S, generation="gen0")
    everyone = comms.group((0, 1, 2, 3))
    assert comms.created == 1 and everyone.size() == n and everyone.rank() == rank
    half = (0, 1) if rank < 2 else (2, 3)  # two disjoint groups, created at the same time
    for _ in range(3):  # alternating layouts: only the first round creates communicators
        pg = comms.group(half)
        assert pg.size() == 2 and pg.rank() == comms.group_rank(half, rank) == rank % 2
        _swap(pg, pg.rank(), 1 - pg.rank(), 1 - pg.rank(), torch.float32)
        assert comms.group(tuple(reversed(half))) is pg  # cached by the sorted rank tuple
        assert comms.group(list(range(n))) is everyone
        _swap(everyone, rank, (rank + 1) % n, (rank - 1) % n, torch.bfloat16)
    assert comms.created == 2
    other = (2, 3) if rank < 2 else (0, 1)
    with pytest.raises(ValueError, match="not a member"):
        comms.group(other)
    with pytest.raises(ValueError, match="must not repeat"):
        comms.group((rank, rank))
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        comms.group((rank, 4))
    with pytest.raises(ValueError, match="non-empty"):
        comms.group(())
    assert comms.created == 2
    # a group over three of the four ranks: rank 3 stays out and is not needed
    if rank < 3:
        trio = comms.group((0, 1, 2))
        t = torch.ones(1)
        dist.all_reduce(t, group=trio)
        assert t.item() == 3
    communicator.barrier(everyone, CPU)
    comms.close()
    with pytest.raises(ValueError, match="closed"):
        comms.group(half)
    assert not dist.is_initialized()


def test_communicators_cache_disjoint_groups_and_refuse_non_members():
    _spawn(_communicators_worker, 4)


def test_input_checks_name_what_was_wrong():
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    for kwargs, what in (
        ({"rank": 2}, "rank"),
        ({"size": 0}, "size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"prefix": ""}, "prefix"),
        ({"device": "cpu"}, "device"),
        ({"store": None}, "store"),
    ):
        args = {"store": store, "prefix": "p", "rank": 0, "size": 1, "device": CPU, "timeout_s": 5.0} | kwargs
        with pytest.raises(ValueError, match=what):
            private_group(**args)
    with pytest.raises(ValueError, match="generation"):
        Communicators(store, 0, 1, CPU, 5.0, generation="")
    with pytest.raises(ValueError, match="rank"):
        Communicators(store, 1, 1, CPU, 5.0, generation="g")
    comms = Communicators(store, 0, 1, CPU, 5.0, generation="g")
    solo = comms.group((0,))
    assert solo.size() == 1 and comms.created == 1
    with pytest.raises(ValueError, match="ranks must be"):
        comms.group(0)
    comms.close()
    assert not dist.is_initialized()


# -- Transport: two worlds in one process --------------------------------------------------------


def _two_worlds_worker(rank: int, port: int, n: int) -> None:
    # the worker-side signature: address and port of the store, no store object on these ranks
    a = Transport("127.0.0.1", port, rank, n, CPU, TIMEOUT_S, prefix="world-a")
    b = Transport("127.0.0.1", port, rank, n, CPU, TIMEOUT_S, store=a.store, prefix="world-b")
    assert a.backend == b.backend == "gloo" and a.store is b.store
    assert not dist.is_initialized()
    peer = 1 - rank
    for dtype in (torch.float32, torch.bfloat16):
        for t in (a, b, a):
            send, into = _payload(rank, peer, dtype), torch.empty_like(_payload(peer, rank, dtype))
            for w in t.exchange((peer, send), (peer, into)):
                w.wait()
            assert torch.equal(into, _payload(peer, rank, dtype))
    a.barrier()
    b.barrier()
    a.close()
    a.close()  # idempotent
    send, into = torch.full((64,), rank), torch.empty(64, dtype=torch.int64)
    for w in b.exchange((peer, send), (peer, into)):  # world b outlives world a
        w.wait()
    assert torch.equal(into, torch.full((64,), peer))
    b.barrier()
    b.close()
    assert not dist.is_initialized()


def test_transport_two_worlds_in_one_process_never_touch_the_default_group():
    _spawn(_two_worlds_worker, 2)


# -- Transport: device buffers staged through host memory ----------------------------------------


def _staged_worker(rank: int, port: int, n: int) -> None:
    """The path of GPU workers over gloo (workers sharing one GPU), with host tensors standing in
    for device ones: every message is copied into a host buffer, every receive lands in one and
    is copied out when its request is waited on."""
    staging = HostStaging(always=True)
    t = Transport("127.0.0.1", port, rank, n, CPU, TIMEOUT_S, prefix="staged", backend="gloo", staging=staging)
    assert t.wire == CPU and t.backend == "gloo"
    peer = 1 - rank
    biggest = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for k in range(3):  # the host buffers are reused message after message
            send = _payload(rank, peer, dtype)[k:]
            expected = _payload(peer, rank, dtype)[k:]
            into = torch.full_like(expected, -1)
            works = t.exchange((peer, send), (peer, into))
            assert not torch.equal(into, expected) or expected.numel() == 0  # lands only on wait()
            for w in works:
                w.wait()
            assert torch.equal(into, expected), f"rank {rank}: staged receive differs ({dtype}, {k})"
            biggest = max(biggest, send.numel() * send.element_size(), into.numel() * into.element_size())
    # one way only, and a strided destination's contiguous slice (what the executor receives into)
    flat = torch.zeros(4096, dtype=torch.float32)
    if rank == 0:
        for w in t.exchange((1, torch.arange(1000, dtype=torch.float32)), None):
            w.wait()
    else:
        for w in t.exchange(None, (0, flat[100:1100])):
            w.wait()
        assert torch.equal(flat[100:1100], torch.arange(1000, dtype=torch.float32))
        assert flat[:100].eq(0).all() and flat[1100:].eq(0).all()
    assert staging.nbytes <= 2 * biggest, "host staging holds more than one message each way"
    t.barrier()
    t.close()


def test_transport_stages_device_buffers_through_host_memory():
    _spawn(_staged_worker, 2)


def test_transport_refuses_nccl_for_host_buffers():
    with pytest.raises(ValueError, match="nccl"):
        Transport("127.0.0.1", 1, 0, 1, CPU, TIMEOUT_S, backend="nccl")


# -- a plan's steps over the transport, messages posted ahead ------------------------------------


def _plan_for_steps():
    """A plan whose routes all go over the transport between 4 workers on 2 nodes: row-parallel
    boxes that are strided at one end (staged messages) between contiguous ones (direct), fan-out
    steps, and pairs that send to each other in one step."""
    from realloc import Layout, Placement, Topology, plan_reallocation
    from realloc.spec import decoder_spec

    spec = decoder_spec(
        "steps", hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=128, norm_dtype="float32"
    )
    a, b = Layout(spec, Topology(tp=4)), Layout(spec, Topology(dp=2, tp=2))
    return a, b, plan_reallocation(spec, a, b, Placement.blocks(4, 2), bucket_bytes=4096)


def _steps_worker(rank: int, port: int, n: int, ahead: int) -> None:
    import actors.wire.executor as executor
    from actors.wire.executor import Staging, StepRunner
    from actors.wire.shares import PeerView
    from realloc.plan.slices import slice_plan
    from realloc.shards import ShardStore, allocate_buffers, copy_local, execute_in_process

    executor.DIRECT_MIN_BYTES, executor.AHEAD_MESSAGES = 1024, ahead  # many messages, direct and staged
    a, b, plan = _plan_for_steps()
    sources = {r: ShardStore(a.shards(r), allocate_buffers(a, r)) for r in range(n)}
    for r, store in sources.items():
        for t in store.buffers.values():
            t.copy_((torch.arange(t.numel(), dtype=torch.float64) % 251 + 7 * r).to(t.dtype))
    want = {r: ShardStore(b.shards(r), allocate_buffers(b, r)) for r in range(n)}
    execute_in_process(plan, sources, want)
    got = ShardStore(b.shards(rank), allocate_buffers(b, rank))
    transport = Transport("127.0.0.1", port, rank, n, CPU, TIMEOUT_S, store=_client(port, n), prefix="steps")
    peers = [PeerView(r, plan.nodes[r], a.at(r), b.at(r)) for r in range(n)]
    share = slice_plan(plan, [rank])[0]  # what this worker would be shipped
    runner = StepRunner(transport, CPU, share, rank, peers, sources[rank], got, None, staging=Staging(CPU))
    for j in share.local:
        copy_local(sources[rank], got, share.segment_list(j))
    for s, routes in share.routes_by_step().items():
        runner.run_step(s, routes)
    for dtype, buf in want[rank].buffers.items():
        assert torch.equal(buf.view(torch.uint8), got.buffers[dtype].view(torch.uint8)), (rank, dtype, ahead)
    assert runner.staging.nbytes <= 2 * 4096  # posting ahead holds no staging slot
    transport.close()


@pytest.mark.parametrize("ahead", [0, 1, 16])
def test_plan_steps_over_gloo_with_messages_posted_ahead(ahead):
    """Every route of a plan over the transport, direct messages posted ahead of the one being
    exchanged (0: one at a time) among staged ones, fan-out steps included: each worker ends with
    exactly the in-process executor's destination, and nothing waits forever (pairs that send to
    each other in one step each hold a staged send and a staged receive)."""
    import actors.wire.executor as executor

    a, b, plan = _plan_for_steps()
    pairs = {(s, src, dst) for s, src, dst, _ in plan.routes()}
    assert any((s, dst, src) in pairs for s, src, dst in pairs), "the plan should have a pair swapping in a step"
    saved, executor.DIRECT_MIN_BYTES = executor.DIRECT_MIN_BYTES, 1024
    try:
        cut = [m for _, _, _, j in plan.routes() for bk in plan.buckets(j) for m in executor.messages(bk)]
    finally:
        executor.DIRECT_MIN_BYTES = saved
    assert sum(len(m) == 1 for m in cut) > 20 and any(len(m) > 1 for m in cut)  # runs of one-piece messages
    _spawn(_steps_worker, 4, ahead)


def test_check_in_waits_for_every_member_and_leaves_an_aborted_formation_at_once():
    """A world's members count in before its process group is built: all there, they go on; the
    formation aborted (the worker told so, or the mark in the store for a member told late),
    they leave at once instead of waiting for a dead member until the timeout; else TimeoutError."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    joined, abort = check_in_keys("w-all")
    store.add(joined, 1)  # the other member is already there
    check_in(store, "w-all", 2, TIMEOUT_S, lambda: False)
    assert store.add(joined, 0) == 2
    with pytest.raises(RuntimeError, match="w-told was aborted"):
        check_in(store, "w-told", 2, TIMEOUT_S, lambda: True)
    store.set(check_in_keys("w-marked")[1], "1")
    with pytest.raises(RuntimeError, match="w-marked was aborted"):
        check_in(store, "w-marked", 2, TIMEOUT_S, lambda: False)
    with pytest.raises(TimeoutError, match="1 of 2 members joined"):
        check_in(store, "w-alone", 2, 0.2, lambda: False)


def test_join_world_returns_only_once_every_member_built_its_group(monkeypatch):
    """A member that has nothing to send leaves its world at once; if it could return from
    ``join_world`` while another member was still connecting its pairs, that member's group
    construction failed with gloo's "Connection closed by peer" (a CI run of the Megatron cp=2
    trainer; reproduced on 6 processes under load, 3 rounds in 81). Real gloo, three members in
    threads: member 2's construction is held back after its pairs connected, and no member may
    return before it is done."""
    done_at: dict[int, float] = {}

    class SlowToFinish(Transport):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.rank == 2:
                time.sleep(1.0)
            done_at[self.rank] = time.monotonic()

    monkeypatch.setattr(transport_module, "Transport", SlowToFinish)
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    returned: dict[int, float] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            joined = transport_module.join_world("127.0.0.1", store.port, "w-built", rank, 3, TIMEOUT_S, "test")
            returned[rank] = time.monotonic()
            joined.close()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    assert not errors and sorted(returned) == [0, 1, 2], errors
    assert min(returned.values()) >= done_at[2], (returned, done_at)


def test_a_member_that_could_not_build_its_group_is_named_to_the_others_at_once():
    """``built_by_all``: all built, the members go on; a member's failure posted, the others
    leave with its words; nobody there, TimeoutError naming how many built."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    count, outcome = built_keys("w-all")
    store.add(count, 1)
    built_by_all(store, "w-all", 2, TIMEOUT_S)
    assert store.get(outcome) == b"all"
    store.set(built_keys("w-failed")[1], "member 1 could not build its group: RuntimeError: boom")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="w-failed: member 1 could not build its group: RuntimeError: boom"):
        built_by_all(store, "w-failed", 2, TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S / 2
    with pytest.raises(TimeoutError, match="w-alone: 1 of 2 members built its group"):
        built_by_all(store, "w-alone", 2, 0.2)
