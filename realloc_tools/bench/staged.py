"""The staged update in the bench: a generator serving calls while the trainer's weights move, its pauses and memory."""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any, Sequence

from realloc.layout import Layout, Topology
from realloc_tools.bench.common import log_line
from realloc_tools.bench.memory import MemorySampler, memory_fit, window_json
from realloc_tools.bench.verify import crc, digests_of_group

#: ``--staged-calls``: generator calls timed while nothing else runs.
STAGED_IDLE_CALLS = 50

#: The issue's target for the pause at commit ("<= 10 ms plus the hook"; the bench's generator
#: worker class has no ``on_shards_changed`` hook, so the target is 10 ms flat).
STAGED_PAUSE_TARGET_SECONDS = 0.010

#: Generator calls the caller makes after a commit (or a stop-the-world copy) ends before it stops.
STAGED_CALLS_AFTER = 5


def staged_memory_estimate(spec, trainer: Topology, generator: Topology, bucket_bytes: int) -> dict:
    """Node memory the staged measurement takes at its peak (its own two groups; the moves'
    group is gone by then): ``{"bytes", "terms"}``. The trainer's layout; four sets of the
    generator's (serving, the shadow set kept between updates, the stop-the-world copy's fresh
    destination, and the set it replaces, kept as its rollback or spare); the trainer's move into
    the generator's layout for the final check; two buckets of staging per worker. (bench-1gb,
    2026-11-24: 8.20 GB; the node's used memory rose by 7.64 and 7.30 GB at its peak in two runs,
    the first above the estimate of that run, which counted three generator sets: 7.18.)"""
    t, g = Layout(spec, trainer), Layout(spec, generator)
    gen_bytes = sum(g.rank_bytes(r) for r in range(generator.world_size))
    terms = {
        "trainer_bytes": sum(t.rank_bytes(r) for r in range(trainer.world_size)),
        "generator_sets_bytes": 4 * gen_bytes,
        "trainer_check_bytes": gen_bytes,
        "staging_bytes": 2 * bucket_bytes * (trainer.world_size + generator.world_size),
    }
    return {"bytes": sum(terms.values()), "terms": terms}


def latency_summary(seconds: Sequence[float]) -> dict:
    """``calls``, ``median_seconds``, ``p99_seconds`` (nearest rank: below 100 calls, the slowest)
    and ``max_seconds`` of call latencies (``None`` without calls)."""
    s = sorted(seconds)
    if not s:
        return {"calls": 0, "median_seconds": None, "p99_seconds": None, "max_seconds": None}
    return {
        "calls": len(s),
        "median_seconds": statistics.median(s),
        "p99_seconds": s[max(0, math.ceil(0.99 * len(s)) - 1)],
        "max_seconds": s[-1],
    }


@functools.lru_cache(maxsize=1)
def _generator_cls() -> type:
    """The staged measurement's generator worker class (defined on first use: ``actors`` imports
    Ray; Ray ships the class to the workers by value)."""
    from actors.worker import ShardWorker

    class BenchGenerator(ShardWorker):
        """One cheap read-only method, and no ``on_shards_changed`` hook: a commit's pause has no
        hook time in it."""

        def probe(self) -> tuple[int, int]:
            """``(weight version served, CRC32 of this rank's smallest non-empty slot)``: what a
            generation call reads, for a few microseconds of work (the latency is the call path's)."""
            ctx = self.context()
            slot = min((s for s, t in ctx.tensors.items() if t.numel()), key=lambda s: (ctx.tensors[s].numel(), s))
            return ctx.version, crc(ctx.tensors[slot])

    return BenchGenerator


def _bump_weights(ctx) -> None:
    """The staged measurement's training step: every real element of the trainer's shards + 1
    (padding stays zero; every dp replica does the same), so each update brings other bytes."""
    for view in ctx.views().values():
        view.add_(1)


