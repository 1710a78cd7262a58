"""Processes for the multi-process torch tests (gloo groups on 127.0.0.1): started by a fork
server that imported torch once, not spawned afresh.

Not ``fork``: the pytest process may hold Ray and torch threads by then, and a forked child can
inherit a lock one of them held (a CI run of 2026-11-24 hung so for 90 s in tests/test_dtensor.py).
The fork server is its own single-threaded process, started (spawned) on first use in each pytest
process; it imports :data:`PRELOAD` and forks every child from there, so a child skips the ~1.3 s
of ``import torch`` (and of the engines' imports) that each spawned child paid. What the child
runs is unpickled by reference in it, as with spawn.
"""

from __future__ import annotations

import importlib.util
import multiprocessing

#: Imported once in the fork server (the engines only where they are installed).
PRELOAD = [
    "torch",
    "torch.distributed",
    *(m for m in ("transformers", "megatron.core") if importlib.util.find_spec(m.split(".")[0]) is not None),
]
START_METHOD = "forkserver"


def start_method() -> str:
    """The start method for ``torch.multiprocessing.start_processes``, the fork server's preload
    set (it takes effect when the server starts, on the first process started)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return START_METHOD


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context the tests start their processes with."""
    return multiprocessing.get_context(start_method())


def host_store():
    """A TCPStore server on a port the OS picks, for the processes' gloo group (hold it until they
    are done: its port is theirs). Picking a free port and letting rank 0 bind it later races with
    every other process binding ports meanwhile (a CI run of 2026-11-27 lost to EADDRINUSE)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120)
    )


def init_group(port: int, rank: int, world: int) -> None:
    """Join the gloo group whose store :func:`host_store` serves on ``port`` (in a child)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
