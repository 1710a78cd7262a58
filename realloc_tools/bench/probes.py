"""Gloo and memcpy probes: the transport rates the lower bound and ``realloc simulate --bench`` use."""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
from typing import Any

import torch

from realloc_tools.bench.common import MB, timed


def measure_transport(group, nbytes: int, cores: int, reps: int = 3) -> dict:
    """gloo p2p between ranks on different nodes, gloo all pairs across nodes, memcpy (one actor,
    ``cores`` actors at once, every actor at once)."""
    nodes = group.placement.nodes
    first = [r for r in range(len(nodes)) if nodes[r] == nodes[0]]
    other = [r for r in range(len(nodes)) if nodes[r] != nodes[0]]
    peer = other[0] if other else (first[1] if len(first) > 1 else None)
    pairs = list(zip(first, other)) if other else list(zip(first[::2], first[1::2]))
    copiers = list(range(max(1, min(cores, len(nodes)))))
    results = group.run(_probe, peer, pairs, copiers, nbytes, reps, writes=False)
    r0 = results[0]
    hosts = [info["ip"] for info in group.infos]
    p2p = results[peer]["gloo_p2p_seconds"] if peer is not None else None
    partners = sorted({r for pair in pairs for r in pair})
    return {
        "gloo_p2p_pair": [0, peer],
        "gloo_p2p_cross_node": bool(other),
        "probe_bytes": nbytes,
        "gloo_p2p_gbps": nbytes / p2p / 1e9 if p2p else 0.0,
        "gloo_aggregate_pairs": len(pairs),
        "gloo_aggregate_gbps": span_rate(results, hosts, "gloo_aggregate", partners) / 1e9,
        "memcpy_1core_gbps": nbytes / r0["memcpy_warm_seconds"] / 1e9,
        "memcpy_cold_gbps": nbytes / r0["memcpy_cold_seconds"] / 1e9,
        "memcpy_shm_cold_gbps": nbytes / r0["memcpy_shm_cold_seconds"] / 1e9,
        "memcpy_copiers": len(copiers),
        "memcpy_cores_gbps": span_rate(results, hosts, "memcpy_cores", copiers) / 1e9,
        "memcpy_aggregate_gbps": span_rate(results, hosts, "memcpy_aggregate", list(range(len(results)))) / 1e9,
        "barrier_seconds": r0["barrier_seconds"],
    }


def span_rate(results: list[dict], hosts: list[str], probe: str, ranks: list[int]) -> float:
    """Bytes per second of a probe several ranks ran at once: per repetition, each host's bytes
    over its span, from the first of its ranks starting to the last one finishing (ranks of one
    host read one clock; a rank descheduled before or during its part lengthens the span, as it
    lengthened the machine's work), summed over hosts; the best repetition.

    (Until this change each rank timed barrier -> work -> barrier less an empty barrier's time:
    on 8 processes sharing 2 cores a barrier's own time varies by milliseconds, and runs
    "measured" 68 and 87 GB/s of memcpy from two cores of 20.)"""
    reps = len(results[ranks[0]][f"{probe}_spans"])
    best = 0.0
    for k in range(reps):
        by_host: dict[str, list[tuple[float, float, int]]] = {}
        for r in ranks:
            start, end = results[r][f"{probe}_spans"][k]
            by_host.setdefault(hosts[r], []).append((start, end, results[r][f"{probe}_bytes"]))
        rate = sum(
            sum(n for _, _, n in spans) / max(max(e for _, e, _ in spans) - min(s for s, _, _ in spans), 1e-9)
            for spans in by_host.values()
        )
        best = max(best, rate)
    return best