class _Caller:
    """A driver thread calling the generator's ``probe`` back to back with ``writes=False`` (as
    a generation server would): each call's ``(start, end, result)`` on the driver's clock."""

    def __init__(self, gen):
        import threading

        self.gen, self.calls, self.error = gen, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-caller", daemon=True)

    def __enter__(self) -> _Caller:  # noqa: PYI034
        self._thread.start()
        self.wait_calls(1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=300)
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"generator call failed: {type(self.error).__name__}: {self.error}") from self.error

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                t = time.perf_counter()
                out = self.gen.call("probe", writes=False)
                self.calls.append((t, time.perf_counter(), out))
        except Exception as err:  # noqa: BLE001 - raised on the driver's thread by __exit__
            self.error = err

    def wait_calls(self, n: int, after: float = -math.inf, timeout_s: float = 300.0) -> None:
        """Until ``n`` calls that started at or after ``after`` have returned."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for s, _, _ in list(self.calls) if s >= after) < n:
            if self.error is not None:
                raise RuntimeError(f"generator call failed: {type(self.error).__name__}: {self.error}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the generator answered fewer than {n} calls in {timeout_s:.0f}s")
            time.sleep(0.002)


def _check_served(calls: list, begin: float, end: float, before, after, what: str, failures: list[str]) -> None:
    """Calls that ended before ``begin`` served ``before``, calls that started after ``end``
    served ``after``, and calls overlapping ``[begin, end]`` one of the two on every rank alike
    (never a mix of versions across the generator's workers)."""
    for s, e, out in calls:
        want = [before] if e <= begin else [after] if s >= end else [before, after]
        if out not in want:
            failures.append(f"{what}: a call from {s - begin:+.3f}s to {e - begin:+.3f}s served {out}, not {want}")
            return


def _staged_round(trainer, gen, before_digests: list, failures: list[str], label: str) -> tuple[dict, list, list]:
    """One training step, one staged update committed while the caller runs, then one
    stop-the-world ``copy_to`` while the caller runs: the round's figures, the latencies of the
    calls that ran during the staging, and the generator's digests at the end."""
    trainer.run(_bump_weights)  # a training step: every weight changes (the trainer's version too)
    served_before = gen.call("probe", writes=False)
    with _Caller(gen) as caller:
        t0 = time.perf_counter()
        update = trainer.copy_to(gen, stage=True)
        stats = update.wait()
        t1 = time.perf_counter()
        update.commit()
        t2 = time.perf_counter()
        caller.wait_calls(STAGED_CALLS_AFTER, after=t2)
    staged_calls = caller.calls
    generator_version = gen.version
    served_after = gen.call("probe", writes=False)
    staged_digests = digests_of_group(gen)
    with _Caller(gen) as caller:
        t3 = time.perf_counter()
        stw = trainer.copy_to(gen)
        t4 = time.perf_counter()
        caller.wait_calls(STAGED_CALLS_AFTER, after=t4)
    stw_calls = caller.calls
    served_stw = gen.call("probe", writes=False)
    stw_digests = digests_of_group(gen)

    n = len(failures)
    _check_served(staged_calls, t1, t2, served_before, served_after, f"{label} staged update", failures)
    _check_served(stw_calls, t3, t4, served_after, served_stw, f"{label} stop-the-world copy", failures)
    if any(v != update.version for v, _ in served_after):
        failures.append(f"{label}: after the commit the generator served versions {served_after}, not {update.version}")
    if any(a[1] == b[1] for a, b in zip(served_before, served_after)):
        failures.append(f"{label}: a generator worker served the same bytes before and after the commit")
    if [c for _, c in served_stw] != [c for _, c in served_after] or any(v != stw.version for v, _ in served_stw):
        failures.append(f"{label}: after the stop-the-world copy the generator served {served_stw}")
    if any(a == b for a, b in zip(before_digests, staged_digests)):
        failures.append(f"{label}: a generator worker's shards did not change with the staged update")
    if staged_digests != stw_digests:
        failures.append(f"{label}: the staged update and the stop-the-world copy left different shards")

    during = [e - s for s, e, _ in staged_calls if s >= t0 and e <= t1]
    commit = [e - s for s, e, _ in staged_calls if s < t2 and e > t1]
    # How long the commit kept calls out: from the end of the call it waited for (one in flight
    # when it began, served before it; none: from its start) to its return.
    waited_for = [e for s, e, _ in staged_calls if s < t1 < e <= t2]
    blocking = t2 - max([t1, *waited_for])
    blocked = [e - s for s, e, _ in stw_calls if s < t4 and e > t3]
    out = {
        "staging_wall_seconds": t1 - t0,
        "transfer_seconds": stats.seconds,
        "transfer_gbps": stats.gbps,
        "calls_during_staging": latency_summary(during),
        "pause_seconds": update.pause_seconds,
        "commit_wall_seconds": t2 - t1,
        "commit_blocking_seconds": blocking,
        "calls_overlapping_commit": len(commit),
        "overlapping_commit_call_max_seconds": max(commit, default=None),
        "stop_the_world_seconds": t4 - t3,
        "calls_overlapping_stop_the_world": len(blocked),
        "overlapping_stop_the_world_call_max_seconds": max(blocked, default=None),
        "shadow_bytes_per_actor": stats.shadow_bytes_per_actor,
        "version": {
            "trainer": trainer.version,
            "update": update.version,
            "stats": stats.version,
            "generator_after_commit": generator_version,
            "served_before": sorted({v for v, _ in served_before}),
            "served_after_commit": sorted({v for v, _ in served_after}),
            "after_stop_the_world": stw.version,
        },
        "staged_stats": stats.as_dict(),
        "stop_the_world_stats": stw.as_dict(),
        "verified": len(failures) == n,
    }
    log_line(
        f"staged {label}: staging {t1 - t0:.3f}s ({stats.seconds:.3f}s transfer, {stats.gbps:.2f} GB/s, "
        f"{len(during)} calls served, median {_ms(out['calls_during_staging']['median_seconds'])}); commit "
        f"pause {update.pause_seconds * 1e3:.2f} ms (calls kept out {blocking * 1e3:.2f} ms, wall "
        f"{(t2 - t1) * 1e3:.2f} ms, calls overlapping it "
        f"max {_ms(out['overlapping_commit_call_max_seconds'])}); stop-the-world copy {t4 - t3:.3f}s; "
        f"{'ok' if out['verified'] else failures[n:]}"
    )
    return out, during, stw_digests


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _bench_staged(
    spec,
    trainer_topo: Topology,
    gen_topo: Topology,
    *,
    bucket_bytes: int,
    repeats: int,
    calls: int,
    seed: int,
    memory_check: bool,
    local: bool,
) -> dict:
    """The staged-update measurement (docs/benchmarks.md, "Staged updates"): a trainer group and
    a generator group on actors of their own; ``calls`` generator calls while idle; one untimed
    round (forms the staged world and the copies' world, touches the shadow set's pages), then
    ``repeats`` rounds of :func:`_staged_round`; finally the trainer moves into the generator's
    layout and its digests must equal the generator's."""
    import psutil

    from actors.driver.group import ModelGroup

    started = time.perf_counter()
    out: dict[str, Any] = {
        "trainer": str(trainer_topo),
        "generator": str(gen_topo),
        "trainer_actors": trainer_topo.world_size,
        "generator_actors": gen_topo.world_size,
        "repeats": repeats,
        "idle_calls": calls,
        "generator_call": "ModelGroup.call('probe', writes=False) from a driver thread, back to back: the "
        "weight version served and the CRC32 of each worker's smallest slot",
        "hook": None,
        "pause_target_seconds": STAGED_PAUSE_TARGET_SECONDS,
    }
    estimate = staged_memory_estimate(spec, trainer_topo, gen_topo, bucket_bytes)
    out["memory"] = {"checked": memory_check, "estimate_bytes": estimate["bytes"], "estimate_terms": estimate["terms"]}
    if memory_check:
        vm = psutil.virtual_memory()
        fits, budget, why = memory_fit(estimate["bytes"], vm.available, vm.total)
        out["memory"]["budget_bytes"] = budget
        if not fits:
            out["skipped"] = f"skipped: {why}"
            log_line(f"staged measurement {out['skipped']}")
            return out
    trainer = ModelGroup.create(spec, trainer_topo, name="bench-trainer", bucket_bytes=bucket_bytes, timeout_s=900)
    gen = None
    try:
        gen = ModelGroup.create(
            spec,
            gen_topo,
            name="bench-generator",
            worker_cls=_generator_cls(),
            bucket_bytes=bucket_bytes,
            timeout_s=900,
        )
        tn, gn = set(trainer.placement.nodes), set(gen.placement.nodes)
        out.update(nodes=len(tn | gn), trainer_nodes=len(tn), generator_nodes=len(gn), shared_nodes=len(tn & gn))
        out["generator_bytes_per_actor"] = max(gen.layout.rank_bytes(r) for r in range(gen.num_workers))
        sampler = MemorySampler([i["pid"] for i in trainer.infos + gen.infos] if local else None)
        failures: list[str] = []
        with sampler, sampler.window() as window:
            t = time.perf_counter()
            trainer.init_synthetic(seed + 1)  # other weights than the generator's from the start
            gen.init_synthetic(seed)
            digests = digests_of_group(gen)
            log_line(
                f"staged: {trainer_topo} -> {gen_topo}, synthetic weights written in {time.perf_counter() - t:.1f}s"
            )
            warm, _, digests = _staged_round(trainer, gen, digests, failures, "warm-up")
            for _ in range(3):  # untimed: the path's own first calls
                gen.call("probe", writes=False)
            idle = []
            for _ in range(calls):
                t = time.perf_counter()
                gen.call("probe", writes=False)
                idle.append(time.perf_counter() - t)
            out["idle"] = latency_summary(idle)
            log_line(f"staged: {calls} idle calls, median {_ms(out['idle']['median_seconds'])}")
            rounds, during = [], []
            for i in range(repeats):
                r, lat, digests = _staged_round(trainer, gen, digests, failures, f"{i + 1}/{repeats}")
                rounds.append(r)
                during += lat
            trainer.reallocate(gen.layout)  # the check: the trainer's weights in the generator's layout
            if digests_of_group(trainer) != digests:
                failures.append("the generator's shards differ from the trainer's in the generator's layout")
        out["memory"].update(window_json(window))
    finally:
        if gen is not None:
            gen.shutdown()
        trainer.shutdown()
    pauses = [r["pause_seconds"] for r in rounds]
    out["warm_up"] = {
        k: warm[k]
        for k in (
            "staging_wall_seconds",
            "transfer_seconds",
            "pause_seconds",
            "commit_wall_seconds",
            "stop_the_world_seconds",
        )
    }
    out["during_staging"] = {
        **latency_summary(during),
        "calls_per_update": [r["calls_during_staging"]["calls"] for r in rounds],
        "staging_wall_median_seconds": statistics.median(r["staging_wall_seconds"] for r in rounds),
        "transfer_median_seconds": statistics.median(r["transfer_seconds"] for r in rounds),
        "transfer_gbps_median": statistics.median(r["transfer_gbps"] for r in rounds),
        "bytes_inter_node": rounds[-1]["staged_stats"]["bytes_inter_node"],
        "bytes_intra_node": rounds[-1]["staged_stats"]["bytes_intra_node"],
        "bytes_local": rounds[-1]["staged_stats"]["bytes_local"],
    }
    out["commit"] = {
        "pause_seconds": pauses,
        "pause_median_seconds": statistics.median(pauses),
        "pause_max_seconds": max(pauses),
        "commit_wall_seconds": [r["commit_wall_seconds"] for r in rounds],
        "blocking_seconds": [r["commit_blocking_seconds"] for r in rounds],
        "blocking_median_seconds": statistics.median(r["commit_blocking_seconds"] for r in rounds),
        "calls_overlapping": [r["calls_overlapping_commit"] for r in rounds],
        "overlapping_call_max_seconds": max(
            (r["overlapping_commit_call_max_seconds"] for r in rounds if r["calls_overlapping_commit"]), default=None
        ),
    }
    walls = [r["stop_the_world_seconds"] for r in rounds]
    out["stop_the_world"] = {
        "seconds": walls,
        "median_seconds": statistics.median(walls),
        "transfer_median_seconds": statistics.median(r["stop_the_world_stats"]["seconds"] for r in rounds),
        "overlapping_call_max_seconds": max(
            (r["overlapping_stop_the_world_call_max_seconds"] for r in rounds if r["calls_overlapping_stop_the_world"]),
            default=None,
        ),
    }
    out["shadow_bytes_per_actor"] = max(r["shadow_bytes_per_actor"] for r in rounds)
    out["version"] = rounds[-1]["version"]
    out["goal"] = {
        "target_seconds": STAGED_PAUSE_TARGET_SECONDS,
        "hook_seconds": None,  # no on_shards_changed hook in the bench's generator worker class
        "met": max(pauses) <= STAGED_PAUSE_TARGET_SECONDS,
        "met_by_median": statistics.median(pauses) <= STAGED_PAUSE_TARGET_SECONDS,
    }
    out["runs"] = rounds
    out["failures"] = failures
    out["verified"] = not failures
    out["seconds"] = time.perf_counter() - started
    return out


def run_staged(spec, trainer: Topology, generator: Topology, **kwargs: Any) -> dict:
    """:func:`_bench_staged`, its failure recorded (``error``, ``verified`` false) rather than raised."""
    try:
        return _bench_staged(spec, trainer, generator, **kwargs)
    except Exception as err:  # noqa: BLE001 - the moves' figures stand without it
        text = f"{type(err).__name__}: {err}"[:2000]
        log_line(f"staged measurement failed: {text[:300]}")
        return {"trainer": str(trainer), "generator": str(generator), "error": text, "verified": False}


def format_staged(s: dict) -> list[str]:
    """The staged measurement's lines of :func:`format_report`."""
    head = f"staged update, trainer {s['trainer']} -> generator {s['generator']}"
    if "skipped" in s:
        return [f"{head}: {s['skipped']}"]
    if "error" in s:
        return [f"{head}: FAILED: {s['error'][:300]}"]
    idle, during, commit, stw, goal = s["idle"], s["during_staging"], s["commit"], s["stop_the_world"], s["goal"]

    def lat(x: dict) -> str:
        return f"median {_ms(x['median_seconds'])}, p99 {_ms(x['p99_seconds'])}, max {_ms(x['max_seconds'])}"

    where = "on nodes of their own" if not s["shared_nodes"] else f"sharing {s['shared_nodes']} node(s)"
    lines = [
        f"{head} ({s['trainer_actors']} + {s['generator_actors']} actors {where}; {s['repeats']} updates after a "
        f"warm-up; generator call 'probe' with writes=False, no hook)",
        f"  calls idle: {lat(idle)} ({idle['calls']} calls)",
        f"  calls during staging: {lat(during)} ({during['calls']} calls over {s['repeats']} updates); transfer "
        f"{during['transfer_median_seconds']:.3f}s ({during['transfer_gbps_median']:.2f} GB/s), staging wall "
        f"{during['staging_wall_median_seconds']:.3f}s; shadow set {s['shadow_bytes_per_actor'] / 1e6:.1f} MB per "
        f"actor; version {s['version']['update']}",
        f"  pause at commit: median {_ms(commit['pause_median_seconds'])}, max {_ms(commit['pause_max_seconds'])}; "
        f"calls kept out median {_ms(commit['blocking_median_seconds'])}; calls overlapping the commit: max "
        f"{_ms(commit['overlapping_call_max_seconds'])}; target "
        f"<= {goal['target_seconds'] * 1e3:g} ms (no hook) {'met' if goal['met'] else 'NOT met'}"
        + (
            ""
            if goal["met"] == goal["met_by_median"]
            else f" (by the median: {'met' if goal['met_by_median'] else 'not met'})"
        ),
        f"  stop-the-world copy_to: median {stw['median_seconds']:.3f}s without a call served (calls overlapping "
        f"it: max {_ms(stw['overlapping_call_max_seconds'])})",
        f"  verified: {'yes' if s['verified'] else 'NO: ' + '; '.join(s['failures'])[:300]}",
    ]
    return lines
