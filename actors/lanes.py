"""The Ray concurrency groups of a worker: which calls run beside which.

* the default group (one thread): the protocol's steps and the user's calls, one at a time;
* :data:`CONTROL` (one thread): pings and status, answered even while the default thread is
  blocked in a transfer or a long user call;
* :data:`STAGE` (one thread): a staged update's transfer into the shadow buffers
  (actors/worker/staging.py), beside the user's calls on the serving buffers.
"""

from __future__ import annotations

CONTROL = "control"
STAGE = "stage"
#: ``concurrency_groups=`` of every worker actor class.
CONCURRENCY_GROUPS = {CONTROL: 1, STAGE: 1}
