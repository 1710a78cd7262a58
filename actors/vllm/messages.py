"""What the driver and the vLLM workers say to each other, for both ends (no vLLM import here).

The front ends (``LLM``, ``AsyncLLM``, ``vllm serve``, a Ray actor) carry the driver's payloads to
every worker and return nothing from them, so the workers answer through a TCP store the driver
hosts (its *control store*), under :func:`control_key` keys: ``worker/<index>`` (the worker's
description, or the error that refused the trainer's model), ``<update id>/<index>`` (the outcome
of the worker's transfer). The payloads are :func:`init_payload` and :func:`stage_payload` /
:data:`ABORT` (``update_weights``: a list, one per worker, in vLLM's worker order).
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

#: The operations ``update_weights`` takes.
OPS = ("stage", "abort")
#: ``update_weights``' payload that drops the round (every worker).
ABORT = {"op": "abort"}


def control_key(engine_id: str, *parts: Any) -> str:
    """A key of the driver's control store for engine ``engine_id``."""
    return "/".join(("realloc-vllm", engine_id, *map(str, parts)))


def encode(value: Any) -> str:
    """A value as the text a payload carries (pickled, base64: the HTTP front end takes JSON)."""
    return base64.b64encode(pickle.dumps(value)).decode("ascii")


def decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text.encode("ascii")))


def init_payload(host: str, port: int, engine_id: str, params: list, timeout_s: float) -> dict:
    """``init_weight_transfer_engine``'s: the control store, the engine's id there, the trainer's
    checkpoint tensors ``[[name, shape, dtype], ...]``, the deadline of every wait (seconds)."""
    return {"store_host": host, "store_port": port, "engine_id": engine_id, "params": params, "timeout_s": timeout_s}


def stage_payload(
    update_id: str,
    version: int,
    world_id: str,
    addr: str,
    port: int,
    rank: int,
    size: int,
    share: Any,
    base: int | None = None,
    keep_base: bool = False,
) -> dict:
    """One worker's ``update_weights`` payload that stages an update: the update's id and
    version, the world to join (its rendezvous, the worker's rank in it, its size), the worker's
    share of the plan (its ``(PlanSlice, PeerTable)``); ``base``: the routes travel as deltas
    against the weights of that version the worker committed last (None: whole); ``keep_base``:
    keep this update's weights as the next delta's base."""
    return {
        "base": base,
        "keep_base": keep_base,
        "op": "stage",
        "update_id": update_id,
        "version": version,
        "world_id": world_id,
        "addr": addr,
        "port": port,
        "world_rank": rank,
        "world_size": size,
        "share": encode(share),
    }
