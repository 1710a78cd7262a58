"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import subprocess

import pytest

#: OpenMP threads that finish a parallel region sleep at once rather than spin. Every process the
#: suite starts inherits it: the pytest workers (started after this file is read), Ray's clusters
#: and actors, vLLM's engines and their workers, the CLI runs. On these 2 cores the suite's
#: processes outnumber the cores, and a spinning thread takes a core from a process with work.
#: vLLM at tp=2 here, 20 generate calls of 16 tokens: 61-70 CPU-seconds spinning, 10 passive
#: (docs/benchmarks.md, "OpenMP threads that sleep"). Set it in the environment to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


#: Test modules run in the two pytest processes (`-n 2 --dist loadgroup`, pyproject.toml) as
#: work units: each unit goes whole to one process. A unit is one module, or here several Ray
#: modules asking for the same simulated cluster shape (tests/simulated.py keeps a cluster between
#: the modules of a process that ask for the same shape). Units start longest first (seconds in the
#: suite run under `--durations=0`, 2026-11-27), so no long one starts last and leaves one process
#: running alone at the end; a unit's modules run in the order written.
UNITS = (
    (
        "ray-2x4-staged",
        ("test_staged_faults_ray.py", "test_fleet_ray.py", "test_staged_ray.py", "test_deadlines_ray.py"),
    ),
    ("ray-4x2", ("test_conventions_ray.py", "test_trust_ray.py")),  # trust adds and removes a node: last
    (
        "ray-2x4-moves",
        (
            "test_delta_ray.py",
            "test_resident_ray.py",
            "test_formats_ray.py",
            "test_progress_ray.py",
            "test_invalid_api.py",
        ),
    ),
    ("bench", ("test_bench.py",)),
    (
        "ray-1x4",
        ("test_vllm_backend_ray.py", "test_vllm_frontends_ray.py", "test_hf_export_ray.py", "test_hf_trust_ray.py"),
    ),
    ("ray-2x2", ("test_zero3_ray.py", "test_your_model_ray.py", "test_worker_class_trust_ray.py", "test_fsdp2_ray.py")),
    ("scale", ("test_scale_ray.py",)),
    ("ray-3x4", ("test_moe_ray.py", "test_ckpt_ray.py")),
    ("ray-head", ("test_ray_head.py",)),
    ("ray-cluster", ("test_ray_cluster.py",)),
    ("grafana", ("test_grafana_prometheus_ray.py",)),
    ("ray-2x3", ("test_async_rl_example_ray.py",)),
    ("ray-2x5", ("test_trace_ray.py",)),
    # the longest modules without Ray, so that the last units are the short ones
    *(
        (name, (name,))
        for name in (
            "test_vllm_layouts.py",
            "test_megatron_source.py",
            "test_planner_properties.py",
            "test_formats.py",
            "test_layout.py",
            "test_stacked_experts_engine.py",
            "test_llama_model.py",
            "test_private_transport.py",
            "test_experts.py",
            "test_torchtitan_experts_engine.py",
            "test_sharded_fused.py",
            "test_plan_scale.py",
            "test_torchtitan_experts.py",
            "test_dtensor.py",
        )
    ),
)
_UNIT_OF = {
    module: (rank, unit, order) for rank, (unit, modules) in enumerate(UNITS) for order, module in enumerate(modules)
}


def _unit_of(item) -> tuple[int, str, int]:
    """``(rank, unit, order)`` of ``item``'s module: its place in :data:`UNITS`, or a unit of its
    own after all of them."""
    return _UNIT_OF.get(item.path.name, (len(UNITS), item.path.name, 0))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """Every item in its unit (an ``xdist_group`` mark), the listed units first and longest first;
    inside a module the tests sharing kept groups (the ``kept_groups`` fixture, tests/simulated.py
    ``KeptGroups``) first, so the groups live through them and are shut once; a stable sort,
    so the rest keeps its order."""
    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(_unit_of(item)[1]))
    items.sort(key=lambda item: (*_unit_of(item)[::2], str(item.path), "kept_groups" not in item.fixturenames))
