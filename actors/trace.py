"""A move's trace: every worker's phases and steps on the driver's clock, as Chrome trace JSON.

Each worker records the timeline of the move it runs as it runs it (``actors/wire/executor.py``,
:class:`~actors.wire.executor.Phases`: its phases, each step's exchange with its peers, its local
copies); the driver gathers the timelines on request (``ModelGroup.last_trace()``) and this module
puts them on one clock and writes them in the Chrome trace event format, which Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open:

* one process per node (``node <k>``), one thread (track) per worker, named by its actor
  (``realloc:<group>:rank<r>``), holding its phases and, nested in them, its steps (``args``: the
  peer it received from and the bytes, the link, the peer it sent to and the bytes); a second
  track per worker holds its local copies (they run on their own thread, beside the steps);
* a flow arrow from each step's sender to its receiver;
* a ``driver`` process with the move itself and its planning.

Clocks: a worker's times are its host's wall clock. A worker in the driver's clock domain (the
same kernel: same boot id) is on the driver's clock already; another one's offset is estimated
from :data:`CLOCK_SAMPLES` round trips (the reading of the shortest one, against its midpoint).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from actors.lanes import MOVE, Lane
from actors.records import slowest  # noqa: F401 - actors.trace.slowest, as before
from actors.remote import Deadline, Workers, gather
from realloc.atomic_files import atomic_write, check_output_file

#: Round trips per worker outside the driver's clock domain (the shortest one is used).
CLOCK_SAMPLES = 3

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def clock_domain() -> str:
    """What shares this host's wall clock: the kernel's boot id (a host), else the host name."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return socket.gethostname()


def clock_reading() -> dict:
    """``{"time": time.time(), "domain": clock_domain()}``."""
    return {"time": time.time(), "domain": clock_domain()}


def clock_offset(samples: Sequence[tuple[float, float, float]]) -> float:
    """Seconds a worker's clock is ahead of the driver's, from ``(sent, worker time, answered)``
    round trips on the driver's clock: the worker's reading minus the midpoint of the shortest."""
    if not samples:
        raise ValueError("no clock samples")
    sent, reading, answered = min(samples, key=lambda s: s[2] - s[0])
    return reading - (sent + answered) / 2


def wall_spans(*spans: tuple[str, float, float]) -> tuple[tuple[str, float, float], ...]:
    """The driver's ``(name, start, end)`` spans, measured with ``time.perf_counter()``, on its
    wall clock (``time.time()``), as :class:`MoveRef` keeps them."""
    shift = time.time() - time.perf_counter()
    return tuple((name, a + shift, b + shift) for name, a, b in spans)


@dataclass(frozen=True)
class MoveRef:
    """What a move's trace is gathered from: its label, its operation (or staged update) id, the
    workers that ran it (plan order), their nodes (``Placement.nodes``), the driver's spans
    ``(name, start, end)`` on its wall clock, and the lane it ran on (actors/lanes.py: a move's,
    or a staged update's), whose timeline each worker keeps."""

    label: str
    op: str
    workers: Workers
    nodes: tuple[str, ...]
    driver: tuple[tuple[str, float, float], ...]
    lane: Lane = MOVE


