"""benchmarks/cpu_during_move.py: a move's CPU sorted by process kind, from /proc.

The oracle is what the kernel says of processes this test makes itself: a child that burns CPU
is "other" until it is named a worker, this process is the driver, kthreadd's children are the
kernel's; and a process that appears between two snapshots counts from zero.
"""

from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_during_move.py"
_spec = importlib.util.spec_from_file_location("cpu_during_move", _PATH)
cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu)

BURN = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
    "import sys; sys.stdin.read()"
)


def _burner() -> subprocess.Popen:
    """A child that spends 0.3 s of CPU, says so, and then waits (alive) for its stdin to close."""
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([child.stdout], [], [], 60)
    if not ready:
        child.kill()
        pytest.fail("the CPU-burning child did not finish its 0.3 s of CPU within 60 s")
    assert child.stdout.readline().strip() == "done"
    return child


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def test_kinds_of_known_processes():
    child = _burner()
    try:
        as_other = cpu.cpu_by_process(set())
        as_worker = cpu.cpu_by_process({child.pid})
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert as_other[child.pid][0] == "other"
    assert as_worker[child.pid][0] == "workers"
    assert as_other[os.getpid()][0] == "driver"
    if _name(2) == "kthreadd":  # absent in a container's own PID namespace
        assert as_other[2][0] == "kernel"
    assert as_worker[child.pid][1] >= 0.25  # its 0.3 s of CPU, in 10 ms ticks


def test_delta_counts_new_processes_from_zero_and_sorts_by_kind():
    before = cpu.cpu_by_process(set())
    child = _burner()
    try:
        after = cpu.cpu_by_process({child.pid})
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert child.pid not in before
    delta = cpu.cpu_delta(before, after)
    assert set(delta) == set(cpu.KINDS)
    assert 0.25 <= delta["workers"] <= after[child.pid][1] + 1e-9
    assert all(v >= 0 for v in delta.values())


def test_delta_by_kind_is_the_sum_over_processes():
    before = {1: ("other", 1.0), 2: ("kernel", 5.0), 10: ("workers", 2.0), 11: ("workers", 3.0)}
    after = {
        1: ("other", 1.5),
        2: ("kernel", 5.25),
        10: ("workers", 2.5),
        11: ("workers", 4.0),
        12: ("ray", 0.75),
        13: ("driver", 0.125),
    }  # 12, 13 started in between
    assert cpu.cpu_delta(before, after) == {"workers": 1.5, "driver": 0.125, "ray": 0.75, "kernel": 0.25, "other": 0.5}
