"""CRC32 digests of the group's shards: every layout verified once, every later arrival compared."""

from __future__ import annotations

import time
import zlib

import torch

from realloc.layout import Layout
from realloc_tools.bench.common import log_line


class Layouts:
    """CRC32s of every slot of every layout the group has held, each layout verified once.

    The first time the group reaches a layout by a reallocation, its shards are checked against
    ``synthetic_box`` (dp replica 0, the other replicas byte-identical to it; every rank with
    ``exact``) and their CRC32s recorded; every later arrival must reproduce them. The initial
    layout (written by ``init_synthetic``) is recorded as it is.
    """

    def __init__(self, group, verify: str, seed: int, batch: int):
        self.group, self.verify, self.seed, self.batch = group, verify, seed, batch
        self.digests: dict[Layout, list[dict[str, int]]] = {}
        self.failures: list[str] = []

    def record(self) -> None:
        self.digests[self.group.layout] = digests_of_group(self.group)

    def check(self) -> bool:
        """Whether the group's shards are right; logs and remembers what is not."""
        group, layout = self.group, self.group.layout
        digests = digests_of_group(group)
        if layout in self.digests:
            if digests != self.digests[layout]:
                self.failures.append(f"{layout}: shards differ from the first arrival")
                return False
            return True
        t = time.perf_counter()
        topo, workers = layout.topology, group.num_workers
        ranks = range(workers) if self.verify == "exact" else [r for r in range(workers) if topo.coords(r)[0] == 0]
        bad = {
            r: b for r, b in zip(ranks, _batched(group, ranks, "verify_synthetic", self.seed, batch=self.batch)) if b
        }
        for r in range(workers):  # other dp replicas: byte-identical to their verified replica-0 twin
            _, fsdp_rank, tp_rank, pp_rank = topo.coords4(r)
            if digests[r] != digests[topo.rank(0, tp_rank, pp_rank, fsdp_rank)]:
                bad.setdefault(r, ["<differs from its dp replica 0>"])
        log_line(f"{layout.topology} verified in {time.perf_counter() - t:.1f}s: {'ok' if not bad else bad}")
        if bad:
            self.failures.append(f"{layout}: {sorted(bad.items())[:3]}")
            return False
        self.digests[layout] = digests
        return True


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()))


def _ctx_digests(ctx) -> dict[str, int]:
    return {slot: crc(t) for slot, t in ctx.tensors.items()}


def _batched(group, ranks, method: str, *args, batch: int) -> list:
    """``method`` on the actors of ``ranks``, ``batch`` at a time (the same calls as the group's
    all-at-once helpers, with a bounded number of concurrent synthetic_box temporaries)."""
    import ray

    ranks, out = list(ranks), []
    for i in range(0, len(ranks), batch):
        out += ray.get([getattr(group.actors[r], method).remote(*args) for r in ranks[i : i + batch]])
    return out


def digests_of_group(group) -> list[dict[str, int]]:
    return group.run(_ctx_digests, writes=False)