def _probe(ctx, peer: int | None, pairs: list[tuple[int, int]], copiers: list[int], nbytes: int, reps: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    assert rank == ctx.rank, f"world rank {rank} != group rank {ctx.rank}"
    out: dict[str, Any] = {"gloo_p2p_seconds": None}
    # gloo p2p, rank 0 -> peer (receiver's clock), best of reps after a warm-up
    if rank in (0, peer):
        buf = torch.ones(nbytes, dtype=torch.uint8)
    best = math.inf
    for i in range(reps + 1 if peer is not None else 0):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(buf[: (nbytes if i else MB)], peer)
        elif rank == peer:
            dist.recv(buf[: (nbytes if i else MB)], 0)
        if i and rank == peer:
            best = min(best, time.perf_counter() - t)
    if rank == peer:
        out["gloo_p2p_seconds"] = best
    buf = None
    out["barrier_seconds"] = _barrier_seconds(reps)
    # gloo, every cross-node pair exchanging at once (both directions), as a reallocation does
    partner = {a: b for a, b in pairs} | {b: a for a, b in pairs}
    chunk = max(MB, nbytes // 4)  # per actor, in every probe of several actors at once
    send = recv = None
    if rank in partner:
        send, recv = torch.ones(chunk, dtype=torch.uint8), torch.empty(chunk, dtype=torch.uint8)
        recv.fill_(0)

    def exchange() -> None:
        if rank in partner:
            for req in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, send, partner[rank]), dist.P2POp(dist.irecv, recv, partner[rank])]
            ):
                req.wait()

    out["gloo_aggregate_spans"] = _spans(exchange, reps)
    out["gloo_aggregate_bytes"] = chunk if rank in partner else 0  # sent (each pair moves 2 x chunk)
    send = recv = None
    # memcpy on one core (rank 0 alone): warm, into fresh anonymous memory, into a fresh /dev/shm file
    dist.barrier()
    if rank == 0:
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.zeros(nbytes, dtype=torch.uint8)
        out["memcpy_warm_seconds"] = min(timed(lambda: b.copy_(a)) for _ in range(reps))
        b = None
        cold = []
        for _ in range(reps):
            c = torch.empty(nbytes, dtype=torch.uint8)
            cold.append(timed(lambda: c.copy_(a)))
            c = None
        out["memcpy_cold_seconds"] = min(cold)
        cold = []
        for _ in range(reps):
            path = f"/dev/shm/realloc-bench-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                c = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
                cold.append(timed(lambda: c.copy_(a)))
                c = None
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        out["memcpy_shm_cold_seconds"] = min(cold)
        a = None
    # memcpy on ``copiers`` (one actor per core) at once, then on every actor at once: the
    # machine's copy rate with its cores busy (it need not be cores x the one-core rate: they
    # share the memory bus), and with every actor competing for them (as in a reallocation)
    # Each copier of the first probe copies ``nbytes`` (a quarter would take ~3 ms on a core that
    # copies 20 GB/s, the order of a barrier's own noise on 8 processes sharing 2 cores: one run
    # "measured" 68 GB/s from 2 cores of 20 GB/s each).
    a = torch.ones(nbytes, dtype=torch.uint8) if rank in copiers else None
    b = torch.zeros(nbytes, dtype=torch.uint8) if rank in copiers else None
    out["memcpy_cores_bytes"] = nbytes if rank in copiers else 0
    out["memcpy_cores_spans"] = _spans(lambda: b.copy_(a) if rank in copiers else None, reps)
    a = torch.ones(chunk, dtype=torch.uint8)
    b = torch.zeros(chunk, dtype=torch.uint8)
    out["memcpy_aggregate_bytes"] = chunk
    out["memcpy_aggregate_spans"] = _spans(lambda: b.copy_(a), reps)
    dist.barrier()
    return out


def _barrier_seconds(reps: int) -> float:
    """Seconds of one barrier after another, best of ``reps``: what synchronising the actors
    costs on this machine (reported as ``barrier_seconds``)."""
    import torch.distributed as dist

    best = math.inf
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        dist.barrier()
        best = min(best, time.perf_counter() - t)
    return best


def _spans(fn, reps: int) -> list[tuple[float, float]]:
    """``reps`` times: a barrier, then ``fn`` timed on this rank's clock (``time.monotonic``, one
    clock per host); the driver combines the ranks' spans (:func:`span_rate`)."""
    import torch.distributed as dist

    out = []
    for _ in range(reps):
        dist.barrier()
        start = time.monotonic()
        fn()
        out.append((start, time.monotonic()))
    dist.barrier()
    return out
