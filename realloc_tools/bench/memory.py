"""The bench's memory: each baseline's peak estimated before it runs, whether it fits the node under Ray's memory monitor, and its peak sampled while it runs."""

from __future__ import annotations

import contextlib
import os

from realloc.layout import Layout
from realloc.shards import TORCH_DTYPES

#: Ray's memory monitor kills a worker once the node's used memory (total - available) passes
#: this fraction of its total (``RAY_memory_usage_threshold``, Ray's default 0.95).
RAY_MEMORY_THRESHOLD_DEFAULT = 0.95

#: Kept free below the monitor's threshold when deciding whether a baseline fits: other processes
#: on the machine move while it runs, and the estimates are estimates.
MEMORY_MARGIN_BYTES = 1 << 30

#: How often the driver samples the node's memory (and, on a local Ray, each worker's RSS).
MEMORY_SAMPLE_SECONDS = 0.05


def ray_memory_threshold() -> float:
    """The fraction of the node's memory past which Ray's memory monitor kills workers."""
    try:
        value = float(os.environ.get("RAY_memory_usage_threshold", RAY_MEMORY_THRESHOLD_DEFAULT))
    except ValueError:
        return RAY_MEMORY_THRESHOLD_DEFAULT
    return value if 0 < value <= 1 else RAY_MEMORY_THRESHOLD_DEFAULT


#: What the gather baseline's temporaries took beyond the model below (glibc keeps freed chunks
#: under its mmap threshold; gloo's buffers): on bench-1gb, 2026-11-24, 0-6% with 2 or 4 ranks
#: per replica, 18% with 8 (``dp=1,tp=2,pp=4 -> dp=2,tp=2,pp=2``: +12.58 GB, the node at 23.2 of
#: 25.3 GB, 0.8 GB short of Ray's memory monitor).
GATHER_HEAP_SLACK = 0.25


def baseline_memory_estimate(name: str, src: Layout, dst: Layout, nodes: int, store_resident: int = 0) -> dict:
    """The node memory ``name`` adds at its peak, moving ``src -> dst``, over what the node holds
    before it starts (the group's shards, Ray, the actors' own processes): ``{"bytes", "terms"}``.

    Every baseline writes a fresh set of destination buffers (``dst_bytes``, every rank's); on top
    (M = the model's bytes, P = the largest parameter's, W = the workers, all at once):

    * ``gather``: per parameter, each rank's padded send box, one part per rank of its replica,
      gloo's flat copy of those parts during the all-gather, then the full tensor beside the
      parts: the largest parameter's peak per rank, summed over the ranks, plus
      ``GATHER_HEAP_SLACK`` (``gather_temporaries_bytes``). On bench-1gb this is 4.7 GB before the
      slack from a ``dp=2,tp=2,pp=2`` source and 8.9 GB from ``dp=1,tp=2,pp=4`` (8 parts of 65 MB,
      twice, on each of 8 ranks).
    * ``broadcast``: every rank holds one full parameter at a time, the root a receive buffer and
      the owners a contiguous copy of their boxes beside it: 2 P W.
    * ``dcp``: the checkpoint in ``/dev/shm`` (each box once: M) and per rank one item read or
      cloned at a time (P W).
    * ``driver``: the full tensors assembled on the driver (M), and the object stores' pages:
      the fetched boxes in the sources' stores and in the driver's, the re-sliced objects in the
      driver's store and in each node's store the actors read them from, (2 + nodes) M. Ray's
      stores keep the pages they touched for the rest of the run, so only what exceeds
      ``store_resident`` (what earlier driver runs already touched) is new.
    """
    spec = src.spec
    workers = src.topology.world_size
    model = spec.total_bytes()
    largest = max(p.numel * TORCH_DTYPES[p.dtype].itemsize for p in spec.params)
    terms = {"dst_bytes": sum(dst.rank_bytes(r) for r in range(workers))}
    if name == "gather":
        peak = sum(_gather_temporaries(src, r) for r in range(workers))
        terms["gather_temporaries_bytes"] = int(peak * (1 + GATHER_HEAP_SLACK))
    elif name == "broadcast":
        terms["full_parameter_bytes"] = 2 * largest * workers
    elif name == "dcp":
        terms["checkpoint_bytes"] = model
        terms["items_bytes"] = largest * workers
    elif name == "driver":
        terms["driver_full_tensors_bytes"] = model
        terms["object_store_bytes"] = max(0, driver_store_bytes(model, nodes) - store_resident)
    else:
        raise ValueError(f"no memory model for baseline {name!r}")
    return {"bytes": sum(terms.values()), "terms": terms}


