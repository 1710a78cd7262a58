"""How long a failed ``reallocate`` takes to raise with one worker stopped (SIGSTOP): issue 22,
defect 9. Usage: ``python benchmarks/stopped_worker_deadline.py 8 20`` (one run per ``timeout_s``).

Four CPU workers of preset ``tiny`` on two simulated nodes; worker 3 is stopped after a first
move, the move back is timed until it raises, then the worker is continued and the group shut
down. ``tests/test_deadlines_ray.py`` asserts the bound (``timeout_s`` + ``FAILURE_GRACE_S``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import ray
from simulated import simulated_cluster

from actors import ModelGroup, ReallocationError
from realloc import ModelSpec, Topology


def main(timeouts: list[float]) -> None:
    with simulated_cluster(nodes=2, cpus_per_node=4):
        for timeout in timeouts:
            g = ModelGroup.create(
                ModelSpec.preset("tiny"), Topology(dp=2, tp=2), name=f"measure{int(timeout)}", timeout_s=timeout
            )
            g.init_synthetic(1)
            pid = ray.get(g.actors[3].info.remote())["pid"]
            g.reallocate(Topology(dp=4))
            os.kill(pid, signal.SIGSTOP)
            started = time.monotonic()
            try:
                g.reallocate(Topology(dp=2, tp=2))
            except ReallocationError as err:
                print(
                    f"timeout_s={timeout}: raised after {time.monotonic() - started:.2f}s; dead={err.dead} "
                    f"unresponsive={err.unresponsive} waiting={err.waiting} layout={err.layout!r}"
                )
            finally:
                os.kill(pid, signal.SIGCONT)
            ray.get(g.actors[3].activity.remote(), timeout=300)
            g.shutdown()


if __name__ == "__main__":
    main([float(x) for x in sys.argv[1:]] or [8.0, 20.0])
