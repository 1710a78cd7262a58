"""The data plane that both ends of a route run: a worker's share of a plan executed bucket by
bucket over a private process group. Imports nothing of :mod:`actors.worker` or
:mod:`actors.driver`, so any process can run it (``tests/test_wire_plain_process.py``)."""
