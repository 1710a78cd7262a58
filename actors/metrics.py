"""Ray dashboard metrics (``ray.util.metrics``), tagged by model group and rank.

Exported through Ray's metrics agent (Prometheus format on the metrics export port), so the
Ray dashboard and any Prometheus/Grafana set-up show them:

* ``realloc_bytes_total{model,rank,kind=local|intra|inter}``: bytes a worker received;
* ``realloc_seconds{model,rank,phase}``: seconds a worker spent executing: ``phase`` is ``0`` or
  ``1`` for operations run phase by phase (blended copies, fills, loads), ``all`` for the
  one-call path of ``reallocate``/``copy_to`` (prepare, both phases and commit together);
* ``realloc_bandwidth_gbps{model,rank}``: bytes received per second over the worker's last
  operation that received anything (all phases together);
* ``realloc_in_flight{model,rank}``: execute phases running on the worker;
* ``realloc_pause_seconds{model,op}``: recorded on the driver, the wall time the caller
  (an RL loop) was blocked in one ``reallocate``/``copy_to``, planning included (``op``
  ``commit_staged``: the switch of a staged update, the time calls wait for it);
* ``realloc_weight_version{model}``: recorded on the driver, the weight version a group holds
  (a staged update's source version once it is committed).
"""

from __future__ import annotations

from functools import lru_cache

from ray.util import metrics as ray_metrics

TAG_KEYS = ("model", "rank")
SECONDS_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]


@lru_cache(maxsize=None)
def _instruments():
    return {
        "bytes": ray_metrics.Counter(
            "realloc_bytes",
            description="Bytes a worker received during reallocations, by link kind",
            tag_keys=TAG_KEYS + ("kind",),
        ),
        "seconds": ray_metrics.Histogram(
            "realloc_seconds",
            description="Seconds a worker spent executing a reallocation phase",
            boundaries=SECONDS_BOUNDARIES,
            tag_keys=TAG_KEYS + ("phase",),
        ),
        "bandwidth": ray_metrics.Gauge(
            "realloc_bandwidth_gbps",
            description="Bytes received per second over the worker's last operation that received bytes, in GB/s",
            tag_keys=TAG_KEYS,
        ),
        "in_flight": ray_metrics.Gauge(
            "realloc_in_flight", description="Reallocation phases running on this worker", tag_keys=TAG_KEYS
        ),
    }


@lru_cache(maxsize=None)
def _driver_instruments():
    return {
        "pause": ray_metrics.Histogram(
            "realloc_pause_seconds",
            description="Seconds the driver was blocked in one reallocate/copy_to",
            boundaries=SECONDS_BOUNDARIES,
            tag_keys=("model", "op"),
        ),
        "version": ray_metrics.Gauge(
            "realloc_weight_version", description="The weight version a model group holds", tag_keys=("model",)
        ),
    }


_in_flight: dict[tuple, int] = {}


def record_phase(tags: dict, phase: int, moved: dict[str, int], seconds: float) -> None:
    """One execute phase of one worker: bytes by link kind, seconds by phase."""
    inst = _instruments()
    for kind, nbytes in moved.items():
        if nbytes:
            inst["bytes"].inc(nbytes, tags={**tags, "kind": kind})
    inst["seconds"].observe(seconds, tags={**tags, "phase": str(phase)})


def record_operation(tags: dict, nbytes: int, seconds: float) -> None:
    """A committed operation that received ``nbytes`` in ``seconds`` of execution."""
    if nbytes and seconds > 0:
        _instruments()["bandwidth"].set(nbytes / seconds / 1e9, tags=tags)


def record_pause(model: str, op: str, seconds: float) -> None:
    """Driver side: how long the caller was blocked."""
    _driver_instruments()["pause"].observe(seconds, tags={"model": model, "op": op})


def in_flight(tags: dict, delta: int) -> None:
    key = tuple(sorted(tags.items()))
    _in_flight[key] = _in_flight.get(key, 0) + delta
    _instruments()["in_flight"].set(_in_flight[key], tags=tags)


def record_version(model: str, version: int) -> None:
    _driver_instruments()["version"].set(version, tags={"model": model})