def driver_store_bytes(model_bytes: int, nodes: int) -> int:
    """The object-store pages the driver baseline touches (:func:`baseline_memory_estimate`)."""
    return (2 + nodes) * model_bytes


def _gather_temporaries(src: Layout, rank: int) -> int:
    """Bytes ``_gather_fn`` holds at once on ``rank`` for its largest parameter: the send box
    and the parts with gloo's flat output of the all-gather (``ProcessGroupGloo`` gathers into
    one flat tensor, then copies it into the parts), or the parts and the full tensor after it."""
    t = src.topology
    dp_rank = t.coords(rank)[0]
    replica = [r for r in range(t.world_size) if t.coords(r)[0] == dp_rank]
    boxes = [{s.param: s.numel for s in src.shards(r) if s.numel} for r in replica]
    worst = 0
    for p in src.spec.params:
        width = max(b.get(p.name, 0) for b in boxes)
        parts = width * len(replica)
        worst = max(worst, (width + parts + max(parts, p.numel)) * TORCH_DTYPES[p.dtype].itemsize)
    return worst


def memory_fit(
    estimate: int, available: int, total: int, threshold: float | None = None, margin: int = MEMORY_MARGIN_BYTES
) -> tuple[bool, int, str]:
    """Whether a baseline needing ``estimate`` more bytes fits: ``(fits, budget, reason)``.

    The budget is what the node can still take before Ray's memory monitor kills a worker (used
    memory past ``threshold`` of ``total``), less ``margin``: ``available - (1 - threshold) *
    total - margin``, with ``available`` as ``psutil.virtual_memory().available`` reports it (the
    monitor's own figure: used = total - available).
    """
    threshold = ray_memory_threshold() if threshold is None else threshold
    budget = int(available - (1 - threshold) * total - margin)
    if estimate <= budget:
        return True, budget, ""
    return (
        False,
        budget,
        (
            f"needs ~{estimate / 1e9:.1f} GB more at its peak, the node can take "
            f"{max(budget, 0) / 1e9:.1f} GB ({available / 1e9:.1f} GB available of "
            f"{total / 1e9:.1f}; Ray's memory monitor kills at {threshold:.0%} used; "
            f"{margin / 1e9:.1f} GB margin)"
        ),
    )


def decide_run(
    estimate: int,
    measured: list[int],
    repeats: int,
    available: int,
    total: int,
    threshold: float | None = None,
    margin: int = MEMORY_MARGIN_BYTES,
) -> tuple[bool, int, str]:
    """Whether the next run of a baseline goes ahead: ``(run, budget, reason)``.

    It needs ``estimate`` (:func:`baseline_memory_estimate`) or what its earlier runs in this
    direction took (``measured``, peak extra bytes each), whichever is more. When that does not
    fit (:func:`memory_fit`) the reason says ``skipped`` (no run yet) or ``stopped after k of
    repeats runs`` (the runs it had are its figures), and why.
    """
    fits, budget, why = memory_fit(max([estimate, *measured]), available, total, threshold, margin)
    if fits:
        return True, budget, ""
    done = f"stopped after {len(measured)} of {repeats} runs" if measured else "skipped"
    return False, budget, f"{done}: {why}"


