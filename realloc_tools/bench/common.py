"""What every bench module shares: the log, the defaults, the worker-side state of the baselines and small helpers."""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from typing import Any

from realloc.progress import write

BASELINES = ("driver", "broadcast", "dcp", "gather")
DEFAULT_SRC = "dp=2,tp=2,pp=2"
DEFAULT_DST = "dp=4,tp=2,pp=1"
MB = 1 << 20

#: Actor-side state of the baselines between ``group.run`` calls (destination buffers to verify).
STATE: dict[str, Any] = {}
_T0 = time.perf_counter()


log = logging.getLogger(__package__)  # "realloc_tools.bench", the command's logger


def log_line(msg: str) -> None:
    write(f"[bench {time.perf_counter() - _T0:6.1f}s] {msg}")  # above the progress bar, if one is shown


def drop_state(ctx) -> None:
    STATE.clear()
    gc.collect()
    malloc_trim()


def malloc_trim() -> None:
    """Give freed heap pages back to the OS: glibc keeps them, and a baseline's temporaries (full
    tensors, all-gather parts) piled up over 8 actors until Ray's memory monitor killed one.
    Between runs, outside every timing; a no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def warm_imports(ctx) -> None:
    import torch.distributed.checkpoint  # noqa: F401
    from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec  # noqa: F401


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
