"""The Grafana dashboard's queries against a real Prometheus scraping a Ray cluster during moves
and a checkpoint save (issue 27, item 1).

Two simulated nodes; Debian's ``prometheus`` scrapes every node's metrics export port each
second. Two moves (there, and back once Prometheus holds the first, so rates see an increase) and
a checkpoint save; then every panel query of the shipped dashboard, its variables filled in as
Grafana does, runs through ``/api/v1/query`` and must answer; the totals must be the moves' and the
save's own numbers (ReallocStats, SaveStats, the group's version).
"""

from __future__ import annotations

import math
import shutil
import time

import pytest

ray = pytest.importorskip("ray")

from simulated import simulated_cluster

from realloc import ModelSpec, Topology
from realloc_tools.observe import grafana
from realloc_tools.observe.prometheus import Prometheus, ray_targets

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="the prometheus binary is not installed (Debian: apt-get install prometheus; .ci/services.py does it)",
    ),
]

MODEL = "watched-dash"
SPAN_S = 20.0
SRC, DST = Topology(dp=2, tp=2), Topology(tp=2, pp=2)


def by(result, label: str) -> dict[str, float]:
    return {labels.get(label, ""): value for labels, value in result}


def panel(dashboard: dict, title: str) -> list[str]:
    queries = [q for t, q in grafana.panel_queries(dashboard) if t == title]
    assert queries, f"no panel {title!r} in the dashboard"
    return queries


def wait_for_totals(prom: Prometheus, q, dashboard: dict, moves: list, workers: int) -> None:
    """Until Prometheus holds ``moves``' totals: bytes by kind, execute phases, pauses."""
    (total_bytes,) = panel(dashboard, "Bytes received, by link kind (total)")
    prom.wait_for(
        q(total_bytes), lambda r: by(r, "kind") == grafana.bytes_by_kind(*moves), f"bytes by kind of {len(moves)} moves"
    )
    phases, _ = panel(dashboard, "Worker execute phases run, by phase (total)")
    n = float(workers * len(moves))  # one call a worker a move (phase "all")
    prom.wait_for(q(phases), lambda r: by(r, "phase") == {"all": n}, f"execute phases of {len(moves)} moves")
    updates, _ = panel(dashboard, "Updates and their pauses (total)")
    n = float(len(moves))
    prom.wait_for(q(updates), lambda r: by(r, "op") == {"reallocate": n}, f"one pause per move ({len(moves)})")


def saved_bytes(saves) -> dict[tuple[str, str], float]:
    """``(op, kind) -> bytes`` of ``saves`` as the checkpoint bytes counter has them."""
    total: dict[tuple[str, str], float] = {}
    for saved in saves:
        for kind, n in (
            ("disk", saved.bytes_written),
            ("intra", saved.bytes_replicated_intra_node),
            ("inter", saved.bytes_replicated_inter_node),
        ):
            if n:
                total["save", kind] = total.get(("save", kind), 0.0) + n
    return total