class MemorySampler:
    """A driver thread sampling the node's used memory (``total - available``, what Ray's memory
    monitor reads) every ``MEMORY_SAMPLE_SECONDS``, and each worker's RSS where the workers are
    local processes: the whole run's peak, and the peak of the current window (:meth:`window`)."""

    def __init__(self, pids: list[int] | None = None):
        import threading

        import psutil

        self._psutil, self._lock = psutil, threading.Lock()
        self._procs = []
        for pid in pids or ():
            with contextlib.suppress(psutil.Error):
                self._procs.append(psutil.Process(pid))
        self.local = pids is not None
        self.total = psutil.virtual_memory().total
        self.peak_used = 0
        self._window: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MemorySampler:  # noqa: PYI034
        import threading

        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bench-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def used(self) -> int:
        return self.total - self._psutil.virtual_memory().available

    def set_pids(self, pids: list[int]) -> None:
        """The workers' processes to sample (after replacements)."""
        procs = []
        for pid in pids:
            with contextlib.suppress(self._psutil.Error):
                procs.append(self._psutil.Process(pid))
        with self._lock:
            self._procs = procs

    def _sample(self) -> None:
        used = self.used()
        private, largest = 0, 0
        for p in self._procs:
            with contextlib.suppress(self._psutil.Error):
                m = p.memory_info()
                private += m.rss - m.shared  # anonymous pages: /dev/shm mappings (shared) are in `used` once
                largest = max(largest, m.rss)
        with self._lock:
            self.peak_used = max(self.peak_used, used)
            w = self._window
            if w is not None:
                w["peak_used"] = max(w["peak_used"], used)
                w["workers_private_peak"] = max(w["workers_private_peak"], private)
                w["worker_rss_max"] = max(w["worker_rss_max"], largest)

    def _loop(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_SECONDS):
            with contextlib.suppress(Exception):  # a sample lost is not worth the run
                self._sample()

    @contextlib.contextmanager
    def window(self):
        """Yields a dict that, after the block, holds ``before_used``, ``peak_used``,
        ``peak_extra`` (peak - before), ``workers_private_peak`` (the workers' anonymous memory,
        summed over them, at its largest) and ``worker_rss_max`` (the largest worker's RSS, its
        /dev/shm mappings included); the last two are 0 without local workers."""
        w = {"before_used": self.used(), "workers_private_peak": 0, "worker_rss_max": 0}
        w["peak_used"] = w["before_used"]
        with self._lock:
            self._window = w
        try:
            yield w
        finally:
            self._sample()
            with self._lock:
                self._window = None
            w["peak_extra"] = w["peak_used"] - w["before_used"]


class MemoryGuard:
    """What ``run_direction`` needs to decide whether a baseline fits and to measure it: the
    sampler, whether the check applies (a local Ray: the node is this machine; ``check`` off or
    a cluster at ``--address``: every baseline runs), and the injected faults (``FAULT_ENV``)."""

    def __init__(
        self,
        sampler: MemorySampler,
        checked: bool,
        faults: dict | None = None,
        threshold: float | None = None,
        margin: int = MEMORY_MARGIN_BYTES,
    ):
        self.sampler, self.checked, self.faults = sampler, checked, faults or {}
        self.store_resident = 0  # object-store pages the driver baseline has touched so far
        self.threshold = ray_memory_threshold() if threshold is None else threshold
        self.margin = margin

    def decide(self, estimate: int, measured: list[int], repeats: int) -> tuple[bool, int, str]:
        """:func:`decide_run` against the node's memory now."""
        import psutil

        vm = psutil.virtual_memory()
        return decide_run(estimate, measured, repeats, vm.available, vm.total, self.threshold, self.margin)

    def fault(self, name: str, direction: int) -> str | None:
        return self.faults.get((name, direction), self.faults.get((name, None)))

    def describe(self) -> dict:
        return {
            "checked": self.checked,
            "total_bytes": self.sampler.total,
            "ray_memory_usage_threshold": self.threshold,
            "margin_bytes": self.margin,
            "sample_seconds": MEMORY_SAMPLE_SECONDS,
        }


def window_json(w: dict | None) -> dict:
    if not w or "peak_extra" not in w:
        return {}
    return {
        "before_used_bytes": w["before_used"],
        "peak_used_bytes": w["peak_used"],
        "peak_extra_bytes": w["peak_extra"],
        "workers_private_peak_bytes": w["workers_private_peak"],
        "worker_rss_max_bytes": w["worker_rss_max"],
    }
