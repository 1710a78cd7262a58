"""A local Prometheus server scraping a Ray cluster's metrics export ports, for checks and screenshots.

Starts the ``prometheus`` binary (Debian's ``prometheus`` package, or any 2.x on ``PATH``) with a
generated config, its data in a directory of the caller's, on a free local port; queries it through
the HTTP API (``/api/v1/query``). Used by tests/test_grafana_prometheus_ray.py and
:mod:`realloc_tools.observe.screenshots`.

Example:
    >>> targets = ray_targets()                                   # doctest: +SKIP
    >>> with Prometheus(targets, "/tmp/prom-data") as prom:       # doctest: +SKIP
    ...     prom.query('sum by (kind) (ray_realloc_bytes_total)')
    [({'kind': 'intra'}, 415680.0), ...]
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_targets() -> list[str]:
    """``host:port`` to scrape for the connected Ray cluster: the targets of Ray's service discovery
    file (``<session dir>/prom_metrics_service_discovery.json``, which the dashboard head writes and
    Ray's own prometheus.yml reads), else every live node's metrics export port."""
    import ray

    node = ray._private.worker.global_worker.node
    discovery = Path(node.get_session_dir_path()) / "prom_metrics_service_discovery.json"
    if discovery.exists():
        found = sorted({t for group in json.loads(discovery.read_text()) for t in group["targets"]})
        if found:
            return found
    return sorted(
        f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}"
        for n in ray.nodes()
        if n["Alive"] and n["MetricsExportPort"]
    )


class Prometheus:
    """``prometheus`` scraping ``targets`` every ``scrape_interval``; a context manager that
    stops the server (and only it) on exit."""

    def __init__(
        self,
        targets: list[str],
        data_dir: "str | Path",
        port: int | None = None,
        scrape_interval: str = "1s",
        binary: str | None = None,
    ):
        self.binary = binary or shutil.which("prometheus")
        if self.binary is None:
            raise FileNotFoundError("no prometheus binary on PATH (Debian: apt-get install prometheus)")
        if not targets:
            raise ValueError("no scrape targets: is Ray running with metrics export ports?")
        self.targets, self.data_dir = list(targets), Path(data_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scrape_interval = scrape_interval
        self.proc: subprocess.Popen | None = None

    def config(self) -> dict:
        return {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": self.targets}]}],
        }

    def start(self, timeout_s: float = 60) -> "Prometheus":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=2))  # JSON is YAML
        self._log = open(self.data_dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus at {self.url} not ready after {timeout_s} s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        path = self.data_dir / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> dict:
        """``GET /api/v1/<path>``; ``RuntimeError`` with Prometheus's own error text when it fails."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict, float]]:
        """An instant query now: ``[(labels, value)]`` (a scalar result as one unlabelled sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def wait_for(
        self, expr: str, ok: Callable[[list[tuple[dict, float]]], bool], what: str, timeout_s: float = 60
    ) -> list[tuple[dict, float]]:
        """Poll ``expr`` until ``ok(result)``; ``TimeoutError`` naming ``what`` and the last result."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if ok(result):
                return result
            if time.monotonic() > deadline:
                targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.api("targets")["activeTargets"]]
                raise TimeoutError(
                    f"{what}: after {timeout_s} s Prometheus answers {result} to {expr!r} (targets: {targets})"
                )
            time.sleep(0.5)
