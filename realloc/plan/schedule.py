"""The steps of a plan: routes edge-coloured so that in a step every worker sends at most one
route and receives at most one, phase-0 routes (from holders) before phase-1 routes (fan-out
inside a node). Small plans get a greedy colouring, largest route first; large dense ones the
cyclic schedule (:func:`cyclic_suits`).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from realloc.plan.tables import StepTable

__all__ = ["LARGE_PLAN_ROUTES", "cyclic_suits", "schedule_routes", "steps_of"]

#: Plans with more routes than this keep their steps as a :class:`StepTable` (arrays), and are
#: scheduled by :func:`_cyclic_steps` when that costs few steps (:func:`cyclic_suits`);
#: smaller ones by the greedy :func:`_colour`, as lists.
LARGE_PLAN_ROUTES = 100_000


def cyclic_suits(src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether the cyclic schedule of these routes is within 10% (+8) of the fewest steps any
    schedule can have (the largest number of routes one worker sends or receives).

    Dense exchanges (every worker talks to most others: a sharded source to many replicas) pass;
    sparse ones (each worker talks to a few peers) would get up to ``W`` steps and fail."""
    if src.size <= LARGE_PLAN_ROUTES:
        return False
    width = int(max(src.max(), dst.max())) + 1
    degree = max(int(np.bincount(src).max()), int(np.bincount(dst).max()))
    colours = int(np.count_nonzero(np.bincount((dst - src) % width, minlength=width)))
    return colours <= 1.1 * degree + 8


def schedule_routes(
    phase: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """Step of every route: phase 0 steps first, then phase 1 (fan-out); returns
    ``(step per route, number of steps, first phase-1 step)``."""
    step = np.zeros(src.size, dtype=np.int64)
    num_steps = forward_from = 0
    for ph in (0, 1):
        forward_from = num_steps
        idx = np.flatnonzero(phase == ph)
        if not idx.size:
            continue
        if cyclic_suits(src[idx], dst[idx]):
            colours = _cyclic_steps(src[idx], dst[idx])
        else:
            order = np.lexsort((dst[idx], src[idx], -nbytes[idx]))
            colours = np.empty(idx.size, dtype=np.int64)
            colours[order] = _colour(src[idx][order].tolist(), dst[idx][order].tolist())
        step[idx] = colours + num_steps
        num_steps += int(colours.max()) + 1
    return step, num_steps, forward_from


def _cyclic_steps(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Step ``(dst - src) mod W`` (``W`` past the largest worker id), steps left empty removed.

    For one ``src`` the steps of its routes differ because their ``dst`` do, and for one ``dst``
    because their ``src`` do: a proper schedule in at most ``W`` steps, computed without a loop.
    It suits dense exchanges (every worker talks to most others, so any schedule needs about
    ``W`` steps); sparse ones get the greedy colouring, which needs about their degree.
    """
    width = int(max(src.max(), dst.max())) + 1
    colour = (dst - src) % width
    used = np.bincount(colour, minlength=width) > 0
    return (np.cumsum(used) - 1)[colour]


def _colour(src: list[int], dst: list[int]) -> list[int]:
    """Greedy edge colouring, in the given order: each step holds at most one send and one
    receive per worker; returns the step of each route."""
    send_busy: dict[int, int] = defaultdict(int)  # worker -> bitmask of steps where it sends
    recv_busy: dict[int, int] = defaultdict(int)
    out = []
    for s_, d_ in zip(src, dst):
        busy = send_busy[s_] | recv_busy[d_]
        free = ~busy & (busy + 1)  # lowest clear bit
        send_busy[s_] |= free
        recv_busy[d_] |= free
        out.append(free.bit_length() - 1)
    return out


def steps_of(src: np.ndarray, dst: np.ndarray, lists: np.ndarray, starts: np.ndarray):
    """Routes sorted by step as lists of :class:`Route`, or a :class:`StepTable` for large plans."""
    table = StepTable(src, dst, lists, starts)
    if src.size > LARGE_PLAN_ROUTES:
        return table
    return [list(s) for s in table]
