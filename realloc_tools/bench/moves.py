"""The bench run and its timed moves: ``bench`` (one set of actors, every transition), ``ModelGroup.reallocate`` there and back, resident kept layouts."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Any, Sequence

import torch

from realloc.layout import Topology
from realloc.progress import Progress
from realloc_tools.bench.baselines import DEFERRED_BASELINES, run_deferred, run_direction
from realloc_tools.bench.common import BASELINES, MB, log, log_line, warm_imports
from realloc_tools.bench.faults import injected_faults, open_default_group, recover_group
from realloc_tools.bench.memory import MemoryGuard, MemorySampler
from realloc_tools.bench.probes import measure_transport
from realloc_tools.bench.report import cpu_model, loadavg, ram_bytes, summarise
from realloc_tools.bench.staged import STAGED_IDLE_CALLS, run_staged
from realloc_tools.bench.verify import Layouts
from realloc_tools.cluster import ray_for_command


def bench(
    spec,
    transitions: list[tuple[Topology, Topology]],
    *,
    address: str | None = None,
    nodes: int = 2,
    bucket_bytes: int = 64 * MB,
    repeats: int = 3,
    baseline_repeats: int = 3,
    baselines: Sequence[str] = BASELINES,
    verify: str = "digest",
    probe_bytes: int = 256 * MB,
    seed: int = 0,
    resident: bool = True,
    memory_check: bool = True,
    staged: tuple[Topology, Topology] | None = None,
    staged_calls: int = STAGED_IDLE_CALLS,
    traces: list | None = None,
) -> dict:
    """Run the whole benchmark (both directions of every transition, one set of actors; then,
    with ``staged`` (trainer and generator topologies), the staged-update measurement on two
    groups of their own); returns the report (see ``docs/benchmarks.md``). ``memory_check``:
    skip a baseline (or the staged measurement) whose estimated peak the node cannot take (on a
    local Ray only: a cluster's nodes are not this machine). No ``transitions``: the staged
    measurement alone. ``traces``: a list to append the trace of every timed move of ours to
    (``ModelGroup.last_trace``, gathered after the move's timing)."""
    started = time.perf_counter()
    if not transitions and staged is None:
        raise ValueError("nothing to run: no transitions and no staged measurement")
    staged_workers = sum(t.world_size for t in staged) if staged is not None else 0
    workers = transitions[0][0].world_size if transitions else staged_workers
    per_node = -(-workers // nodes)
    store_bytes = max(512 * MB, 3 * spec.total_bytes() + 256 * MB)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    report: dict[str, Any] = {
        "model": spec.name,
        "model_bytes": spec.total_bytes(),
        "workers": workers,
        "transitions": [f"{a} -> {b}" for a, b in transitions],
        "staged_only": not transitions,
        "bucket_bytes": bucket_bytes,
        "repeats": repeats,
        "baseline_repeats": baseline_repeats,
        "verify_mode": verify,
    }
    with ray_for_command(address, nodes, per_node, store_bytes) as where:
        log_line(
            f"{spec.name} ({spec.total_bytes() / 1e9:.2f} GB), {len(transitions)} transitions on {workers} actors"
            f"{', then the staged measurement' if staged is not None else ''}; {where}"
        )
        report["machine"] = {
            "cores": cores,
            "cpu": cpu_model(),
            "ram_bytes": ram_bytes(),
            "load_average_at_start": loadavg(),
            "torch": torch.__version__,
            "ray": __import__("ray").__version__,
            "where": where,
        }
        if transitions:
            _bench_moves(
                report,
                spec,
                transitions,
                address=address,
                bucket_bytes=bucket_bytes,
                repeats=repeats,
                baseline_repeats=baseline_repeats,
                baselines=baselines,
                verify=verify,
                probe_bytes=probe_bytes,
                seed=seed,
                resident=resident,
                memory_check=memory_check,
                cores=cores,
                traces=traces,
            )
        if staged is not None:
            report["staged"] = run_staged(
                spec,
                *staged,
                bucket_bytes=bucket_bytes,
                repeats=repeats,
                calls=staged_calls,
                seed=seed,
                memory_check=memory_check and address is None,
                local=address is None,
            )
            report.setdefault("verified", {})["staged"] = report["staged"].get("verified", True)
            if transitions:
                report["goals"]["staged_pause_at_commit_10ms"] = report["staged"].get("goal", {}).get("met")
    report["total_seconds"] = time.perf_counter() - started
    if "machine" in report:
        report["machine"]["load_average_at_end"] = loadavg()
    return report


def _bench_moves(
    report: dict,
    spec,
    transitions: list[tuple[Topology, Topology]],
    *,
    address: str | None,
    bucket_bytes: int,
    repeats: int,
    baseline_repeats: int,
    baselines: Sequence[str],
    verify: str,
    probe_bytes: int,
    seed: int,
    resident: bool,
    memory_check: bool,
    cores: int,
    traces: list | None = None,
) -> None:
    """The moves (every transition both ways, the baselines, the probes, the resident loop) on
    one group of the transitions' actors, into ``report``; the group is shut down after."""
    from actors.driver.group import ModelGroup

    workers = transitions[0][0].world_size
    group = ModelGroup.create(spec, transitions[0][0], name="bench", bucket_bytes=bucket_bytes, timeout_s=900)
    log_line("actors started")
    try:
        report["nodes"] = group.placement.num_nodes
        batch = max(1, min(cores, workers))  # synthetic_box needs ~3x a slot in temporaries
        t = time.perf_counter()
        group.init_synthetic(seed)
        log_line(f"synthetic weights written in {time.perf_counter() - t:.1f}s")
        layouts = Layouts(group, verify, seed, batch)
        layouts.record()

        # One warm-up round trip (forms the process group; verified) before the probes.
        src, dst = transitions[0]
        t = time.perf_counter()
        group.reallocate(dst)
        report["first_seconds_with_world_setup"] = time.perf_counter() - t
        ours_ok = layouts.check()
        group.reallocate(src)
        ours_ok &= layouts.check()
        group.run(warm_imports, writes=False)  # the baselines' imports (DCP: seconds per actor) are not their cost
        open_default_group(group)  # the baselines run on the trainer's own default group, as users' do
        report["transport"] = measure_transport(group, probe_bytes, cores)
        log_line(
            "transport: "
            + ", ".join(f"{k} {v:.3f}" for k, v in report["transport"].items() if k.endswith("gbps"))
            + " GB/s"
        )

        directions: list[dict] = []
        sampler = MemorySampler([info["pid"] for info in group.infos] if address is None else None)
        memory = MemoryGuard(sampler, memory_check and address is None, injected_faults())
        report["memory"] = memory.describe()
        rounds = Progress(
            log,
            f"bench: {len(transitions)} transitions, {repeats} timed round trips each",
            len(transitions) * repeats,
            "round trip",
        )
        try:
            with sampler, rounds:
                for i, (src, dst) in enumerate(transitions):
                    ours_ok &= _bench_transition(
                        group,
                        layouts,
                        i,
                        src,
                        dst,
                        repeats,
                        baseline_repeats,
                        baselines,
                        verify,
                        seed,
                        report["transport"],
                        cores,
                        directions,
                        memory,
                        traces,
                        rounds,
                    )
        except Exception as err:  # noqa: BLE001 - e.g. Ray's memory monitor killed an actor: keep what finished
            report["error"] = f"{type(err).__name__}: {err}"[:2000]
            layouts.failures.append(f"stopped after {len(directions)} directions: {report['error'][:200]}")
            log_line(f"stopped: {report['error'][:300]}")
            if not directions:
                raise
        report["directions"] = directions
        if resident and directions and "error" not in report:
            try:
                group.trim_memory()
                report["resident"], ok = _bench_resident(group, layouts, *transitions[0], repeats, directions[:2])
                ours_ok &= ok
            except Exception as err:  # noqa: BLE001 - the directions' figures stand without it
                report["resident_error"] = f"{type(err).__name__}: {err}"[:2000]
                layouts.failures.append(f"resident loop: {report['resident_error'][:200]}")
                log_line(f"resident loop failed: {report['resident_error'][:300]}")
                with contextlib.suppress(Exception):
                    group.release_resident()
                try:
                    recover_group(group, layouts, seed)
                except Exception as err2:  # noqa: BLE001
                    report["error"] = f"after the resident loop failed: {type(err2).__name__}: {err2}"[:2000]
        deferred = [n for n in baselines if n in DEFERRED_BASELINES]
        if deferred and directions and "error" not in report:
            try:
                with sampler:
                    ours_ok &= run_deferred(
                        group, layouts, transitions, directions, deferred, baseline_repeats, verify, seed, memory
                    )
            except Exception as err:  # noqa: BLE001 - keep what finished
                report["error"] = f"{type(err).__name__}: {err}"[:2000]
                layouts.failures.append(f"stopped in the deferred baselines: {report['error'][:200]}")
                log_line(f"stopped: {report['error'][:300]}")
        for d in directions:  # a deferred baseline the run never reached
            for n in deferred:
                if not any(n in d.get(k, {}) for k in ("baselines", "baselines_skipped", "baselines_failed")):
                    d.setdefault("baselines_skipped", {})[n] = "not run: the bench stopped before it"
        report["memory"]["peak_used_bytes"] = sampler.peak_used  # while baselines and ours' directions ran
        summarise(report, directions, ours_ok, layouts.failures)
    finally:
        group.shutdown()


#: Untimed round trips of ours before a transition's timed ones. The first moves of a new layout
#: pair free the buffers of the pair before (peers drop their mappings of them two operations
#: later, actors/worker/handles.py ``MAPPINGS_KEPT_OPS``): with one warm-up round trip the first timed
#: move still paid that (``dp=2,tp=2,pp=2 -> tp=2,pp=4`` on bench-1gb, 2026-11-24: prepare 136 ms
#: on the slowest worker, wall 156 ms for 57 ms of execute; 0 ms and 52 ms from the next move on).
#: An RL loop pays it once per pair, not per iteration.
WARM_UP_ROUND_TRIPS = 2


def _bench_transition(
    group,
    layouts: Layouts,
    index: int,
    src: Topology,
    dst: Topology,
    repeats: int,
    baseline_repeats: int,
    baselines: list[str],
    verify: str,
    seed: int,
    transport: dict,
    cores: int,
    out: list[dict],
    memory: MemoryGuard,
    traces: list | None = None,
    rounds: Progress | None = None,
) -> bool:
    """Both directions of ``src -> dst``: ours (``WARM_UP_ROUND_TRIPS`` untimed round trips, then
    ``repeats`` timed ones, each counted on ``rounds``), then every baseline ``baseline_repeats``
    times from ``src``, then from ``dst``. Each direction is appended to ``out`` when it is
    finished (a run stopped in the way back keeps the way there); returns whether ours verified.
    ``traces``: gets the trace of every timed move of ours (gathered after its timing)."""
    ok = True
    if group.topology != src:
        group.reallocate(src)
        ok &= layouts.check()
    for _ in range(WARM_UP_ROUND_TRIPS):  # this pair's plans, communicators and reused pages
        group.reallocate(dst)
        ok &= layouts.check()
        group.reallocate(src)
        ok &= layouts.check()
    plans = {"forward": group.plan_to(dst)}
    times: dict[str, list] = {"forward": [], "back": []}
    last: dict[str, Any] = {}
    for i in range(repeats):
        for way, target in (("forward", dst), ("back", src)):
            t = time.perf_counter()
            stats = group.reallocate(target)
            times[way].append((time.perf_counter() - t, stats.seconds))
            last[way] = stats
            if traces is not None:
                traces.append(group.last_trace())
            if i == repeats - 1:
                ok &= layouts.check()
        log_line(
            f"ours {src} <-> {dst} round trip {i + 1}/{repeats}: "
            f"{times['forward'][-1][0]:.3f}s there (execute {times['forward'][-1][1]:.3f}s), "
            f"{times['back'][-1][0]:.3f}s back (execute {times['back'][-1][1]:.3f}s)"
        )
        if rounds is not None:
            rounds.advance()
    for way, a, b in (("forward", src, dst), ("back", dst, src)):
        if way == "back":
            group.reallocate(dst)  # untimed: the baselines of the way back start from dst
            ok &= layouts.check()
            plans["back"] = group.plan_to(src)
        d = run_direction(
            group,
            layouts,
            index,
            way,
            a,
            b,
            times[way],
            last[way],
            plans[way],
            baselines,
            baseline_repeats,
            verify,
            seed,
            transport,
            cores,
            memory,
        )
        d["verified"]["ours"] = ok
        out.append(d)
        if "group_broken" in d:
            raise RuntimeError(f"a baseline failed and the group could not be restored: {d['group_broken']}")
    return ok


def _bench_resident(
    group, layouts: Layouts, src: Topology, dst: Topology, repeats: int, without: list[dict]
) -> tuple[dict, bool]:
    """The RL loop with kept layouts (``reallocate(..., keep=)``, actors/worker/kept.py): per
    iteration a 'training step' that counts as a change of the weights (it writes nothing, so the
    digests still verify), the move to ``dst``, the move back. ``in_place``: both layouts kept
    on the device, so the move there refreshes the kept ``dst`` buffers and the move back adopts
    ``src`` (nothing travels). ``host``: the trainer's layout offloaded during generation
    (``keep="host"`` there, nothing kept back), so the move back is one host-to-device copy.
    ``without``: the two directions of the same transition without ``keep``."""
    ok, out = True, {}  # (the digest checks are group.run(..., writes=False): they leave the version alone)
    for mode, back_keep, there_use in (("in_place", "in_place", "refreshed"), ("host", None, None)):
        if group.topology != src:
            group.reallocate(src)
        group.reallocate(dst, keep=mode)  # warm-up (and in place: both layouts kept from here on)
        group.reallocate(src, keep=back_keep)
        there, back = [], []
        for i in range(repeats):
            group.run(_training_step)  # a change of the weights as far as the driver knows
            t = time.perf_counter()
            s1 = group.reallocate(dst, keep=mode)
            there.append(time.perf_counter() - t)
            if i == repeats - 1:
                ok &= layouts.check()
            t = time.perf_counter()
            s2 = group.reallocate(src, keep=back_keep)
            back.append(time.perf_counter() - t)
            if i == repeats - 1:
                ok &= layouts.check()
        ok &= s1.resident_use == there_use and s2.resident_use == "adopted"
        kept = max(
            s1.resident_in_place_bytes_per_actor + s1.resident_host_bytes_per_actor,
            s2.resident_in_place_bytes_per_actor + s2.resident_host_bytes_per_actor,
        )
        out[mode] = {
            "there_median_seconds": statistics.median(there),
            "back_median_seconds": statistics.median(back),
            "round_trip_median_seconds": statistics.median(there) + statistics.median(back),
            "there_seconds": there,
            "back_seconds": back,
            "there": s1.as_dict(),
            "back": s2.as_dict(),
            "kept_bytes_per_actor": kept,
        }
        log_line(
            f"resident ({mode}) {src} <-> {dst}: there {out[mode]['there_median_seconds']:.3f}s, "
            f"back {out[mode]['back_median_seconds']:.3f}s (adopted); kept {kept / 1e6:.1f} MB per actor"
        )
        group.release_resident()
    out["without_keep_round_trip_median_seconds"] = sum(d["ours_seconds"] for d in without)
    return out, ok


def _training_step(ctx) -> None:
    """Stands for an optimizer step in the bench's resident loop (``group.run`` counts it as a
    change of the weights); it writes nothing, so the verified digests still hold."""