def gather_trace(move: MoveRef, deadline: Deadline) -> MoveTrace:
    """Ask every worker of ``move`` for its last timeline on ``move.lane`` (``ShardWorker.last_trace``)
    and put them on the driver's clock. ``ValueError`` when a worker's last one is another
    operation's (its timeline of ``move`` is gone); a dead or silent worker raises :func:`~actors.remote.gather`'s error, naming it, by ``deadline``."""
    what = f"gather the trace of {move.label}"
    records = gather(move.workers, [a.last_trace.remote(move.lane) for a in move.workers.actors], deadline, what)
    nodes = sorted(set(move.nodes), key=move.nodes.index)
    offsets: dict[str, float] = {clock_domain(): 0.0}  # clock domain -> seconds ahead of the driver
    timelines = []
    for i, (name, record) in enumerate(zip(move.workers.names, records)):
        if record["op"] != move.op:
            raise ValueError(
                f"worker {name} has run operation {record['op']} since {move.label} (operation {move.op}): "
                "its timeline of that move is gone; gather the trace right after the move"
            )
        domain = record["clock"]["domain"]
        if domain not in offsets:  # another host: the shortest of CLOCK_SAMPLES round trips
            one = move.workers.subset([i])
            samples = []
            for _ in range(CLOCK_SAMPLES):
                sent = time.time()
                reading = gather(one, [one.actors[0].clock.remote()], deadline, what)[0]["time"]
                samples.append((sent, reading, time.time()))
            offsets[domain] = clock_offset(samples)
        timelines.append(WorkerTimeline(name, nodes.index(move.nodes[i]), offsets[domain], record))
    return MoveTrace(move.label, move.op, tuple(nodes), tuple(timelines), move.driver)


@dataclass(frozen=True)
class WorkerTimeline:
    """One worker's part of a move: its actor name, its node (index into ``MoveTrace.nodes``), its
    clock's offset from the driver's (seconds to subtract) and its record
    (:meth:`~actors.wire.executor.Phases.record`)."""

    name: str
    node: int
    offset: float
    record: dict


@dataclass(frozen=True)
class MoveTrace:
    """The trace of one move: ``workers[i]`` is plan worker ``i``; ``driver``: the driver's own
    spans ``(name, start, end)`` (planning, the whole call), wall-clock seconds."""

    label: str
    op: str
    nodes: tuple[str, ...]
    workers: tuple[WorkerTimeline, ...]
    driver: tuple[tuple[str, float, float], ...]

    def steps(self) -> list[dict]:
        """Every step of every worker on the driver's clock: ``{"worker", "step", "start", "end",
        "recv_from", "recv_bytes", "link", "send_to", "send_bytes"}`` (peers by actor name)."""
        out = []
        for w in self.workers:
            for s, start, end, rpeer, rbytes, link, speer, sbytes in w.record["steps"]:
                out.append(
                    {
                        "worker": w.name,
                        "step": s,
                        "start": start - w.offset,
                        "end": end - w.offset,
                        "recv_from": self.workers[rpeer].name if rpeer is not None else None,
                        "recv_bytes": rbytes,
                        "link": link,
                        "send_to": self.workers[speer].name if speer is not None else None,
                        "send_bytes": sbytes,
                    }
                )
        return out

    def start(self) -> float:
        times = [a for _, a, _ in self.driver]
        for w in self.workers:
            times += [a - w.offset for _, a, _ in w.record["phases"]]
        return min(times)

    def chrome(self) -> dict:
        """This move alone as a Chrome trace (:func:`chrome_trace`)."""
        return chrome_trace([self])

    def write(self, path: "str | os.PathLike") -> None:
        write_chrome_trace(path, [self])


