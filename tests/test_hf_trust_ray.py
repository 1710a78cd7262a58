"""Trust at the checkpoint surfaces, through the public API with real Ray workers: HF import
refuses what would be wrong weights, HF export never destroys the export before it and never
reports a success it did not verify, a failing hook after a load is a ``HookError``, and two
threads saving through one manager cannot delete each other's iteration.

One simulated node with 4 CPU slots for the module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from simulated import simulated_cluster

import actors.driver.checkpoint as checkpoint_module
from actors import HookError, ModelGroup, ShardWorker
from actors.driver.checkpoint import CheckpointManager
from actors.errors import ReallocationError
from actors.wire.zero_copy import sweep_stale_buffers
from realloc import Topology
from realloc.ckpt.errors import CheckpointError
from realloc.ckpt.hf import INDEX_FILE, export_state, save_hf_dir
from realloc.shards.synthetic import synthetic_state_dict
from realloc.spec import decoder_spec, hf_config_of

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

SPEC = decoder_spec(
    "trust-llama", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=100, tied=True, dtype="float32"
)


class FailsAfterLoads(ShardWorker):
    """A user's hook that breaks after a checkpoint load (and only then)."""

    def on_shards_changed(self, ctx, change) -> None:
        if change.kind == "load":
            raise RuntimeError("user hook failed after the load")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with simulated_cluster(nodes=1, cpus_per_node=4):
        group = ModelGroup.create(SPEC, Topology(tp=2), name="hf-trust", timeout_s=60)
        group.init_synthetic(3)
        manager = CheckpointManager(group, root=str(tmp_path_factory.mktemp("ckpt")), run_id="hf-trust", factor=1)
        yield group, manager
        group.shutdown()
    sweep_stale_buffers()


def _checkpoint(path: Path, **changes: torch.Tensor) -> None:
    state = export_state(synthetic_state_dict(SPEC, 5), SPEC)
    state.update(changes)
    save_hf_dir(state, path, extra={"config.json": hf_config_of(SPEC)})


def test_import_refuses_integers_for_float_parameters(env, tmp_path):
    group, manager = env
    name = "model.layers.1.self_attn.o_proj.weight"
    _checkpoint(tmp_path, **{name: torch.randint(-100, 100, SPEC.by_name[name].shape, dtype=torch.int8)})
    with pytest.raises(ValueError, match=rf"{name} is int8, the model's {name} is float32"):
        manager.import_hf(tmp_path)
    assert group.verify_synthetic(3) == {}  # nothing moved


def test_import_of_an_untied_checkpoint_into_a_tied_spec_is_refused(env, tmp_path):
    group, manager = env
    embedding = synthetic_state_dict(SPEC, 5)["model.embed_tokens.weight"]
    head = embedding.clone()
    head[-1, -1] += 1.0
    _checkpoint(tmp_path / "untied", **{"lm_head.weight": head})
    with pytest.raises(ValueError, match="they differ: it is untied"):
        manager.import_hf(tmp_path / "untied")
    assert group.verify_synthetic(3) == {}
    _checkpoint(
        tmp_path / "same", **{"lm_head.weight": embedding.clone()}
    )  # the same bytes under both names: one tensor
    manager.import_hf(tmp_path / "same")
    assert group.verify_synthetic(5) == {}
    group.init_synthetic(3)


