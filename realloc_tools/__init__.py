"""Tools around the product: the ``realloc`` command line and its Ray-backed commands.

* ``realloc_tools.cli``: the ``realloc`` console script (the pure ``plan`` and ``presets`` of
  ``realloc_tools.plan_cli`` plus the commands below).
* ``realloc_tools.demo`` (``realloc demo``), ``realloc_tools.bench`` (``realloc bench``) and ``realloc_tools.ckpt_demo``
  (``realloc ckpt-demo``): drive ``actors.ModelGroup`` on a real or simulated Ray cluster.
* ``realloc_tools.cluster``: attach to a Ray cluster or simulate nodes on this machine for those commands.

The product is ``realloc`` (pure: specs, layouts, the planner) and ``actors`` (Ray); neither
imports this package.
"""
