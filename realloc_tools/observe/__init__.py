"""Watching a run: the Grafana dashboard generator (:mod:`.grafana`, ``python -m
realloc_tools.observe.grafana``; the dashboard ships in ``dashboards/`` as package data), the
Prometheus checks of its queries (:mod:`.prometheus`) and the dashboard screenshots
(:mod:`.screenshots`, ``python -m realloc_tools.observe.screenshots``)."""
