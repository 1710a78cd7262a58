"""Faults injected into the bench (``REALLOC_BENCH_FAULT``) and the group's recovery after a failed baseline."""

from __future__ import annotations

import os
import time

from realloc_tools.bench.common import BASELINES, drop_state, log_line, warm_imports
from realloc_tools.bench.verify import Layouts

#: After a baseline failed, how long every worker gets to finish what it was running (a worker
#: still in a collective with a dead peer never does) before it is killed and replaced.
RECOVERY_GRACE_SECONDS = 30.0

#: Test hook: ``REALLOC_BENCH_FAULT="<baseline>:<raise|kill>[@<direction>],..."`` makes the first
#: run of that baseline (in that direction, by index in ``directions``; in every one without
#: ``@``) fail instead of running: ``raise`` raises in every worker, ``kill`` ends worker 1's
#: process (as Ray's memory monitor does). For the bench's tests; never set in a real run.
FAULT_ENV = "REALLOC_BENCH_FAULT"


def injected_faults(text: str | None = None) -> dict[tuple[str, int | None], str]:
    """``FAULT_ENV`` parsed: ``{(baseline, direction or None): kind}``."""
    text = os.environ.get(FAULT_ENV, "") if text is None else text
    out: dict[tuple[str, int | None], str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, what = part.partition(":")
        kind, at, index = what.partition("@")
        if name not in BASELINES or kind not in ("raise", "kill") or (at and not index.isdigit()):
            raise ValueError(f"{FAULT_ENV}: {part!r} is not '<baseline>:<raise|kill>[@<direction>]'")
        out[name, int(index) if at else None] = kind
    return out


def fault_fn(ctx, kind: str) -> None:
    if kind == "kill" and ctx.rank == 1:
        os._exit(1)
    if kind == "raise":
        raise RuntimeError(f"injected fault ({FAULT_ENV}) on rank {ctx.rank}")


def _reset_default_group(ctx) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def recover_group(group, layouts: Layouts, seed: int) -> dict:
    """After a baseline failed: every worker answers again (a dead one, or one still stuck after
    ``RECOVERY_GRACE_SECONDS``, e.g. in a collective with a dead peer, is killed and replaced),
    holds its shards of the group's layout (rewritten with the synthetic weights where replaced,
    then checked against the layout's recorded CRC32s), and the baselines' default process group
    is formed afresh. Raises when the group cannot be restored."""
    import ray

    t = time.perf_counter()
    refs = [a.run.remote(drop_state, (), {}) for a in group.actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RECOVERY_GRACE_SECONDS)
    lost = []
    for r, ref in enumerate(refs):
        try:
            if ref not in ready:
                raise TimeoutError
            ray.get(ref)
        except (TimeoutError, ray.exceptions.RayError):
            lost.append(r)
    for r in lost:
        ray.kill(group.actors[r])
    # Wait until each lost worker fails a ping with a Ray error (an actor Ray's memory monitor
    # killed answers OutOfMemoryError, which actors.remote.DEATHS counts as dead), then have the
    # group replace the dead ranks.
    deadline = time.monotonic() + 60
    for r in lost:
        while True:
            try:
                ray.get(group.actors[r].ping.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayError:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {r} was killed but still answers after 60s")
            time.sleep(0.5)
    replaced = group.replace_dead_workers() if lost else []
    if replaced:
        group.init_synthetic(seed)
        if not layouts.check():
            raise RuntimeError(f"after replacing workers {replaced}: {layouts.failures[-1]}")
        group.run(warm_imports, writes=False)
    group.run(_reset_default_group, writes=False)
    open_default_group(group)
    out = {"replaced_workers": replaced, "seconds": time.perf_counter() - t}
    log_line(f"group restored in {out['seconds']:.1f}s (replaced workers: {replaced or 'none'})")
    return out


def open_default_group(group) -> None:
    """torch's default process group in every worker, as a training framework creates it (the
    baselines and the probes use it; our transport never does: it has its own private group)."""
    addr, port = group.run(_free_address, writes=False)[0]
    group.run(_init_default_group, addr, port, group.num_workers, writes=False)


def _free_address(ctx) -> tuple[str, int]:
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def _init_default_group(ctx, addr: str, port: int, world_size: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if ctx.device.type == "cuda" else "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=ctx.rank,
            world_size=world_size,
        )
