"""Screenshots for docs/observability.md, taken with headless Chromium on a local Ray head.

``python -m realloc_tools.observe.screenshots [--out docs/img]`` starts a Ray head with the dashboard
(token auth off for this local head: ``RAY_AUTH_MODE=disabled``, so the page needs no token) and a
Prometheus server scraping it (:mod:`realloc_tools.observe.prometheus`), creates a model group of four
named workers (``realloc:policy:rank<r>``), moves it there and back and saves a checkpoint, and
writes:

* ``ray_dashboard_actors.png``: the Ray dashboard's actors page (``/#/actors``) with the workers;
* ``prometheus_bytes_by_kind.png``: Prometheus's graph page showing the dashboard panel
  "Bytes received, by link kind (total)" after the moves, its variables filled in.

Before each screenshot it checks, through the dashboard's state API and Prometheus's query API,
that what the picture must show is there (the four actor names, the moves' bytes by kind), and
fails naming what is missing. Needs ``chromium`` (or ``chromium-browser`` / ``google-chrome``)
and ``prometheus`` on PATH (.ci/services.py installs both on Debian).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from realloc_tools.observe import grafana
from realloc_tools.observe.prometheus import Prometheus, free_port, ray_targets

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
GROUP = "policy"
BYTES_PANEL = "Bytes received, by link kind (total)"
STEP_S = 10.0


def browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    raise FileNotFoundError(f"none of {BROWSERS} on PATH (Debian: apt-get install chromium)")


def screenshot(url: str, out: Path, size: str = "1600,1000", wait_ms: int = 15000) -> Path:
    """``url`` rendered by headless Chromium into the PNG ``out`` (a fresh profile; ``wait_ms`` of
    virtual time for the page's scripts to load their data)."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        command = [
            browser(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={out}",
            url,
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if done.returncode != 0 or not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(f"chromium made no screenshot of {url} (exit {done.returncode}): {done.stderr[-1500:]}")
    return out


def wait_http(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s} s")
        time.sleep(1)


def wait_for_actors(dashboard: str, names: set[str], timeout_s: float = 60) -> None:
    """Until the dashboard's state API lists every actor of ``names`` alive."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout_s
    while True:
        alive = {a.name for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], limit=1000)}
        if names <= alive:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the dashboard at {dashboard} does not list {sorted(names - alive)} (alive: {alive})")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m realloc_tools.observe.screenshots", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="folder of the PNGs (default: %(default)s)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # A local head for the pictures only: no token to type into the page; metrics reported each second.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    from actors import ModelGroup
    from actors.driver.checkpoint import CheckpointManager
    from realloc import ModelSpec, Topology

    port = free_port()
    dashboard = f"http://127.0.0.1:{port}"
    ray.init(
        num_cpus=4,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=port,
        _metrics_export_port=free_port(),
        log_to_driver=False,
    )
    work = Path(tempfile.mkdtemp(prefix="realloc-shots-"))
    try:
        session = ray._private.worker.global_worker.node.session_name
        wait_http(f"{dashboard}/api/version")
        src, dst = Topology(dp=2, tp=2), Topology(tp=2, pp=2)
        group = ModelGroup.create(ModelSpec.preset("tiny"), src, name=GROUP, timeout_s=120)
        try:
            with Prometheus(ray_targets(), work / "prom") as prom:
                group.init_synthetic(0)
                started = time.monotonic()
                moves = [group.reallocate(dst)]
                time.sleep(STEP_S)  # the graph shows each move as a step
                moves.append(group.reallocate(src))
                CheckpointManager(group, root=work / "ckpt", run_id="shots", factor=1).save(1).wait()

                names = {f"realloc:{GROUP}:rank{r}" for r in range(src.world_size)}
                wait_for_actors(dashboard, names)
                shot = screenshot(f"{dashboard}/#/actors", args.out / "ray_dashboard_actors.png")
                print(f"wrote {shot} (actors {sorted(names)})")

                (expr,) = [q for t, q in grafana.panel_queries(grafana.shipped()) if t == BYTES_PANEL]
                expr = grafana.substitute(expr, {"SessionName": session, "Model": GROUP, "window": "5m"})
                expected = grafana.bytes_by_kind(*moves)
                prom.wait_for(
                    expr,
                    lambda r: {lab["kind"]: v for lab, v in r} == expected,
                    f"panel {BYTES_PANEL!r}: the moves' bytes {expected}",
                )
                time.sleep(max(0.0, started + 3 * STEP_S - time.monotonic()))  # a flat stretch after the last step
                # the panel's query twice: as a graph (g0) and as a table of its values now (g1)
                query = urllib.parse.urlencode(
                    {
                        "g0.expr": expr,
                        "g0.tab": "0",
                        "g0.range_input": f"{int(4 * STEP_S)}s",
                        "g0.stacked": "0",
                        "g1.expr": expr,
                        "g1.tab": "1",
                    }
                )
                shot = screenshot(
                    f"{prom.url}/graph?{query}", args.out / "prometheus_bytes_by_kind.png", size="1600,1250"
                )
                print(f"wrote {shot} ({BYTES_PANEL}: {expected})")
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
