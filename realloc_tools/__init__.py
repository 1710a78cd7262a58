"""Tools around the product: the ``realloc`` command line and its Ray-backed commands.

* ``realloc_tools.cli``: the ``realloc`` console script (the pure commands of
  ``realloc_tools.offline`` plus the commands below).
* ``realloc_tools.offline``: ``plan``, ``presets``, ``simulate`` and plan pictures; no Ray, no torch.
* ``realloc_tools.demos`` (``realloc demo``, ``realloc ckpt-demo``) and ``realloc_tools.bench``
  (``realloc bench``, ``bench-gpu``, ``bench-scale``): drive ``actors.ModelGroup`` on a real or
  simulated Ray cluster.
* ``realloc_tools.observe``: the Grafana dashboard, its Prometheus checks and screenshots.
* ``realloc_tools.cluster``: attach to a Ray cluster or simulate nodes on this machine for those commands.

The product is ``realloc`` (pure: specs, layouts, the planner) and ``actors`` (Ray); neither
imports this package.
"""
