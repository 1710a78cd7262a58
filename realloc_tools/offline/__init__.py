"""The commands that need neither Ray nor torch: ``realloc plan`` and ``presets`` (:mod:`.plan`,
also ``python -m realloc_tools.offline.plan``), ``realloc simulate`` (:mod:`.simulate`), plan
pictures (:mod:`.svg`) and byte units (:mod:`.units`). Importing any of them imports neither
torch nor ray (``plan --verify`` imports torch when it runs; tests/test_cli.py checks both)."""