def chrome_trace(moves: Sequence[MoveTrace]) -> dict:
    """Several moves (of any groups) as one Chrome trace: ``{"traceEvents": [...],
    "displayTimeUnit": "ms", "otherData": {"origin_unix_s", "moves"}}``; timestamps are
    microseconds since the earliest event (``origin_unix_s``, the driver's wall clock)."""
    if not moves:
        raise ValueError("no moves to trace")
    origin = min(m.start() for m in moves)
    events: list[dict] = [_meta("process_name", 0, None, "driver"), _meta("process_sort_index", 0, None, 0)]
    pids: dict[str, int] = {}  # node id -> pid
    tids: dict[tuple[int, str], int] = {}  # (pid, worker name) -> tid
    flow = 0

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    def span(name: str, cat: str, pid: int, tid: int, a: float, b: float, args: dict | None = None) -> dict:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": us(a), "dur": us(b) - us(a)}
        if args:
            event["args"] = args
        return event

    for m in moves:
        for name, a, b in m.driver:
            events.append(span(f"{m.label}: {name}" if name != "move" else m.label, "driver", 0, 0, a, b, {"op": m.op}))
        track = []
        for i, w in enumerate(m.workers):
            node = m.nodes[w.node]
            if node not in pids:
                pids[node] = pid = len(pids) + 1
                events += [
                    _meta("process_name", pid, None, f"node {pid - 1} ({node[:12]})"),
                    _meta("process_sort_index", pid, None, pid),
                ]
            pid = pids[node]
            if (pid, w.name) not in tids:
                tids[pid, w.name] = tid = 2 * len(tids) + 1
                events += [
                    _meta("thread_name", pid, tid, w.name),
                    _meta("thread_sort_index", pid, tid, tid),
                    _meta("thread_name", pid, tid + 1, f"{w.name} local copies"),
                    _meta("thread_sort_index", pid, tid + 1, tid + 1),
                ]
            track.append((pid, tids[pid, w.name]))
            for name, a, b in w.record["phases"]:
                events.append(span(name, "phase", pid, track[i][1], a - w.offset, b - w.offset, {"op": m.op}))
            for a, b, nbytes in w.record["local"]:
                events.append(
                    span("local copies", "local", pid, track[i][1] + 1, a - w.offset, b - w.offset, {"bytes": nbytes})
                )
        sent: dict[tuple[int, int, int], float] = {}  # (step, sender, receiver) -> when the sender's step began
        for i, w in enumerate(m.workers):
            for s, a, b, rpeer, rbytes, link, speer, sbytes in w.record["steps"]:
                pid, tid = track[i]
                args = {"step": s}
                if rpeer is not None:
                    args.update(recv_from=m.workers[rpeer].name, recv_bytes=rbytes, link=link)
                if speer is not None:
                    args.update(send_to=m.workers[speer].name, send_bytes=sbytes)
                    sent[s, i, speer] = a - w.offset
                events.append(span(f"step {s}", "step", pid, tid, a - w.offset, b - w.offset, args))
        for i, w in enumerate(m.workers):  # a flow arrow from each sender's step to its receiver's
            for s, a, _, rpeer, _, link, _, _ in w.record["steps"]:
                if rpeer is not None and link != "read" and (s, rpeer, i) in sent:
                    flow += 1
                    spid, stid = track[rpeer]
                    events.append(
                        {
                            "name": "bytes",
                            "cat": "flow",
                            "ph": "s",
                            "id": flow,
                            "pid": spid,
                            "tid": stid,
                            "ts": us(sent[s, rpeer, i]),
                        }
                    )
                    pid, tid = track[i]
                    events.append(
                        {
                            "name": "bytes",
                            "cat": "flow",
                            "ph": "f",
                            "bp": "e",
                            "id": flow,
                            "pid": pid,
                            "tid": tid,
                            "ts": us(a - w.offset),
                        }
                    )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_s": origin, "moves": [{"label": m.label, "op": m.op} for m in moves]},
    }


def check_trace_path(path: "str | os.PathLike") -> Path:
    """``path`` as a :class:`Path` if a trace can be written there, else ``ValueError`` saying why
    (the CLI checks ``--trace`` before anything runs)."""
    return check_output_file(path, "trace path")


def write_chrome_trace(path: "str | os.PathLike", moves: Sequence[MoveTrace]) -> Path:
    """Write :func:`chrome_trace` of ``moves`` to ``path`` atomically
    (:func:`realloc.atomic_files.atomic_write`: a failure never leaves a half-written or destroyed trace)."""
    path = check_trace_path(path)
    atomic_write(path, json.dumps(chrome_trace(moves)).encode())
    return path


def _meta(kind: str, pid: int, tid: int | None, value) -> dict:
    event = {
        "name": kind,
        "ph": "M",
        "pid": pid,
        "args": {"sort_index" if kind.endswith("sort_index") else "name": value},
    }
    if tid is not None:
        event["tid"] = tid
    return event
