"""The trace of a move (``ModelGroup.last_trace``): real Ray actors on 2 simulated nodes, a real
move, the Chrome trace written, parsed back and checked against the plan and the stats."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from simulated import simulated_cluster

from actors import ModelGroup
from realloc import ModelSpec, Topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(2, 5) as c:
        yield c


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.preset("tiny")


@pytest.fixture(scope="module")
def group(cluster, spec):
    g = ModelGroup.create(spec, Topology(dp=2, tp=2, pp=2), name="traced", timeout_s=60, bucket_bytes=32 << 10)
    g.init_synthetic(seed=3)
    yield g
    g.shutdown()


def _read(trace, tmp_path) -> dict:
    path = tmp_path / "move.json"
    trace.write(path)
    return json.loads(path.read_text())


def _tracks(data: dict) -> dict:
    """(pid, tid) -> track name, from the metadata events."""
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}


def test_a_move_traced_end_to_end(group, tmp_path):
    stats = group.reallocate(Topology(dp=4, tp=2))
    data = _read(group.last_trace(), tmp_path)
    events = data["traceEvents"]
    tracks = _tracks(data)
    names = {n for n in tracks.values() if not n.endswith("local copies")}
    assert names == {f"realloc:traced:rank{r}" for r in range(8)}
    nodes = {pid for (pid, _), n in tracks.items() if n in names}
    assert len(nodes) == 2  # one process per node

    by_worker = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["pid"] != 0:
            by_worker[tracks[e["pid"], e["tid"]]].append(e)
    for name in names:
        phases = [e for e in by_worker[name] if e["cat"] == "phase"]
        assert [e["name"] for e in phases][:2] == ["prepare", "handles"] and phases[-1]["name"] == "commit", name
        for a, b in zip(phases, phases[1:]):  # one after another on the worker's clock
            assert a["dur"] >= 0 and a["ts"] + a["dur"] <= b["ts"] + 1, (name, a, b)
        steps = sorted((e for e in by_worker[name] if e["cat"] == "step"), key=lambda e: e["ts"])
        for st in steps:  # each step inside a phase of its worker
            assert any(p["ts"] <= st["ts"] + 1 and st["ts"] + st["dur"] <= p["ts"] + p["dur"] + 1 for p in phases), st
        assert [e["args"]["step"] for e in steps] == sorted(e["args"]["step"] for e in steps)  # in step order

    # bytes: what the steps received and the local copies made is what the move moved, and the plan planned
    steps = [e["args"] for e in events if e.get("cat") == "step"]
    received = defaultdict(int)
    for a in steps:
        if "recv_from" in a:
            received["inter" if a["link"] == "inter" else "intra"] += a["recv_bytes"]
    local = sum(e["args"]["bytes"] for e in events if e.get("cat") == "local")
    assert received["inter"] == stats.bytes_inter_node == stats.planned["bytes_inter_node"] > 0
    assert received["intra"] == stats.bytes_intra_node == stats.planned["bytes_intra_node"]
    assert local == stats.bytes_local
    # every send is a receive on the other end, same step, same bytes
    sends = sorted((a["step"], a["send_to"], a["send_bytes"]) for a in steps if "send_to" in a)
    receives = sorted(
        (a["step"], a["_me"], a["recv_bytes"]) for a in _with_receiver(events, tracks) if a["link"] != "read"
    )
    assert sends == receives
    flows = [e for e in events if e.get("cat") == "flow"]
    assert sum(e["ph"] == "s" for e in flows) == sum(e["ph"] == "f" for e in flows) == len(sends)

    # clocks: every worker's events lie inside the driver's span of the move
    move = next(e for e in events if e["pid"] == 0 and e["name"] == stats.transition)
    for e in events:
        if e.get("ph") == "X" and e["pid"] != 0:
            assert move["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= move["ts"] + move["dur"] + 1, e

    # the slowest worker and its slowest phase, named in the stats
    assert stats.slowest_worker in names
    mine = [e for e in by_worker[stats.slowest_worker] if e["cat"] == "phase"]
    assert stats.slowest_phase in {e["name"] for e in mine}
    assert 0 < stats.slowest_phase_seconds <= stats.slowest_worker_seconds
    assert stats.as_dict()["slowest_worker"] == stats.slowest_worker


def _with_receiver(events, tracks):
    for e in events:
        if e.get("cat") == "step" and "recv_from" in e["args"]:
            yield {**e["args"], "_me": tracks[e["pid"], e["tid"]]}


def test_a_copy_is_traced_from_either_group(group, spec, tmp_path):
    other = ModelGroup.create(spec, Topology(tp=2), name="reader", timeout_s=60)
    try:
        stats = group.copy_to(other)
        mine, theirs = group.last_trace(), other.last_trace()
        assert mine.op == theirs.op and len(mine.workers) == group.num_workers + other.num_workers
        got = sum(s["recv_bytes"] for s in mine.steps())
        assert got == stats.bytes_intra_node + stats.bytes_inter_node
        assert stats.slowest_worker is not None
        # a staged update's transfer has its own trace (the serving weights untouched meanwhile)
        update = group.copy_to(other, stage=True)
        staged = update.wait()
        trace = update.trace()
        assert trace.op == update.id and trace.label.startswith("staged ")
        assert sum(s["recv_bytes"] for s in trace.steps()) == staged.bytes_intra_node + staged.bytes_inter_node > 0
        assert staged.slowest_worker in {w.name for w in trace.workers}
        update.commit()
        assert group.last_trace().op == mine.op  # the staged transfer is not the group's last move
        other.reallocate(Topology(dp=2))  # the readers run another move: the copy's timeline is gone
        with pytest.raises(ValueError, match=r"realloc:reader:rank0 has run operation .* since"):
            group.last_trace()
        assert other.last_trace().label == "dp=1,tp=2,pp=1 -> dp=2,tp=1,pp=1"
    finally:
        other.shutdown()


def test_no_trace_before_a_move(cluster, spec):
    fresh = ModelGroup.create(spec, Topology(tp=2), name="fresh", timeout_s=60)
    try:
        with pytest.raises(ValueError, match="has no traced move"):
            fresh.last_trace()
    finally:
        fresh.shutdown()


def test_workers_on_another_clock_are_aligned_by_round_trips(group, monkeypatch):
    """The driver taken for another host (its clock domain renamed): every worker's clock offset is
    measured by round trips, and the timelines still land inside the driver's span of the move."""
    import actors.trace

    group.reallocate(Topology(dp=2, tp=2, pp=2))
    calls = []
    real = actors.trace.clock_offset

    def counted(samples):
        calls.append(len(samples))
        return real(samples)

    monkeypatch.setattr(actors.trace, "clock_domain", lambda: "a host of its own")
    monkeypatch.setattr(actors.trace, "clock_offset", counted)
    trace = group.last_trace()
    assert calls == [actors.trace.CLOCK_SAMPLES]  # one host: measured once, with every sample
    assert all(abs(w.offset) < 0.25 for w in trace.workers)  # the same machine's clock, really
    (move,) = [(a, b) for name, a, b in trace.driver if name == "move"]
    for w in trace.workers:
        for _, a, b in w.record["phases"]:
            assert move[0] - 0.25 <= a - w.offset and b - w.offset <= move[1] + 0.25
