"""Fixtures shared by several test modules."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A real 3 MB filesystem (tmpfs) to fill or remount read-only, or a skip where this process
    may not mount one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


#: The longest test modules (seconds in `.ci/run` with `--durations`, 2026-11-27), run first: the
#: two pytest processes (`-n 2 --dist loadfile`, pyproject.toml) take a module at a time in
#: collection order, so the long ones starting last left one process running alone at the end.
LONGEST_FIRST = (
    "test_bench.py",
    "test_staged_faults_ray.py",
    "test_delta_ray.py",
    "test_trust_ray.py",
    "test_your_model_ray.py",
    "test_scale_ray.py",
    "test_staged_ray.py",
    "test_deadlines_ray.py",
    "test_resident_ray.py",
    "test_ray_head.py",
    "test_formats_ray.py",
    "test_grafana_prometheus_ray.py",
)


def pytest_collection_modifyitems(items):
    """Longest modules first (a stable sort: each module's tests keep their order, and stay together)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
