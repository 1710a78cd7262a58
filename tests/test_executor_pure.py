"""The worker-side executor's helpers that need no Ray (actors/wire/executor.py)."""

import gc

import pytest

from actors.wire.executor import collector_paused


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_is_paused_inside_and_restored_after(enabled):
    """A move's execution runs with the cyclic collector off; the process's own setting (a user
    may have disabled it) comes back afterwards, also when execution raises."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError):
            with collector_paused():
                assert not gc.isenabled()
                raise RuntimeError("a peer died")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
