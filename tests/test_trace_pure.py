"""The trace of a move as Chrome trace JSON (actors/trace.py), without Ray: clocks, layout, files."""

from __future__ import annotations

import json

import pytest

from actors.trace import MoveTrace, WorkerTimeline, chrome_trace, clock_offset, slowest, write_chrome_trace


def _record(op: str, base: float, steps: list) -> dict:
    return {
        "op": op,
        "phases": [
            ["prepare", base, base + 0.1],
            ["transfers", base + 0.1, base + 0.5],
            ["commit", base + 0.5, base + 0.6],
        ],
        "steps": steps,
        "local": [[base + 0.1, base + 0.2, 64]],
    }


def _move(skew: float = 0.0) -> MoveTrace:
    """Two workers on two nodes; worker 1's clock runs ``skew`` seconds ahead of the driver's."""
    t = 1000.0
    w0 = _record("op1", t, [[0, t + 0.1, t + 0.3, 1, 100, "inter", 1, 40]])
    w1 = _record("op1", t + skew, [[0, t + skew + 0.15, t + skew + 0.3, 0, 40, "inter", 0, 100]])
    return MoveTrace(
        "a -> b",
        "op1",
        ("node-a", "node-b"),
        (WorkerTimeline("realloc:g:rank0", 0, 0.0, w0), WorkerTimeline("realloc:g:rank1", 1, skew, w1)),
        (("move", t - 0.2, t + 0.7), ("plan", t - 0.2, t - 0.1)),
    )


def test_clock_offset_takes_the_shortest_round_trip():
    # the worker is 5 s ahead; the long round trip (queueing) would put it at 5.4 s
    assert clock_offset([(0.0, 5.9, 1.0), (2.0, 7.05, 2.1)]) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="no clock samples"):
        clock_offset([])


def test_skewed_clocks_land_on_the_driver_clock():
    aligned, skewed = _move(0.0).chrome(), _move(37.5).chrome()
    assert aligned == skewed  # the offset is taken out exactly


def test_one_track_per_worker_grouped_by_node():
    trace = _move().chrome()
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    workers = {name for name in names.values() if not name.endswith("local copies")}
    assert workers == {"realloc:g:rank0", "realloc:g:rank1"}
    pids = {name: pid for (pid, _), name in names.items()}
    assert pids["realloc:g:rank0"] != pids["realloc:g:rank1"]  # two nodes, two processes
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step"]
    assert sorted(e["args"]["recv_bytes"] for e in steps) == [40, 100]
    assert {e["args"]["send_to"] for e in steps} == {"realloc:g:rank0", "realloc:g:rank1"}
    flows = [e for e in trace["traceEvents"] if e.get("cat") == "flow"]
    assert sorted(e["ph"] for e in flows) == ["f", "f", "s", "s"]  # one arrow per route
    assert min(e["ts"] for e in trace["traceEvents"] if "ts" in e) == 0  # the driver's move starts it


def test_steps_on_the_driver_clock():
    steps = _move(3.0).steps()
    assert [s["start"] for s in steps] == pytest.approx([1000.1, 1000.15])
    assert steps[1]["recv_from"] == "realloc:g:rank0" and steps[1]["send_bytes"] == 100


def test_several_moves_in_one_file_share_the_tracks(tmp_path):
    later = MoveTrace(
        "b -> a",
        "op2",
        ("node-a", "node-b"),
        tuple(WorkerTimeline(w.name, w.node, w.offset, {**w.record, "op": "op2"}) for w in _move().workers),
        (("move", 1001.0, 1002.0),),
    )
    path = write_chrome_trace(tmp_path / "moves.json", [_move(), later])
    data = json.loads(path.read_text())
    assert [m["op"] for m in data["otherData"]["moves"]] == ["op1", "op2"]
    assert sum(e["name"] == "thread_name" for e in data["traceEvents"]) == 4  # 2 workers x (steps, local copies)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_bad_trace_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        write_chrome_trace(tmp_path, [_move()])
    with pytest.raises(ValueError, match="does not exist"):
        write_chrome_trace(tmp_path / "no" / "t.json", [_move()])
    with pytest.raises(ValueError, match="no moves"):
        chrome_trace([])


@pytest.mark.parametrize("path", [123, None, b"t.json", ["t.json"]], ids=repr)
def test_a_trace_path_that_is_no_path_is_refused(tmp_path, monkeypatch, path):
    """Issue 36: ``last_trace().write(123)`` and ``write(None)`` raised a bare ``TypeError`` from
    ``pathlib``; the path argument is named now, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"trace path must be a file path \(a str or os\.PathLike\), got "):
        _move().write(path)
    with pytest.raises(ValueError, match=r"trace path must be a file path"):
        write_chrome_trace(path, [_move()])
    assert list(tmp_path.iterdir()) == []


def test_slowest_names_the_worker_and_its_phase():
    got = slowest(["a", "b", "c"], [{"x": 1.0, "y": 0.5}, {"x": 0.2, "y": 2.0}, None])
    assert got == {"worker": "b", "seconds": 2.2, "phase": "y", "phase_seconds": 2.0}
    assert slowest(["a"], [None]) is None


def test_a_failed_write_keeps_the_previous_trace(tmp_path, monkeypatch):
    path = write_chrome_trace(tmp_path / "t.json", [_move()])
    before = path.read_bytes()
    reference = tmp_path / "plain.txt"
    reference.write_text("x")
    assert path.stat().st_mode == reference.stat().st_mode  # the usual permissions, not a temp file's 0600

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_chrome_trace(path, [_move(), _move()])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt", "t.json"]
