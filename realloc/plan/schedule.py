"""The steps of a plan: routes edge-coloured so that in a step every worker sends at most one
route and receives at most one, phase-0 routes (from holders) before phase-1 routes (fan-out
inside a node). Each phase's steps come from a list schedule in time (:func:`timed_steps`),
except large dense ones, which get the cyclic schedule (:func:`cyclic_suits`).
"""

from __future__ import annotations

import numpy as np

from realloc.plan.tables import StepTable

__all__ = ["LARGE_PLAN_ROUTES", "PAIRING_WINDOW", "cyclic_suits", "schedule_routes", "steps_of", "timed_steps"]

#: Plans with more routes than this keep their steps as a :class:`StepTable` (arrays), and are
#: scheduled by :func:`_cyclic_steps` when that costs few steps (:func:`cyclic_suits`);
#: smaller ones by :func:`timed_steps`, as lists.
LARGE_PLAN_ROUTES = 100_000

#: How long (in mean routes) a worker that has finished a step waits for more peers to finish
#: theirs before its next step is chosen (:func:`timed_steps`): choosing among more idle
#: workers pairs a worker's send and receive better, at the cost of that wait.
PAIRING_WINDOW = 0.2


def cyclic_suits(src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether the cyclic schedule of these routes is within 10% (+8) of the fewest steps any
    schedule can have (the largest number of routes one worker sends or receives).

    Dense exchanges (every worker talks to most others: a sharded source to many replicas) pass;
    sparse ones (each worker talks to a few peers) would get up to ``W`` steps and fail."""
    if src.size <= LARGE_PLAN_ROUTES:
        return False
    return _cyclic_fits(src, dst, _colours(src, dst)[0])


def _colours(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, int]:
    """Each route's cyclic colour ``(dst - src) mod W`` (``W`` past the largest worker id), and ``W``."""
    width = int(max(src.max(), dst.max())) + 1
    colour = dst - src
    colour %= width
    return colour, width


def _cyclic_fits(src: np.ndarray, dst: np.ndarray, colour: np.ndarray) -> bool:
    """:func:`cyclic_suits` of routes whose colours are ``colour`` (:func:`_colours`)."""
    degree = max(int(np.bincount(src).max()), int(np.bincount(dst).max()))
    return int(np.count_nonzero(np.bincount(colour))) <= 1.1 * degree + 8


def schedule_routes(
    phase: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """Step of every route: phase 0 steps first, then phase 1 (fan-out); returns
    ``(step per route, number of steps, first phase-1 step)``.

    Routes sorted by phase (as the planner gives them) are taken a phase at a time as slices;
    others are gathered by phase first (the same steps either way)."""
    if phase.size and not np.all(phase[1:] >= phase[:-1]):
        order = np.argsort(phase, kind="stable")
        step, num_steps, forward_from = schedule_routes(phase[order], src[order], dst[order], nbytes[order])
        out = np.empty_like(step)
        out[order] = step
        return out, num_steps, forward_from
    step = np.zeros(src.size, dtype=np.int64)
    num_steps = forward_from = 0
    bounds = np.searchsorted(phase, [0, 1, 2]).tolist()
    for ph in (0, 1):
        forward_from = num_steps
        part = slice(bounds[ph], bounds[ph + 1])
        s, d = src[part], dst[part]
        if not s.size:
            continue
        colours = None
        if s.size > LARGE_PLAN_ROUTES:  # cyclic_suits, its colours kept for the steps
            colour, width = _colours(s, d)
            if _cyclic_fits(s, d, colour):
                colours = _cyclic_steps(colour, width)
        if colours is None:
            colours = timed_steps(s, d, nbytes[part])
        np.add(colours, num_steps, out=step[part])
        num_steps += int(colours.max()) + 1
    return step, num_steps, forward_from


def _cyclic_steps(colour: np.ndarray, width: int) -> np.ndarray:
    """Step ``(dst - src) mod W`` (the routes' :func:`_colours`), steps left empty removed.

    For one ``src`` the steps of its routes differ because their ``dst`` do, and for one ``dst``
    because their ``src`` do: a proper schedule in at most ``W`` steps, computed without a loop.
    It suits dense exchanges (every worker talks to most others, so any schedule needs about
    ``W`` steps); sparse ones get :func:`timed_steps`.
    """
    used = np.bincount(colour, minlength=width) > 0
    return (np.cumsum(used) - 1)[colour]


def timed_steps(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Steps from a list schedule in time, routes taking time in proportion to their bytes.

    The executor runs a worker's steps in order, the send and the receive of a step together,
    with no barrier between steps: a route starts when both its ends have finished their
    previous steps. So the steps are chosen the way that executor would run them: when workers
    finish a step (those that finish within :data:`PAIRING_WINDOW` mean routes of the first
    one, together), their next routes are matched among the workers idle at that moment (each
    sends at most one and receives at most one), routes of the workers with the most bytes
    left first (a route's priority: the larger of its sender's bytes left to send and its
    receiver's bytes left to receive, plus its own bytes). A worker no idle peer has a route
    with waits for the next to finish. The routes matched together get one step, after every
    step of their workers so far, so each worker's steps run in the order chosen in time.

    Compared with colouring by size alone (largest route first, each into the lowest step free
    at both ends), this keeps a sender's routes to different receivers from waiting on one
    another in chains, and pairs a worker's send and receive of one step by when both are
    free. Every route gets exactly one step; returns each route's step, numbered from 0 with
    no step left empty."""
    n = src.size
    width = int(max(src.max(), dst.max())) + 1
    cost = nbytes.astype(np.float64) + 1.0  # +1: a route of no bytes still takes its turn
    by_src = np.argsort(src, kind="stable")
    by_dst = np.argsort(dst, kind="stable")
    src_ptr = np.searchsorted(src[by_src], np.arange(width + 1))
    dst_ptr = np.searchsorted(dst[by_dst], np.arange(width + 1))
    to_send = np.bincount(src, weights=cost, minlength=width)
    to_receive = np.bincount(dst, weights=cost, minlength=width)
    routes_left = np.bincount(src, minlength=width) + np.bincount(dst, minlength=width)
    window = PAIRING_WINDOW * float(cost.mean())
    pending = np.ones(n, dtype=bool)
    step = np.zeros(n, dtype=np.int64)
    last_step = np.full(width, -1, dtype=np.int64)
    free_at = np.zeros(width)
    idle = np.zeros(width, dtype=bool)  # finished its last step and waiting for a peer
    horizon = window
    scheduled = 0
    while scheduled < n:
        arrive = np.flatnonzero(~idle & (routes_left > 0) & (free_at <= horizon))
        now_idle = idle.copy()
        now_idle[arrive] = True
        # routes between an arriving worker and any idle one (routes among the workers already
        # idle were all settled when they were: one of their ends was busy)
        out = _gather(src_ptr, by_src, arrive)
        into = _gather(dst_ptr, by_dst, arrive)
        cand = np.concatenate([out[pending[out] & now_idle[dst[out]]], into[pending[into] & idle[src[into]]]])
        idle = now_idle
        if cand.size:
            priority = np.maximum(to_send[src[cand]], to_receive[dst[cand]]) + cost[cand]
            cand = cand[np.argsort(-priority, kind="stable")]
            chosen = cand[_greedy_matching(src[cand], dst[cand], width)]
            s, d = src[chosen], dst[chosen]
            busy = np.union1d(s, d)
            k = int(last_step[busy].max()) + 1
            step[chosen] = k
            last_step[busy] = k
            end = np.maximum(free_at[s], free_at[d]) + cost[chosen]
            np.maximum.at(free_at, s, end)
            np.maximum.at(free_at, d, end)
            to_send -= np.bincount(s, weights=cost[chosen], minlength=width)
            to_receive -= np.bincount(d, weights=cost[chosen], minlength=width)
            routes_left -= np.bincount(s, minlength=width) + np.bincount(d, minlength=width)
            pending[chosen] = False
            idle[busy] = False
            scheduled += chosen.size
        running = ~idle & (routes_left > 0)
        if not running.any():
            break
        horizon = float(free_at[running].min()) + window
    if scheduled != n:  # the matching is maximal, so no route is left between idle workers
        raise AssertionError(f"timed_steps scheduled {scheduled} of {n} routes")
    return np.unique(step, return_inverse=True)[1].reshape(-1)


def _gather(ptr: np.ndarray, order: np.ndarray, workers: np.ndarray) -> np.ndarray:
    """``order[ptr[w]:ptr[w + 1]]`` for every ``w`` of ``workers``, concatenated, without a loop."""
    lo, counts = ptr[workers], ptr[workers + 1] - ptr[workers]
    total = int(counts.sum())
    offsets = np.repeat(lo - (np.cumsum(counts) - counts), counts)
    return order[offsets + np.arange(total)]


def _greedy_matching(src: np.ndarray, dst: np.ndarray, width: int) -> np.ndarray:
    """Which routes a greedy matching takes, routes in the given order (best first): a route is
    taken when its sender sends nothing yet and its receiver receives nothing yet.

    Computed in rounds: a route that comes first among the routes left of its sender and of its
    receiver is taken by the one-at-a-time greedy too (every route before it had an end taken,
    or it would be left), so each round takes all such routes and drops the routes they
    block."""
    taken = np.zeros(src.size, dtype=bool)
    left = np.arange(src.size)
    sending = np.zeros(width, dtype=bool)
    receiving = np.zeros(width, dtype=bool)
    while left.size:
        s, d = src[left], dst[left]
        rank = np.arange(left.size)
        first_of_src = np.full(width, left.size)
        first_of_dst = np.full(width, left.size)
        np.minimum.at(first_of_src, s, rank)
        np.minimum.at(first_of_dst, d, rank)
        win = (first_of_src[s] == rank) & (first_of_dst[d] == rank)
        taken[left[win]] = True
        sending[s[win]] = True
        receiving[d[win]] = True
        left = left[~(sending[s] | receiving[d])]
    return taken


def steps_of(src: np.ndarray, dst: np.ndarray, lists: np.ndarray, starts: np.ndarray):
    """Routes sorted by step as lists of :class:`Route`, or a :class:`StepTable` for large plans."""
    table = StepTable(src, dst, lists, starts)
    if src.size > LARGE_PLAN_ROUTES:
        return table
    return [list(s) for s in table]
