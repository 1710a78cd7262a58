"""Operation logs and progress bars of checkpoints and HF import/export with real Ray actors.

One simulated cluster (two nodes of 4 CPUs) and one group of 8 workers for the module; tests run
in file order. ``actors.driver.checkpoint.Progress`` is replaced by a subclass that remembers every
operation, so a test reads what each step's bar counted.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from simulated import simulated_cluster

from actors.driver import checkpoint
from actors.driver.checkpoint import CheckpointManager
from actors.records import CheckpointFault
from actors.wire.zero_copy import sweep_stale_buffers
from realloc import ModelSpec, Topology
from realloc.ckpt.errors import CheckpointError
from realloc.progress import PROGRESS_ENV, Progress

SPEC = ModelSpec.preset("tiny")
TRAIN, GEN = Topology(dp=2, tp=2, pp=2), Topology(dp=2, tp=4)
SEED, OTHER = 3, 77
RUN = "progress-run"
END = re.compile(r"^(?P<what>.+): done, (?P<bytes>\d+) bytes in (?P<seconds>[\d.]+) s \([\d.]+ GB/s\)")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from actors import ModelGroup

    with simulated_cluster(nodes=2, cpus_per_node=4):
        group = ModelGroup.create(SPEC, TRAIN, name="progress-test", timeout_s=60)
        group.init_synthetic(SEED)
        manager = CheckpointManager(group, root=tmp_path_factory.mktemp("ckpt-root"), run_id=RUN, factor=2)
        yield SimpleNamespace(group=group, manager=manager)
        group.shutdown()
    sweep_stale_buffers()


@pytest.fixture
def made(monkeypatch) -> list[Progress]:
    made: list[Progress] = []

    class Recording(Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(checkpoint, "Progress", Recording)
    return made


def messages(caplog, level: int = logging.INFO, logger: str = "actors.driver.checkpoint") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


def check_end(record: str, what: str, nbytes: int, seconds: float) -> None:
    """``record`` is the end record of ``what``: ``nbytes`` bytes, and seconds at least the
    operation's own measure of its wall time (the record's clock starts first), not much more."""
    m = END.match(record)
    assert m, record
    assert m["what"] == what and int(m["bytes"]) == nbytes, record
    assert seconds - 0.001 <= float(m["seconds"]) <= seconds + 0.5, (record, seconds)


def test_save_and_load_log_start_and_end_with_bytes_and_seconds(env, made, caplog, capsys, monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)  # stderr is not a terminal here: no bars
    caplog.set_level(logging.INFO, logger="actors.driver.checkpoint")
    g, m = env.group, env.manager
    stats = m.save(1).wait()
    what = f"checkpoint save of iteration 1 (run {RUN}, sync)"
    start, end = messages(caplog)
    assert start == f"{what}: started"
    on_disk = sum(man.file_bytes for man in m.catalog([1]).manifests(1).values())
    assert stats.bytes_written == on_disk > 0
    check_end(end, what, on_disk, stats.total_seconds)
    replicated = stats.bytes_replicated_inter_node + stats.bytes_replicated_intra_node
    assert f"{stats.replica_files} replicas ({stats.bytes_replicated_inter_node} bytes inter-node" in end
    # The bars counted each worker's file as it was written, then each one's received replicas.
    assert made[-1].steps == [("write rank files", on_disk), ("replicate", replicated)] and replicated > 0

    caplog.clear()
    g.init_synthetic(OTHER)
    loaded = m.load()
    what = f"checkpoint load of the newest iteration (run {RUN})"
    start, end = messages(caplog)
    assert start == f"{what}: started" and loaded.method == "restore"
    check_end(end, what, loaded.bytes_read, loaded.total_seconds)
    assert loaded.bytes_read == on_disk and "iteration 1 by restore" in end
    moved = loaded.bytes_local + loaded.bytes_intra_node + loaded.bytes_inter_node
    assert made[-1].steps == [("read rank files", on_disk), ("restore", moved)] and moved > 0
    assert g.verify_synthetic(SEED) == {}
    assert "write rank files" not in capsys.readouterr().err


def test_async_save_logs_its_end_when_waited_and_a_failed_save_its_failure(env, caplog):
    caplog.set_level(logging.INFO, logger="actors.driver.checkpoint")
    m = env.manager
    handle = m.save(2, is_async=True)
    what = f"checkpoint save of iteration 2 (run {RUN}, async)"
    assert messages(caplog) == [f"{what}: started"]
    stats = handle.wait()
    check_end(messages(caplog)[-1], what, stats.bytes_written, stats.total_seconds)

    caplog.clear()
    handle = m.save(3, is_async=True, fault=CheckpointFault(rank=1, mode="raise"))
    with pytest.raises(CheckpointError, match="injected checkpoint fault on rank 1"):
        handle.wait()
    what = f"checkpoint save of iteration 3 (run {RUN}, async)"
    assert messages(caplog) == [f"{what}: started"]  # no end record
    (warning,) = messages(caplog, logging.WARNING)
    assert re.match(rf"{re.escape(what)}: failed after [\d.]+ s \(\d+ B done\): CheckpointError: ", warning)
    assert "injected checkpoint fault on rank 1" in warning and "iteration 2 stays loadable" in warning


def test_hf_export_import_and_resharding_load_show_bars_and_log(env, made, caplog, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(PROGRESS_ENV, "1")  # bars forced on: they go to stderr
    caplog.set_level(logging.DEBUG, logger="actors.driver.checkpoint")
    g, m = env.group, env.manager
    g.init_synthetic(SEED)
    m.export_hf(tmp_path, max_shard_bytes=300_000)
    st = m.last_hf_export
    what = f"HF export to {tmp_path}"
    start, end = messages(caplog)
    on_disk = sum((tmp_path / f["name"]).stat().st_size for f in st.files)  # tensors and headers
    assert start == f"{what}: started" and st.bytes_written == on_disk > sum(p.nbytes for p in SPEC.params)
    check_end(end, what, on_disk, st.total_seconds)
    assert made[-1].steps == [("transfer and write files", on_disk)]
    debug = messages(caplog, logging.DEBUG)
    assert any(re.search(r"export plan: \d+ routes in \d+ steps", d) for d in debug), debug
    assert any("slowest: exchange" in d for d in debug), debug
    err = capsys.readouterr().err
    assert f"{what}: transfer and write files" in err and "100%" in err

    caplog.clear()
    g.reallocate(GEN)
    g.init_synthetic(OTHER)
    stats = m.import_hf(tmp_path)
    what = f"HF import from {tmp_path}"
    start, end = messages(caplog)
    shard_bytes = sum(s.nbytes for r in range(g.num_workers) for s in g.layout.shards(r))
    assert start == f"{what}: started" and stats["bytes_read"] == shard_bytes
    check_end(end, what, shard_bytes, stats["seconds"])
    assert made[-1].steps == [("read shards", shard_bytes)]
    assert g.verify_synthetic(SEED) == {}
    assert f"{what}: read shards" in capsys.readouterr().err

    caplog.clear()
    loaded = m.load()  # iteration 2, saved in TRAIN, into GEN
    assert loaded.method == "reshard" and loaded.iteration == 2
    moved = loaded.bytes_local + loaded.bytes_intra_node + loaded.bytes_inter_node
    assert made[-1].steps == [("read stored shards", loaded.bytes_read), ("reshard", moved)]
    check_end(
        messages(caplog)[-1],
        f"checkpoint load of the newest iteration (run {RUN})",
        loaded.bytes_read,
        loaded.total_seconds,
    )
    g.reallocate(TRAIN)


def test_a_move_logs_its_plan_at_debug(env, caplog):
    caplog.set_level(logging.DEBUG, logger="actors.driver.group")
    env.group.reallocate(GEN)
    debug = messages(caplog, logging.DEBUG, "actors.driver.group")
    assert any(re.search(r"planned in [\d.]+ s: \d+ routes in \d+ steps: \d+ bytes inter-node", d) for d in debug), (
        debug
    )
    # the slowest worker of each phase of the move (prepare, transfers, commit, ...)
    assert any(re.search(r"slowest worker per phase: .*commit [\d.]+ s \(worker \d\)", d) for d in debug), debug
    env.group.reallocate(TRAIN)


def test_each_result_sees_every_answer_and_never_changes_the_outcome(env, caplog):
    from actors.remote import each_result, gather

    workers = env.group.workers
    plain = gather(workers, [a.ping.remote() for a in workers.actors], 30, "ping")
    seen: list[int] = []

    def broken_bar(i: int, result) -> None:
        seen.append(i)
        raise RuntimeError("the bar broke")

    caplog.set_level(logging.WARNING, logger="actors.remote")
    with each_result(broken_bar):
        reported = gather(workers, [a.ping.remote() for a in workers.actors], 30, "ping with a bar")
    assert sorted(seen) == list(range(len(workers)))
    assert [r["pid"] for r in reported] == [r["pid"] for r in plain]  # every answer, in worker order
    assert len(messages(caplog, logging.WARNING, "actors.remote")) == len(workers)
    gather(workers, [a.ping.remote() for a in workers.actors], 30, "ping after the block")
    assert len(seen) == len(workers)  # the callback ends with its block
