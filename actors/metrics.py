"""Ray dashboard metrics (``ray.util.metrics``), tagged by model group and rank.

Exported through Ray's metrics agent (Prometheus format on the metrics export port), so the
Ray dashboard and any Prometheus/Grafana set-up show them: ``realloc_bytes_total`` by link kind,
``realloc_seconds`` per plan phase, ``realloc_bandwidth_gbps`` and ``realloc_in_flight``.
"""

from __future__ import annotations

from functools import lru_cache

from ray.util import metrics as ray_metrics

TAG_KEYS = ("model", "rank")


@lru_cache(maxsize=None)
def _instruments():
    return {
        "bytes": ray_metrics.Counter(
            "realloc_bytes", description="Bytes a worker received during reallocations, by link kind",
            tag_keys=TAG_KEYS + ("kind",)),
        "seconds": ray_metrics.Histogram(
            "realloc_seconds", description="Seconds a worker spent executing a reallocation phase",
            boundaries=[0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120], tag_keys=TAG_KEYS),
        "bandwidth": ray_metrics.Gauge(
            "realloc_bandwidth_gbps", description="Bytes received per second in the last phase, in GB/s",
            tag_keys=TAG_KEYS),
        "in_flight": ray_metrics.Gauge(
            "realloc_in_flight", description="Reallocation phases running on this worker", tag_keys=TAG_KEYS),
    }


_in_flight: dict[tuple, int] = {}


def record(tags: dict, moved: dict[str, int], seconds: float) -> None:
    inst = _instruments()
    for kind, nbytes in moved.items():
        if nbytes:
            inst["bytes"].inc(nbytes, tags={**tags, "kind": kind})
    inst["seconds"].observe(seconds, tags=tags)
    total = sum(moved.values())
    inst["bandwidth"].set(total / seconds / 1e9 if seconds > 0 else 0.0, tags=tags)


def in_flight(tags: dict, delta: int) -> None:
    key = tuple(sorted(tags.items()))
    _in_flight[key] = _in_flight.get(key, 0) + delta
    _instruments()["in_flight"].set(_in_flight[key], tags=tags)
