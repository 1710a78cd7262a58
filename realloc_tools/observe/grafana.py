"""The Grafana dashboard of the reallocation metrics (:mod:`actors.metrics`), in Ray's own form.

One source of truth: the panels below. ``python -m realloc_tools.observe.grafana`` writes
``realloc_tools/observe/dashboards/realloc_grafana_dashboard.json`` (shipped as package data) the way Ray
builds its own dashboards: Ray's ``Panel``/``Target``/``Row`` classes and its panel factory
(``ray.dashboard.modules.metrics``), the ``${datasource}`` and ``SessionName`` variables and the
``{global_filters}`` placeholder (``RAY_GRAFANA_REALLOC_DASHBOARD_GLOBAL_FILTERS`` adds filters,
as for Ray's dashboards). ``--check`` fails when the shipped file differs from what the panels
give. How to load it: docs/observability.md.

Every query names Prometheus series as Ray exports them: ``ray_`` before the name, ``_total`` after a
counter's, ``_bucket``/``_count``/``_sum`` after a histogram's.

Example:
    >>> dashboard = build()
    >>> dashboard["uid"], len(panel_queries(dashboard)) > 10
    ('reallocDashboard', True)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from realloc.atomic_files import atomic_write

NAME = "REALLOC"  # Ray's key for env-var overrides: RAY_GRAFANA_REALLOC_DASHBOARD_UID / _GLOBAL_FILTERS
DEFAULT_UID = "reallocDashboard"
DASHBOARD_FILE = Path(__file__).with_name("dashboards") / "realloc_grafana_dashboard.json"
STANDARD_FILTERS = ['SessionName=~"$SessionName"', 'model=~"$Model"']
#: Dashboard variables the queries use, besides Grafana's ``${datasource}``.
VARIABLES = ("SessionName", "Model", "window")

_F = "{{{global_filters}}}"  # a label matcher: the session and model filters (and any global ones)


def _panels():
    """Ray's ``Row``s of ``Panel``s (imported here: ``ray.dashboard`` comes with ``ray[default]``)."""
    from ray.dashboard.modules.metrics.dashboards.common import Panel, Row, Target

    def target(expr: str, legend: str) -> Target:
        return Target(expr=expr, legend=legend)

    def mean(total: str, histogram: str, by: str, window: bool) -> str:
        """Mean of a histogram's observations, over ``$window`` or since the session started: the
        exact counter ``total`` over the histogram's count (Ray's ``_sum`` is a bucket-midpoint
        estimate, actors/metrics.py)."""
        if window:
            return f"sum by ({by}) (rate({total}{_F}[$window])) / sum by ({by}) (rate({histogram}_count{_F}[$window]))"
        return f"sum by ({by}) ({total}{_F}) / sum by ({by}) ({histogram}_count{_F})"

    def quantile(q: float, metric: str, by: str) -> str:
        return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{_F}[$window])))"

    def graph(id: int, title: str, unit: str, description: str, *targets: Target, stack: bool = False) -> Panel:
        """A graph panel: lines, or stacked areas (Ray's default look) with ``stack``."""
        lines = {} if stack else {"fill": 0, "stack": False}
        return Panel(id=id, title=title, description=description, unit=unit, targets=list(targets), **lines)

    execute_mean = mean("ray_realloc_execute_seconds_total", "ray_realloc_seconds", "phase", True)
    moves = [
        graph(
            1,
            "Bytes received per second, by link kind",
            "Bps",
            "Bytes the workers received per second over the last $window, by link kind: local (a copy inside a worker), intra (from another worker on the same node), inter (from another node). Counted when each worker's execute phase ends; a kind's first bytes of a session count from its second move on (rate() starts a series at its first sample): the totals panel has them all.",
            target(f"sum by (kind) (rate(ray_realloc_bytes_total{_F}[$window]))", "{{kind}}"),
            stack=True,
        ),
        graph(
            2,
            "Bytes received, by link kind (total)",
            "bytes",
            "Bytes the workers received since the Ray session started, by link kind; equals the sum of the moves' ReallocStats bytes_local / bytes_intra_node / bytes_inter_node.",
            target(f"sum by (kind) (ray_realloc_bytes_total{_F})", "{{kind}}"),
        ),
        graph(
            3,
            "Worker execute seconds, by phase",
            "s",
            "Seconds a worker spent executing, by phase (0 and 1: blended copies, fills and loads run phase by phase; all: the one-call path of reallocate/copy_to): p50 and p99 over the last $window, and the mean.",
            target(quantile(0.5, "ray_realloc_seconds", "phase"), "p50 phase {{phase}}"),
            target(quantile(0.99, "ray_realloc_seconds", "phase"), "p99 phase {{phase}}"),
            target(execute_mean, "mean phase {{phase}}"),
        ),
        graph(
            4,
            "Worker execute phases run, by phase (total)",
            "short",
            "Execute phases the workers ran since the Ray session started (each worker counts its own), by phase, and the seconds they took in all.",
            target(f"sum by (phase) (ray_realloc_seconds_count{_F})", "phases {{phase}}"),
            target(f"sum by (phase) (ray_realloc_execute_seconds_total{_F})", "seconds {{phase}}"),
        ),
        graph(
            5,
            "Bandwidth per worker",
            "GBs",
            "Bytes a worker received per second over its last operation that received anything (all phases together), in GB/s.",
            target(f"max by (model, rank) (ray_realloc_bandwidth_gbps{_F})", "{{model}} rank {{rank}}"),
        ),
        graph(
            6,
            "Operations in flight",
            "short",
            "Execute phases running now, per model group (a worker that hangs keeps its count above 0).",
            target(f"sum by (model) (ray_realloc_in_flight{_F})", "{{model}}"),
            stack=True,
        ),
    ]
    updates = [
        graph(
            7,
            "Pause per update",
            "s",
            "Wall seconds the caller (an RL loop) was blocked in one reallocate / copy_to (planning included), or waited for a staged update's switch (commit_staged): the mean and p90 over the last $window.",
            target(
                mean("ray_realloc_paused_seconds_total", "ray_realloc_pause_seconds", "model, op", True),
                "mean {{model}} {{op}}",
            ),
            target(quantile(0.9, "ray_realloc_pause_seconds", "model, op"), "p90 {{model}} {{op}}"),
        ),
        graph(
            8,
            "Updates and their pauses (total)",
            "short",
            "Updates since the Ray session started (one per reallocate / copy_to / staged commit) and the seconds callers were paused by them in all.",
            target(f"sum by (model, op) (ray_realloc_pause_seconds_count{_F})", "updates {{model}} {{op}}"),
            target(f"sum by (model, op) (ray_realloc_paused_seconds_total{_F})", "paused seconds {{model}} {{op}}"),
        ),
        graph(
            9,
            "Weight version",
            "short",
            "The weight version each model group holds (a staged update's source version once it is committed).",
            target(f"max by (model) (ray_realloc_weight_version{_F})", "{{model}}"),
        ),
    ]
    checkpoint_total = "ray_realloc_checkpoint_wall_seconds_total"
    checkpoints = [
        graph(
            10,
            "Checkpoint operations (total)",
            "short",
            "Checkpoint operations that succeeded since the Ray session started, by op: save, restore and reshard (the two ways of a load), import_hf, export_hf.",
            target(f"sum by (model, op) (ray_realloc_checkpoint_seconds_count{_F})", "{{model}} {{op}}"),
        ),
        graph(
            11,
            "Checkpoint seconds per operation",
            "s",
            "Wall seconds of one checkpoint operation on the driver (a save: its writes, replication and removal of older iterations), the mean since the session started and over the last $window.",
            target(
                mean(checkpoint_total, "ray_realloc_checkpoint_seconds", "model, op", False), "mean {{model}} {{op}}"
            ),
            target(
                mean(checkpoint_total, "ray_realloc_checkpoint_seconds", "model, op", True),
                "mean over $window {{model}} {{op}}",
            ),
        ),
        graph(
            12,
            "Checkpoint bytes, by op and kind (total)",
            "bytes",
            "Bytes of the checkpoint operations since the session started: disk (written by a save or an export, read by a load or an import), local / intra / inter (moved by a save's replication or a load's or an export's exchange).",
            target(f"sum by (op, kind) (ray_realloc_checkpoint_bytes_total{_F})", "{{op}} {{kind}}"),
        ),
    ]
    return [
        Row(title="Moves", id=100, panels=moves),
        Row(title="Updates", id=101, panels=updates),
        Row(title="Checkpoints", id=102, panels=checkpoints),
    ]


