"""Tools around the product: the ``realloc`` command line and its Ray-backed commands.

* ``tools.cli``: the ``realloc`` console script (the pure ``plan`` and ``presets`` of
  ``realloc.cli`` plus the commands below).
* ``tools.demo`` (``realloc demo``), ``tools.bench`` (``realloc bench``) and ``tools.ckpt_demo``
  (``realloc ckpt-demo``): drive ``actors.ModelGroup`` on a real or simulated Ray cluster.
* ``tools.cluster``: attach to a Ray cluster or simulate nodes on this machine for those commands.

The product is ``realloc`` (pure: specs, layouts, the planner) and ``actors`` (Ray); neither
imports this package.
"""
