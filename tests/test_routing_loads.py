"""The router's bookkeeping of what each worker sends and receives (realloc/plan/routing.py).

Which holder sends and which worker enters a node are chosen by these loads, so a load booked
wrong gives a plan that is still correct but no longer balanced, which no execution check sees.
Here ``Router._record`` is checked against sums kept one delivery at a time, over every size of
delivery it books differently (one or two workers in Python, a few with ``ufunc.at``, many with a
``bincount``), repeated workers included.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.plan.inputs import Bandwidths
from realloc.plan.placement import Placement
from realloc.plan.routing import Router

WORKERS = 12


@st.composite
def deliveries(draw):
    """Calls of ``_record``: phase, senders, receivers (one per route, repeats allowed), bytes."""
    out = []
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.sampled_from([0, 1, 2, 3, 5, WORKERS, 2 * WORKERS]))
        ends = st.lists(st.integers(0, WORKERS - 1), min_size=n, max_size=n)
        out.append((draw(st.integers(0, 1)), draw(ends), draw(ends), draw(st.integers(1, 10**12))))
    return out


@settings(max_examples=200, deadline=None)
@given(deliveries())
def test_recorded_loads_are_the_sums_of_every_delivery(calls):
    router = Router(Placement.blocks(WORKERS, 4), {}, Bandwidths())
    egress, ingress = [0] * WORKERS, [0] * WORKERS
    routes = []
    for phase, src, dst, nbytes in calls:
        key = len(router.key_bytes)
        router.key_bytes.append(nbytes)
        router._record(phase, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), key)
        for s, d in zip(src, dst):
            egress[s] += nbytes
            ingress[d] += nbytes
            routes.append(((phase * WORKERS + s) * WORKERS + d, key))
    assert router.egress.tolist() == egress and router.ingress.tolist() == ingress
    assert [(int(r), k) for codes, k in router.deliveries for r in codes] == routes