def _variable(name: str, description: str, selector: str, label: str, **extra) -> dict:
    """A query variable: the values of ``label`` on the series ``selector`` matches (a format
    string: ``{global_filters}`` is filled in as in the panels)."""
    query = f"label_values({selector}, {label})"
    return {
        "name": name,
        "type": "query",
        "description": description,
        "datasource": "${datasource}",
        "definition": query,
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 2,
        "hide": 0,
        "includeAll": True,
        "multi": True,
        "allValue": ".+",
        "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        **extra,
    }


def _base() -> dict:
    """The dashboard around the panels, as Ray's ``*_grafana_dashboard_base.json`` files have it."""
    return {
        "title": "Reallocation Dashboard",
        "uid": DEFAULT_UID,
        "version": 1,
        "schemaVersion": 27,
        "style": "dark",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "panels": [],
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": "-- Grafana --",
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "description": "Filter queries of a specific Prometheus type.",
                    "datasource": None,
                    "query": "prometheus",
                    "refresh": 1,
                    "hide": 2,
                    "includeAll": False,
                    "multi": False,
                    "current": {"selected": False},
                },
                # Ray's own dashboards list sessions from a metric every node exports.
                _variable(
                    "SessionName",
                    "Filter queries to specific Ray sessions.",
                    "ray_node_network_receive_speed{{{global_filters}}}",
                    "SessionName",
                    multi=False,
                    allValue=".*",
                    sort=2,
                ),
                _variable(
                    "Model",
                    "Filter queries to specific model groups (ModelGroup names; a copy_to's pause is tagged source->destination).",
                    '{{__name__=~"ray_realloc_.+",SessionName=~"$SessionName",{global_filters}}}',
                    "model",
                ),
                {
                    "name": "window",
                    "label": "Window",
                    "type": "interval",
                    "description": "Averaging window for rate() and quantile calculations (moves come in bursts: a window longer than the time between updates shows each one).",
                    "query": "1m,5m,15m,1h",
                    "options": [{"selected": v == "5m", "text": v, "value": v} for v in ("1m", "5m", "15m", "1h")],
                    "current": {"selected": True, "text": "5m", "value": "5m"},
                    "auto": False,
                    "auto_count": 30,
                    "auto_min": "10s",
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
    }