def test_dashboard_queries_return_the_moves_numbers(tmp_path, monkeypatch):
    from actors import ModelGroup
    from actors.driver.checkpoint import CheckpointManager

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")  # before the cluster's processes start
    dashboard = grafana.shipped()
    with simulated_cluster(nodes=2, cpus_per_node=2):
        session = ray._private.worker.global_worker.node.session_name
        values = {"SessionName": session, "Model": MODEL, "window": "5m"}

        def q(expr: str) -> str:
            return grafana.substitute(expr, values)

        def answer(expr: str) -> list[tuple[dict, float]]:
            # Prometheus scrapes every second with a 1 s timeout: a scrape that misses it on this
            # loaded machine marks the target's series stale until the next one, so a series the
            # test saw a moment ago can answer nothing for a second. Wait for the next scrape.
            return prom.wait_for(q(expr), bool, f"data for {expr!r}", timeout_s=30)

        group = ModelGroup.create(ModelSpec.preset("tiny"), SRC, name=MODEL, timeout_s=60)
        try:  # the workers live until the end: a dead worker's gauges leave Ray's export
            with Prometheus(ray_targets(), tmp_path / "prom") as prom:
                group.init_synthetic(0)
                moves = [group.reallocate(DST)]
                # Prometheus holds the first move's totals before the second: rates then see an increase
                wait_for_totals(prom, q, dashboard, moves, SRC.world_size)
                moves.append(group.reallocate(SRC))
                manager = CheckpointManager(group, root=tmp_path / "ckpt", run_id="dash", factor=2)
                saves = [manager.save(1).wait()]
                # the same for the saves: the second after Prometheus holds the first
                (ckpt_ops,) = panel(dashboard, "Checkpoint operations (total)")
                prom.wait_for(q(ckpt_ops), lambda r: by(r, "op") == {"save": 1.0}, "the first checkpoint save")
                ckpt_mean, ckpt_window_mean = panel(dashboard, "Checkpoint seconds per operation")
                prom.wait_for(q(ckpt_mean), lambda r: len(r) == 1, "the first save's seconds")
                baselines = time.monotonic()  # every series the windowed panels read has its first sample
                saves.append(manager.save(2).wait())

                # the totals, exact: what Ray exported against the driver's and the workers' own numbers
                wait_for_totals(prom, q, dashboard, moves, SRC.world_size)
                pauses = [m.pause_seconds for m in moves]
                _, paused = panel(dashboard, "Updates and their pauses (total)")
                got = by(answer(paused), "op")
                assert math.isclose(got["reallocate"], sum(pauses), rel_tol=1e-9), (got, pauses)
                (versions,) = panel(dashboard, "Weight version")
                version = float(group.version)
                prom.wait_for(q(versions), lambda r: by(r, "model") == {MODEL: version}, "the weight version")
                prom.wait_for(q(ckpt_ops), lambda r: by(r, "op") == {"save": 2.0}, "two checkpoint saves")
                (ckpt_bytes,) = panel(dashboard, "Checkpoint bytes, by op and kind (total)")
                got = {(labels["op"], labels["kind"]): v for labels, v in answer(ckpt_bytes)}
                assert got == saved_bytes(saves), (got, saves)
                save_seconds = [saved.total_seconds for saved in saves]
                got = by(answer(ckpt_mean), "op")
                assert math.isclose(got["save"], sum(save_seconds) / 2, rel_tol=1e-9), (got, save_seconds)
                (in_flight,) = panel(dashboard, "Operations in flight")
                prom.wait_for(q(in_flight), lambda r: by(r, "model") == {MODEL: 0.0}, "no phase in flight now")
                (bandwidth,) = panel(dashboard, "Bandwidth per worker")
                got = prom.wait_for(q(bandwidth), lambda r: any(v > 0 for _, v in r), "a worker's bandwidth")
                assert all(v > 0 for _, v in got) and {lab["rank"] for lab, _ in got} <= {"0", "1", "2", "3"}, got

                # over the window: the second move came after Prometheus had the first, so rates see its
                # increase of every series the first move had created (rate() takes a series' first
                # sample as its start: bytes of a kind the first move did not move count from the
                # second move on, docs/observability.md; the totals above have them all)
                (rate,) = panel(dashboard, "Bytes received per second, by link kind")
                got = by(answer(rate), "kind")
                first, second = grafana.bytes_by_kind(moves[0]), grafana.bytes_by_kind(moves[1])
                seen_twice = set(first) & set(second)
                assert seen_twice, (first, second)  # else this check checks nothing
                assert {k for k, v in got.items() if v > 0} == seen_twice, (got, first, second)
                for expr in panel(dashboard, "Worker execute seconds, by phase"):
                    got = by(answer(expr), "phase")
                    assert set(got) == {"all"} and 0 < got["all"] <= 120, (expr, got)
                # Windowed means: the exact counter over the histogram's count, each a rate() that
                # Prometheus extrapolates over the samples the series has in the window; two series
                # first scraped one scrape apart differ by (scrape interval / their span): 25% after
                # 4 s (measured), under 5% after SPAN_S. So they are read that long after the
                # baselines, and must be the second move's pause and the second save's seconds.
                time.sleep(max(0.0, baselines + SPAN_S - time.monotonic()))
                mean_pause, p90_pause = panel(dashboard, "Pause per update")
                got = by(answer(mean_pause), "op")["reallocate"]
                assert math.isclose(got, pauses[1], rel_tol=0.15), (got, pauses)
                assert 0 < by(answer(p90_pause), "op")["reallocate"] <= 120
                got = by(answer(ckpt_window_mean), "op")["save"]
                assert math.isclose(got, save_seconds[1], rel_tol=0.15), (got, save_seconds)

                # every query of every panel answers, with data, and names only series Prometheus holds
                held = set(prom.api("label/__name__/values"))
                for title, expr in grafana.panel_queries(dashboard):
                    missing = grafana.metric_names(expr) - held
                    assert not missing, f"panel {title!r} reads {sorted(missing)}: not in the scrape"
                    assert answer(expr), f"panel {title!r}: no data for {q(expr)!r}"
                # and the Model variable's query finds this group in this session
                match = f'{{__name__=~"ray_realloc_.+",SessionName="{session}"}}'
                assert MODEL in prom.api("label/model/values", **{"match[]": match})
        finally:
            group.shutdown()
