"""Ray dashboard metrics (``ray.util.metrics``), tagged by model group and rank.

Exported through Ray's metrics agent (Prometheus format on the metrics export port), so the
Ray dashboard and any Prometheus/Grafana set-up show them:

* ``realloc_bytes_total{model,rank,kind=local|intra|inter}``: bytes a worker received;
* ``realloc_seconds{model,rank,phase}``: seconds a worker spent executing: ``phase`` is ``0`` or
  ``1`` for operations run phase by phase (blended copies, fills, loads), ``all`` for the
  one-call path of ``reallocate``/``copy_to`` (prepare, both phases and commit together);
* ``realloc_execute_seconds_total{model,rank,phase}``: the same seconds summed exactly (see below);
* ``realloc_bandwidth_gbps{model,rank}``: bytes received per second over the worker's last
  operation that received anything (all phases together);
* ``realloc_in_flight{model,rank}``: execute phases running on the worker;
* ``realloc_pause_seconds{model,op}``: recorded on the driver, the wall time the caller
  (an RL loop) was blocked in one ``reallocate``/``copy_to``, planning included (``op``
  ``commit_staged``: the switch of a staged update, the time calls wait for it), and
  ``realloc_paused_seconds_total{model,op}`` their exact sum;
* ``realloc_weight_version{model}``: recorded on the driver, the weight version a group holds
  (a staged update's source version once it is committed);
* ``realloc_checkpoint_seconds{model,op}``: recorded on the driver at the successful end of each
  checkpoint operation of :class:`~actors.driver.checkpoint.CheckpointManager`, its wall time; ``op``
  ``save`` (writes, replication and removal of older iterations; an async save when its
  ``wait`` finishes), ``restore`` / ``reshard`` (a ``load``, by the method it took),
  ``import_hf``, ``export_hf``; ``realloc_checkpoint_wall_seconds_total{model,op}`` their exact sum;
* ``realloc_checkpoint_bytes_total{model,op,kind}``: recorded with it, the operation's bytes:
  ``kind`` ``disk`` (bytes written by a save or an export, read by a load or an import), and
  ``local`` / ``intra`` / ``inter`` (bytes its exchange moved: a save's replication, a load's
  or an export's transfers).

Ray prefixes every name with ``ray_`` on the export port (``ray_realloc_bytes_total``), and a
histogram ``H`` is exported as ``H_bucket`` / ``H_count`` / ``H_sum``. Its ``H_sum`` is not the
sum of the observations: Ray (2.60, OpenTelemetry recorder) exports the sum of the midpoints of the
buckets they fell in (two pauses of 0.069 s and 0.049 s gave ``_sum`` 0.105), hence the exact
``*_seconds_total`` counters beside the histograms, which the dashboard's means divide by
``H_count``. The Grafana dashboard in ``realloc_tools/observe/dashboards`` queries these
(docs/observability.md).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import lru_cache

from ray.util import metrics as ray_metrics

log = logging.getLogger(__name__)

TAG_KEYS = ("model", "rank")
SECONDS_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]
#: Checkpoints of big models take minutes.
CHECKPOINT_BOUNDARIES = SECONDS_BOUNDARIES + [300, 600, 1800]


class _Seconds:
    """Durations: a histogram (quantiles, counts) and a counter of their exact sum (Ray exports a
    histogram's ``_sum`` as the sum of bucket midpoints, see above)."""

    def __init__(self, histogram: str, total: str, description: str, boundaries: list, tag_keys: tuple):
        self.histogram = ray_metrics.Histogram(
            histogram, description=description, boundaries=boundaries, tag_keys=tag_keys
        )
        self.total = ray_metrics.Counter(total, description=f"{description}, summed exactly", tag_keys=tag_keys)

    def observe(self, seconds: float, tags: dict) -> None:
        self.histogram.observe(seconds, tags=tags)
        if seconds > 0:  # Ray's counters take positive increments only
            self.total.inc(seconds, tags=tags)


@lru_cache(maxsize=None)
def _instruments():
    return {
        "bytes": ray_metrics.Counter(
            "realloc_bytes",
            description="Bytes a worker received during reallocations, by link kind",
            tag_keys=TAG_KEYS + ("kind",),
        ),
        "seconds": _Seconds(
            "realloc_seconds",
            "realloc_execute_seconds",
            "Seconds a worker spent executing a reallocation phase",
            SECONDS_BOUNDARIES,
            TAG_KEYS + ("phase",),
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
        "pause": _Seconds(
            "realloc_pause_seconds",
            "realloc_paused_seconds",
            "Seconds the driver was blocked in one reallocate/copy_to/commit_staged",
            SECONDS_BOUNDARIES,
            ("model", "op"),
        ),
        "version": ray_metrics.Gauge(
            "realloc_weight_version", description="The weight version a model group holds", tag_keys=("model",)
        ),
        "ckpt_seconds": _Seconds(
            "realloc_checkpoint_seconds",
            "realloc_checkpoint_wall_seconds",
            "Seconds one checkpoint operation (save, restore, reshard, import_hf, export_hf) took",
            CHECKPOINT_BOUNDARIES,
            ("model", "op"),
        ),
        "ckpt_bytes": ray_metrics.Counter(
            "realloc_checkpoint_bytes",
            description="Bytes of checkpoint operations: kind disk (written or read), local/intra/inter (moved)",
            tag_keys=("model", "op", "kind"),
        ),
    }


_in_flight: dict[tuple, int] = {}
# The gauges this process set, by (name, tags): their last values, set again every half report
# interval. Ray (2.60) exports a gauge only while its process keeps setting it: a value set once
# left the export port within seconds (its agent evicts gauges not reported for two intervals,
# ray-project/ray#64633), so a panel showed a bandwidth or a weight version only just after it
# changed. Counters and histograms are cumulative and stay.
_gauges: dict[tuple, tuple] = {}
_gauges_lock = threading.Lock()
_refresher: threading.Thread | None = None


def _refresh_period_s() -> float:
    try:
        import ray

        interval_ms = ray._config.metrics_report_interval_ms()
    except Exception:  # no Ray config here (not connected): Ray's default
        interval_ms = 10_000
    return max(0.25, max(interval_ms, 1000) / 2000)


def _refresh_gauges() -> None:
    while _refresher is threading.current_thread():  # a test may replace it
        # read every round: the thread outlives the Ray session it started in, and the next one
        # may report more often (a period from a 10 s interval let a 1 s one evict the gauges)
        time.sleep(_refresh_period_s())
        with _gauges_lock:  # held while setting: a new value is never overwritten by an older one
            for gauge, value, tags in _gauges.values():
                try:
                    gauge.set(value, tags=tags)
                except Exception as err:  # noqa: BLE001 - e.g. between Ray sessions: the others go on
                    log.debug("gauge %s not set again: %s", tags, err)


def _set_gauge(key: str, gauge, value: float, tags: dict) -> None:
    """``gauge.set(value, tags)``, kept set until the next value (see ``_gauges``)."""
    global _refresher
    with _gauges_lock:
        gauge.set(value, tags=tags)
        _gauges[key, tuple(sorted(tags.items()))] = (gauge, value, tags)
        if _refresher is None:
            _refresher = threading.Thread(target=_refresh_gauges, name="realloc-metrics-gauges", daemon=True)
            _refresher.start()


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
        _set_gauge("bandwidth", _instruments()["bandwidth"], nbytes / seconds / 1e9, tags)


def record_pause(model: str, op: str, seconds: float) -> None:
    """Driver side: how long the caller was blocked."""
    _driver_instruments()["pause"].observe(seconds, tags={"model": model, "op": op})


def in_flight(tags: dict, delta: int) -> None:
    key = tuple(sorted(tags.items()))
    _in_flight[key] = _in_flight.get(key, 0) + delta
    _set_gauge("in_flight", _instruments()["in_flight"], _in_flight[key], tags)


def record_version(model: str, version: int) -> None:
    _set_gauge("version", _driver_instruments()["version"], version, {"model": model})


def record_checkpoint(model: str, op: str, stats) -> None:
    """Driver side: one checkpoint operation that succeeded, from its stats (``SaveStats``,
    ``LoadStats``, ``HFExportStats`` or ``import_hf``'s dict): its wall seconds and its bytes by kind."""
    d = stats if isinstance(stats, dict) else stats.as_dict()
    nbytes = {
        "disk": d.get("bytes_written", 0) or d.get("bytes_read", 0),
        "local": d.get("bytes_local", 0),
        "intra": d.get("bytes_intra_node", 0) or d.get("bytes_replicated_intra_node", 0),
        "inter": d.get("bytes_inter_node", 0) or d.get("bytes_replicated_inter_node", 0),
    }
    inst, seconds = _driver_instruments(), d.get("total_seconds", d.get("seconds", 0.0))
    inst["ckpt_seconds"].observe(seconds, tags={"model": model, "op": op})
    for kind, n in nbytes.items():
        if n:
            inst["ckpt_bytes"].inc(n, tags={"model": model, "op": op, "kind": kind})