def test_a_file_replaced_between_the_scan_and_the_reads_fails_the_import(env, tmp_path, monkeypatch):
    group, manager = env
    _checkpoint(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    original = checkpoint_module.match_spec

    def match_then_replace(tensors, spec):  # the driver has scanned; now the file changes
        mapping = original(tensors, spec)
        state = export_state(synthetic_state_dict(SPEC, 5), SPEC)
        state[name] = torch.ones(SPEC.by_name[name].shape[0] + 16, SPEC.by_name[name].shape[1])
        save_hf_dir(state, tmp_path)
        return mapping

    monkeypatch.setattr(checkpoint_module, "match_spec", match_then_replace)
    with pytest.raises(ReallocationError, match=rf"tensor '{name}' is \(80, 128\) float32 now, but was \(64, 128\)"):
        manager.import_hf(tmp_path)
    assert group.verify_synthetic(3) == {}  # the fill was aborted: the weights as before


def _loads(out: Path) -> dict[str, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, **{kw: torch.float32}
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.state_dict()


def test_an_export_that_fills_the_disk_keeps_the_previous_export_and_its_index(env, small_disk):
    group, manager = env
    out = small_disk / "export"
    manager.export_hf(out, max_shard_bytes=100_000)  # ~0.6 MB in several files: an index
    assert (out / INDEX_FILE).exists()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    filler = small_disk / "filler"  # leave less room than a second export needs
    filler.write_bytes(b"\0" * (3 * 2**20 - 2 * sum(map(len, before.values())) + 300_000))
    with pytest.raises(CheckpointError, match=r"(?s)export' failed.*before is unchanged.*No space left on device"):
        manager.export_hf(out, max_shard_bytes=100_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["export", "filler"]  # the staging is gone
    loaded = _loads(out)
    for name, t in synthetic_state_dict(SPEC, 3).items():
        assert torch.equal(loaded[name], t), name


def _after_the_writers(monkeypatch, damage) -> None:
    """Run ``damage(directory)`` on the directory the writers wrote, before the driver finishes."""
    original = checkpoint_module.finish_hf_dir

    def damaged(where, *args, **kwargs):
        damage(Path(getattr(where, "path", where)))
        return original(where, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "finish_hf_dir", damaged)


def test_an_export_whose_weight_file_vanished_is_not_reported_as_done(env, tmp_path, monkeypatch):
    group, manager = env
    out = tmp_path / "export"
    manager.export_hf(out, max_shard_bytes=100_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    victim = sorted(p.name for p in out.glob("model-*.safetensors"))[1]
    _after_the_writers(monkeypatch, lambda d: (d / victim).unlink())
    with pytest.raises(CheckpointError, match=f"failed verification.*{victim} is missing"):
        manager.export_hf(out, max_shard_bytes=100_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_export_errors_name_the_path_and_what_to_do(env, tmp_path, small_disk, monkeypatch):
    group, manager = env
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ValueError, match="afile' exists and is not a directory"):
        manager.export_hf(afile)
    assert afile.read_text() == "mine"

    out = tmp_path / "gone"
    _after_the_writers(monkeypatch, shutil.rmtree)
    with pytest.raises(CheckpointError, match=r"gone' failed.*removed while the export ran; export again"):
        manager.export_hf(out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gone")]  # nothing half-written
    monkeypatch.undo()

    manager.export_hf(small_disk / "ro")
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(CheckpointError, match=r"ro' failed: Read-only file system.*choose a writable directory"):
        manager.export_hf(small_disk / "ro")
    assert _loads(small_disk / "ro")


def test_a_hook_failing_after_a_load_is_a_hook_error(tmp_path):
    group = ModelGroup.create(SPEC, Topology(tp=2), name="hook-load", worker_cls=FailsAfterLoads, timeout_s=60)
    try:
        group.init_synthetic(4)
        manager = CheckpointManager(group, root=str(tmp_path), run_id="hook-load", factor=1)
        manager.save(1)
        group.init_synthetic(6)
        with pytest.raises(HookError, match="user hook failed after the load") as info:
            manager.load()
        assert not isinstance(info.value, CheckpointError)
        assert group.verify_synthetic(4) == {}  # the load stands, as a move does when its hook fails
    finally:
        group.shutdown()


def test_two_threads_saving_through_one_manager_never_delete_the_newer_iteration(env, monkeypatch):
    group, manager = env
    inside = threading.Event()
    original = CheckpointManager._finish_save_locked

    def slow_finish(self, handle):  # iteration 10 holds the group while the other thread arrives
        if handle.iteration == 10:
            inside.set()
            time.sleep(1.5)
        return original(self, handle)

    monkeypatch.setattr(CheckpointManager, "_finish_save_locked", slow_finish)
    outcome: dict[int, object] = {}

    def save(iteration: int) -> None:
        try:
            outcome[iteration] = manager.save(iteration).wait().iteration
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            outcome[iteration] = exc

    first = threading.Thread(target=save, args=(10,))
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=save, args=(9,))
    second.start()
    first.join(60)
    second.join(60)
    assert outcome[10] == 10
    assert isinstance(outcome[9], ValueError) and "not after the last saved iteration 10" in str(outcome[9])
    assert manager.find_latest() == 10
