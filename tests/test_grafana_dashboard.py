"""The shipped Grafana dashboard (realloc_tools/observe/dashboards): what the panels in
realloc_tools/observe/grafana.py give, and every query names only series the project exports.

Checked against the instruments themselves (parsed from actors/metrics.py), not a list kept here;
the live check (a real Prometheus scraping a move) is tests/test_grafana_prometheus_ray.py.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from realloc_tools.observe import grafana

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_count", "_sum")}


def instruments() -> dict[str, str]:
    """``{name: Counter|Gauge|Histogram}`` of every instrument actors/metrics.py makes: each
    ``ray_metrics.X("name", ...)`` with a literal name, and each ``_Seconds("histogram", "counter", ...)``."""
    tree = ast.parse((ROOT / "actors" / "metrics.py").read_text())
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, [a.value for a in node.args if isinstance(a, ast.Constant)]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "ray_metrics":
            if isinstance(node.args[0], ast.Constant):
                found[args[0]] = func.attr
        elif isinstance(func, ast.Name) and func.id == "_Seconds":
            found[args[0]], found[args[1]] = "Histogram", "Counter"
    return found


def exported_series() -> dict[str, str]:
    """Every Prometheus series name Ray exports for the instruments, mapped to the instrument."""
    return {f"ray_{name}{s}": name for name, kind in instruments().items() for s in SUFFIXES[kind]}


def shipped() -> dict:
    return grafana.shipped()


FACTORY = pytest.importorskip("ray.dashboard.modules.metrics.grafana_dashboard_factory")
needs_factory = pytest.mark.skipif(
    not all(hasattr(FACTORY, f) for f in ("_read_configs_for_dashboard", "_generate_grafana_panels")),
    reason="this Ray's Grafana dashboard factory has not the functions realloc_tools/observe/grafana.py builds with",
)


def test_the_instruments_are_found():
    # the parser above finds what metrics.py declares (a parser that found nothing would pass the rest)
    assert instruments() == {
        "realloc_bytes": "Counter",
        "realloc_seconds": "Histogram",
        "realloc_bandwidth_gbps": "Gauge",
        "realloc_in_flight": "Gauge",
        "realloc_pause_seconds": "Histogram",
        "realloc_weight_version": "Gauge",
        "realloc_checkpoint_seconds": "Histogram",
        "realloc_checkpoint_bytes": "Counter",
        "realloc_execute_seconds": "Counter",
        "realloc_paused_seconds": "Counter",
        "realloc_checkpoint_wall_seconds": "Counter",
    }


@needs_factory
def test_shipped_file_is_what_the_panels_give():
    built, file = grafana.build(), shipped()

    def essentials(d):  # what the panels define, not the Ray version's panel templates or tag
        return (
            d["uid"],
            d["title"],
            [(p["type"], p["title"], p.get("gridPos")) for p in d["panels"]],
            [(t, q) for t, q in grafana.panel_queries(d)],
            [(p["title"], t["legendFormat"]) for p in d["panels"] for t in p.get("targets", [])],
            d["templating"]["list"],
        )

    assert essentials(file) == essentials(built), "run: python -m realloc_tools.observe.grafana"


def test_every_query_reads_only_exported_series_and_every_instrument_has_a_panel():
    series = exported_series()
    used = set()
    for title, expr in grafana.panel_queries(shipped()):
        names = grafana.metric_names(expr)
        assert names, f"panel {title!r}: no ray_ series in {expr!r}"
        unknown = names - set(series)
        assert not unknown, f"panel {title!r} reads {sorted(unknown)}, which the project does not export"
        used |= {series[n] for n in names}
    assert used == set(instruments()), f"instruments without a panel: {sorted(set(instruments()) - used)}"


def test_queries_filter_by_ray_session_and_model_and_use_only_dashboard_variables():
    d = shipped()
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", *grafana.VARIABLES} <= names
    assert all(p["datasource"] == "${datasource}" for p in d["panels"] if p["type"] != "row")
    for title, expr in grafana.panel_queries(d):
        for selector in re.findall(r"ray_realloc_\w+\{([^}]*)\}", expr):
            assert 'SessionName=~"$SessionName"' in selector and 'model=~"$Model"' in selector, (title, expr)
        grafana.substitute(expr, {"SessionName": "s", "Model": "m", "window": "5m"})  # ValueError if one is left


def test_substitute_names_a_variable_without_value():
    with pytest.raises(ValueError, match=r"\$Other"):
        grafana.substitute('x{a=~"$Model", b="$Other"}', {"Model": "m"})
    assert grafana.substitute('rate(x{a=~"${Model}"}[$window])', {"Model": "m", "window": "1m"}) == (
        'rate(x{a=~"m"}[1m])'
    )


@needs_factory
def test_check_mode_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "d.json"
    stale.write_text(grafana.render().replace("Bytes received", "Bytes"))
    assert grafana.main(["--out", str(stale), "--check"]) == 1
    assert grafana.main(["--out", str(stale)]) == 0
    assert grafana.main(["--out", str(stale), "--check"]) == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each query (as a recording rule), variables filled in as Grafana would."""
    values = {"SessionName": "session_x", "Model": ".+", "window": "5m"}
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"panel_{i}", "expr": grafana.substitute(expr, values)}
                    for i, (_, expr) in enumerate(grafana.panel_queries(shipped()))
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules['groups'][0]['rules'])} rules found" in done.stdout, done.stdout


def test_the_dashboard_ships_as_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]["realloc_tools"]
    relative = grafana.DASHBOARD_FILE.relative_to(ROOT / "realloc_tools").as_posix()
    assert any(Path(relative).match(pattern) for pattern in data), (data, relative)
