"""``realloc bench --fleet R``: a fleet update of R replicas, relayed, beside the trainer staging each one.

A trainer group and R replica groups (``--fleet-layouts 'trainer->replica'``, each on actors of
its own, spread over the simulated nodes) take turns of two ways to stage the trainer's new
weights into every replica, then commit them:

* ``fleet``: ``Fleet(replicas).stage(trainer)`` (actors/driver/fleet.py): the trainer stages one
  replica and the staged replicas relay to the rest, doubling each round;
* ``trainer_each``: the trainer stages every replica itself, one after the other
  (``trainer.copy_to(replica, stage=True)`` in turn), which is what a fleet update did before;
* ``copy_to``: ``trainer.copy_to(replicas)``, one copy into every replica (relayed as a fleet
  update, then every replica switched): its seconds are the whole call, the switches included.

Per way, after one untimed update of each (plans, worlds and shadow sets made): the seconds from
the start to every replica staged (median over ``repeats``), the bytes
that left the trainer's workers (its transfers' ``bytes_intra_node + bytes_inter_node``) and the
bytes moved in all, and whether every replica then held the trainer's weights bit-exact
(``verify_synthetic``). The trainer takes new weights (``init_synthetic``) before every update.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from actors import Fleet, ModelGroup
from realloc import Topology


def _moved(stats) -> int:
    return stats.bytes_intra_node + stats.bytes_inter_node + stats.bytes_local


def _fleet(trainer: ModelGroup, fleet: Fleet) -> tuple[float, int, int]:
    started = time.perf_counter()
    update = fleet.stage(trainer)
    stats = update.wait()
    seconds = time.perf_counter() - started
    if len(stats) != len(fleet.replicas):
        raise RuntimeError(f"fleet update staged {sorted(stats)} of {fleet.names}: {update.errors}")
    update.commit(at="now")
    egress = sum(_moved(s) for name, s in stats.items() if update.relayed_from[name] == trainer.name)
    return seconds, egress, sum(_moved(s) for s in stats.values())


def _trainer_each(trainer: ModelGroup, fleet: Fleet) -> tuple[float, int, int]:
    started = time.perf_counter()
    updates = []
    for r in fleet.replicas:
        update = trainer.copy_to(r, stage=True)
        update.wait()
        updates.append(update)
    seconds = time.perf_counter() - started
    for update in updates:
        update.commit(at="now")
    moved = sum(_moved(u.stats) for u in updates)
    return seconds, moved, moved


def _copy_to(trainer: ModelGroup, fleet: Fleet) -> tuple[float, int, int]:
    started = time.perf_counter()
    stats = trainer.copy_to(list(fleet.replicas))
    seconds = time.perf_counter() - started
    egress = sum(_moved(s) for s in stats.values() if s.transition.startswith(f"{trainer.name}["))
    return seconds, egress, sum(_moved(s) for s in stats.values())


#: the ways, each given the trainer and the fleet of the replicas
WAY = {"fleet": _fleet, "trainer_each": _trainer_each, "copy_to": _copy_to}
WAYS = tuple(WAY)


def measure(
    spec,
    replicas: int,
    layouts: tuple[Topology, Topology],
    bucket_bytes: int,
    repeats: int,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """One row per way (:data:`WAYS`), the ways alternating ``repeats`` times."""
    trainer_top, replica_top = layouts
    trainer = ModelGroup.create(spec, trainer_top, name="bench-fleet-trainer", bucket_bytes=bucket_bytes)
    groups = [
        ModelGroup.create(spec, replica_top, name=f"bench-fleet-r{i}", bucket_bytes=bucket_bytes)
        for i in range(replicas)
    ]
    try:
        fleet = Fleet(groups)
        runs: dict[str, list[tuple[float, int, int]]] = {w: [] for w in WAYS}
        exact = {w: True for w in WAYS}
        seed = 0
        for way in WAYS:  # warm-up, not timed: plans, worlds, the replicas' shadow sets
            seed += 1
            trainer.init_synthetic(seed)
            WAY[way](trainer, fleet)
        for _ in range(repeats):
            for way in WAYS:
                seed += 1
                trainer.init_synthetic(seed)
                got = WAY[way](trainer, fleet)
                runs[way].append(got)
                exact[way] &= all(g.verify_synthetic(seed) == {} for g in groups)
                log(f"fleet bench: {way} {got[0]:.3f} s, trainer sent {got[1] / 1e6:.1f} MB")
        model = spec.total_bytes()
        return [
            {
                "way": way,
                "replicas": replicas,
                "trainer": str(trainer_top),
                "replica": str(replica_top),
                "seconds": statistics.median(r[0] for r in runs[way]),
                "seconds_all": [r[0] for r in runs[way]],
                "trainer_egress_bytes": runs[way][-1][1],
                "trainer_egress_models": runs[way][-1][1] / model,
                "bytes_moved": runs[way][-1][2],
                "exact": exact[way],
            }
            for way in WAYS
        ]
    finally:
        for g in [trainer, *groups]:
            g.shutdown()


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'way':<14}{'replicas':>9}{'seconds':>10}{'trainer egress':>17}{'moved':>12}  exact"]
    for r in rows:
        lines.append(
            f"{r['way']:<14}{r['replicas']:>9}{r['seconds']:>10.3f}"
            f"{r['trainer_egress_bytes'] / 1e9:>10.3f} GB ({r['trainer_egress_models']:.2f}x)"
            f"{r['bytes_moved'] / 1e9:>9.3f} GB  {r['exact']}"
        )
    return "\n".join(lines)