def build() -> dict:
    """The dashboard as a dict, made the way Ray makes its own (panel factory, filters, uid)."""
    import ray
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory
    from ray.dashboard.modules.metrics.dashboards.common import DashboardConfig

    config = DashboardConfig(
        name=NAME,
        default_uid=DEFAULT_UID,
        standard_global_filters=STANDARD_FILTERS,
        base_json_file_name="",  # the base is _base(); Ray's factory reads only its own files
        rows=_panels(),
    )
    uid, global_filters, log_link_url = factory._read_configs_for_dashboard(config)
    dashboard = _base()
    dashboard["panels"] = factory._generate_grafana_panels(config, global_filters, log_link_url)
    filters = ",".join(global_filters)
    for variable in dashboard["templating"]["list"]:
        if "definition" in variable:
            for key, text in (("definition", variable["definition"]), ("query", variable["query"]["query"])):
                text = text.format(global_filters=filters)
                text = factory._clean_empty_filters(text) if not filters else text
                if key == "definition":
                    variable["definition"] = text
                else:
                    variable["query"]["query"] = text
    dashboard["uid"] = uid
    dashboard["tags"] = ["realloc", f"rayVersion:{ray.__version__}"]
    dashboard["rayMeta"] = ["supportsGlobalFilterOverride"]
    return dashboard


def shipped() -> dict:
    """The dashboard as shipped (the JSON file, what users load)."""
    return json.loads(DASHBOARD_FILE.read_text())


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` of every target of every panel, rows' collapsed panels included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    return found


def metric_names(expr: str) -> set[str]:
    """The Prometheus series names a query reads (``ray_...`` identifiers not followed by ``(``)."""
    return set(re.findall(r"\b(ray_[A-Za-z0-9_]+)\b(?!\s*\()", expr))


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with the dashboard's variables (``$name`` / ``${name}``) replaced; ``ValueError``
    naming any variable left (Prometheus would reject it)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    left = re.findall(r"\$\{?\w+", expr)
    if left:
        raise ValueError(f"variables {left} of {expr!r} have no value (given: {sorted(values)})")
    return expr


def bytes_by_kind(*moves) -> dict[str, float]:
    """What the panel "Bytes received, by link kind (total)" shows after ``moves`` (``ReallocStats``)
    and nothing else in the session: bytes by ``kind`` label, kinds that moved nothing left out."""
    total: dict[str, float] = {}
    for m in moves:
        for kind, n in (("local", m.bytes_local), ("intra", m.bytes_intra_node), ("inter", m.bytes_inter_node)):
            if n:
                total[kind] = total.get(kind, 0.0) + n
    return total


def render(dashboard: dict | None = None) -> str:
    """The dashboard's JSON text as shipped (``dashboard``: :func:`build`'s, built if not given)."""
    return json.dumps(build() if dashboard is None else dashboard, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m realloc_tools.observe.grafana", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=DASHBOARD_FILE, help="where to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="fail when --out differs from the panels' dashboard")
    args = parser.parse_args(argv)
    dashboard = build()
    text = render(dashboard)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(
                f"{args.out} is not what the panels give: run python -m realloc_tools.observe.grafana", file=sys.stderr
            )
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, text.encode())
    print(f"wrote {args.out} ({len(panel_queries(dashboard))} queries, uid {dashboard['uid']})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.exit(main())
