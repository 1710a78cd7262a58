"""Driver side of local checkpoints: save with clique replication, find, load (restore or reshard),
and Hugging Face import/export, for one :class:`~actors.driver.group.ModelGroup`.

Example (a running group)::

    manager = CheckpointManager(group, run_id="ppo-7b", factor=2)   # jump = workers per node
    manager.save(100)                                  # sync: written and replicated on return
    handle = manager.save(200, is_async=True)          # training goes on...
    handle.wait()                                      # ...replication runs here
    group.replace_dead_workers()                       # after a node loss
    manager.load()                                     # newest complete iteration, current layout
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray

from actors import metrics
from actors.errors import HookError, ReallocationError
from actors.lanes import MOVE
from actors.records import CheckpointFault, ExchangeReport, PhaseResult, ShardChange, WorkerReport
from actors.remote import Deadline, each_result, fire, gather
from actors.wire.shares import PeerView, worker_shares
from realloc._checks import check_finite
from realloc.ckpt.catalog import Catalog
from realloc.ckpt.errors import CheckpointError, MissingShardsError
from realloc.ckpt.hf import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_BYTES,
    GENERATION_CONFIG_FILE,
    begin_hf_dir,
    check_declared_format,
    check_export_dir,
    check_max_shard_bytes,
    check_ties,
    finish_hf_dir,
    match_spec,
    scan_hf_dir,
)
from realloc.ckpt.hf_export import assign_writers, check_reported
from realloc.ckpt.local_store import NodeStore, default_root
from realloc.ckpt.manifest import Manifest, check_iteration, check_run_id, param_table
from realloc.ckpt.replication import cliques, file_table, files_read_by, rank_of, replication_groups, retrieval_groups
from realloc.ckpt.reshard import assign_readers, reshard_groups
from realloc.plan import Plan, plan_exchange
from realloc.progress import Progress, phase_summary, plan_summary
from realloc.spec import hf_config_of
from realloc.spec.hf_config import canonical_json, check_config_fits, generation_config_of

log = logging.getLogger(__name__)

#: Disk reads and writes of big models outlast the group's collective timeout.
MIN_IO_TIMEOUT_S = 600.0
#: Rounds of "read, find a corrupt copy, re-plan around it" before giving up.
MAX_READ_ROUNDS = 8


@dataclass
class SaveStats:
    """What one save did (seconds are wall time on the driver)."""

    iteration: int
    write_seconds: float
    replicate_seconds: float
    total_seconds: float
    bytes_written: int
    bytes_replicated_inter_node: int
    bytes_replicated_intra_node: int
    replica_files: int
    removed_iterations: list[int]
    worker_write_seconds: float = 0.0  # slowest worker: serialise, checksum, write (in the background if async)
    replica_check_write_seconds: float = 0.0  # slowest worker: sha256 of received files + atomic writes

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadStats:
    """What one load did. ``method``: ``"restore"`` (rank files, same layout) or ``"reshard"``."""

    iteration: int
    method: str
    scan_seconds: float
    read_seconds: float
    plan_seconds: float
    exchange_seconds: float
    total_seconds: float
    bytes_read: int
    bytes_local: int
    bytes_intra_node: int
    bytes_inter_node: int
    corrupt_copies: list[str] = field(default_factory=list)
    max_reader_bytes: int = 0
    install_seconds: float = 0.0  # slowest worker: checksum and install after the transfers

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class HFExportStats:
    """What one :meth:`CheckpointManager.export_hf` did. ``files``: per weight file, in index
    order, ``{name, bytes, sha256, tensors, writer, node}`` as its writer reported it."""

    path: str
    files: list[dict]
    writers: list[int]
    plan_seconds: float
    exchange_seconds: float  # transfers and the writers' file writes
    write_seconds: float  # slowest writer's file writes
    total_seconds: float
    bytes_written: int
    bytes_local: int
    bytes_intra_node: int
    bytes_inter_node: int
    max_writer_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


class SaveHandle:
    """A save in progress; :meth:`wait` finishes it (writes, then replication, then removal of the
    run's other iterations)."""

    def __init__(
        self,
        manager: "CheckpointManager",
        iteration: int,
        refs: list,
        started: float,
        is_async: bool,
        progress: Progress,
        finish: Callable[["SaveHandle"], "SaveStats"],
    ):
        self.manager, self.iteration, self.is_async = manager, iteration, is_async
        #: the workers' calls that answer when their write ended, with its manifest (sync:
        #: ``ckpt_save``; async: ``ckpt_save_result``, on the workers' save thread), when the save
        #: started (``time.perf_counter()``), and its start and end records and bars
        self.refs, self.started, self.progress = refs, started, progress
        self._finish = finish  # the manager's replication and removal, under the group's lock
        self._stats, self._error = None, None

    def done(self) -> bool:
        """Whether every worker's write ended, written or failed (replication still runs in
        :meth:`wait`). Does not block: it looks at the workers' answers to their writes."""
        if self._stats is not None or self._error is not None:
            return True
        return not ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[1]

    def wait(self) -> SaveStats:
        """Finish the save; raises :class:`CheckpointError` (files of this iteration removed) on failure."""
        if self._error is not None:
            raise self._error
        if self._stats is None:
            try:
                self._stats = self._finish(self)
                metrics.record_checkpoint(self.manager.group.name, "save", self._stats)
            except BaseException as exc:
                if isinstance(exc, CheckpointError):
                    self._error = exc
                self.progress.fail(exc)
                raise
        return self._stats


class CheckpointManager:
    """Local checkpoints of ``group`` under ``root/<run_id>/<node id>/``.

    ``jump``/``factor``: clique replication (default jump = workers per node, so the ``factor``
    copies of a file sit on different nodes); ``factor=1`` keeps only the writer's copy.
    ``run_id`` (default: a fresh random one) is checked on every file loaded: pass the same id to
    resume a run. ``root`` defaults to ``$REALLOC_CKPT_ROOT`` or ``/dev/shm/realloc-ckpt``.

    Example:
        >>> manager = CheckpointManager(group, run_id="demo", factor=2)  # doctest: +SKIP
        >>> manager.save(1).wait().bytes_replicated_inter_node > 0       # doctest: +SKIP
        True
    """

    def __init__(
        self,
        group,
        root: "str | Path | None" = None,
        run_id: str | None = None,
        jump: int | None = None,
        factor: int = 2,
        timeout_s: float | None = None,
    ):
        if root is not None and not isinstance(root, (str, Path)):
            raise ValueError(f"root must be a path, got {type(root).__name__}")
        if root is not None and (not str(root).strip() or not Path(root).is_absolute()):
            raise ValueError(
                f"root must be an absolute directory path (each worker resolves it on its own node), got {str(root)!r}"
            )
        if timeout_s is not None:
            check_finite("timeout_s", timeout_s, positive=True, allowed="a finite positive number of seconds")
        self.group = group
        self.root = Path(root) if root is not None else default_root()
        self.run_id = check_run_id(run_id) if run_id is not None else uuid.uuid4().hex[:12]
        self.jump = group.placement.per_node() if jump is None else jump
        self.factor = factor
        self.cliques = cliques(group.num_workers, self.jump, factor)  # ValueError on a bad J/F
        self.timeout_s = float(timeout_s) if timeout_s is not None else max(group.timeout_s, MIN_IO_TIMEOUT_S)
        self._pending: SaveHandle | None = None
        self._last_saved: int | None = None
        self.last_hf_export: HFExportStats | None = None

    # -- paths -----------------------------------------------------------------------------
    def node_dir(self, node: str) -> Path:
        """This run's directory on ``node`` (tests and demos inspect or damage it)."""
        return NodeStore(self.root, self.run_id, node).dir

    # -- save ------------------------------------------------------------------------------
    def save(self, iteration: int, is_async: bool = False, *, fault: CheckpointFault | None = None) -> SaveHandle:
        """Write every rank's shards to its node and replicate them to its clique.

        Sync: returns a finished handle. Async: returns once every worker has snapshotted its
        buffers (training may then change them); ``handle.wait()`` finishes the writes, runs the
        replication plan and removes older iterations. ``fault`` is a test hook.

        Example:
            >>> stats = manager.save(10).wait()  # doctest: +SKIP
        """
        check_iteration(iteration)
        if not isinstance(is_async, bool):
            raise ValueError(f"is_async must be True or False, got {is_async!r}")
        if fault is not None and not (isinstance(fault, CheckpointFault) and fault.rank < self.group.num_workers):
            raise ValueError(
                f"fault must be a CheckpointFault for a rank below {self.group.num_workers}, got {fault!r}"
            )
        self._model_dtypes("save")
        g = self.group
        # The order check and the save run under one hold of the group's lock: a save racing in from
        # another thread sees the iteration this one saved (and its removal of older ones) or waits.
        with g.ledger.exclusive(f"save iteration {iteration}"):
            self._finish_pending()
            if self._last_saved is not None and iteration <= self._last_saved:
                raise ValueError(
                    f"iteration {iteration} is not after the last saved iteration {self._last_saved}; "
                    "iterations of a run must increase"
                )
            prog = Progress(
                log, f"checkpoint save of iteration {iteration} (run {self.run_id}, {'async' if is_async else 'sync'})"
            )
            started = time.perf_counter()
            try:
                refs = [
                    a.ckpt_save.remote(
                        str(self.root),
                        self.run_id,
                        iteration,
                        is_async,
                        fault if fault is not None and fault.rank == r else None,
                    )
                    for r, a in enumerate(g.actors)
                ]
                if is_async:
                    try:  # the acknowledgements: every snapshot is taken
                        self._get(refs, f"save iteration {iteration}: snapshot")
                    except ReallocationError as exc:
                        self._abort_save(iteration, exc, refs, acknowledged=True)
                    # An acknowledgement is not the write: each worker's answer on its save thread is
                    # (the default thread stays free for training meanwhile).
                    refs = [a.ckpt_save_result.remote(iteration) for a in g.actors]
                handle = SaveHandle(self, iteration, refs, started, is_async, prog, self._finish_save)
                if is_async:
                    self._pending = handle
                else:
                    handle.wait()
            except BaseException as exc:
                prog.fail(exc)  # logs once: a failed wait() already did
                raise
        return handle

    def _finish_save(self, handle: SaveHandle) -> SaveStats:
        with self.group.ledger.exclusive(f"save iteration {handle.iteration}"):
            return self._finish_save_locked(handle)

    def _finish_save_locked(self, handle: SaveHandle) -> SaveStats:
        g, iteration, prog = self.group, handle.iteration, handle.progress
        refs = handle.refs
        try:
            # The rank files' tensor bytes: their headers add a little, counted as each one is written.
            prog.step("write rank files", sum(g.layout.rank_bytes(r) for r in range(g.num_workers)))
            with each_result(lambda _, res: prog.advance(res["manifest"].file_bytes)):
                results = self._get(refs, f"save iteration {iteration}: write rank files")
            written = time.perf_counter()
            manifests: dict[int, Manifest] = {res["rank"]: res["manifest"] for res in results}
            file_bytes = {r: m.file_bytes for r, m in manifests.items()}
            holdings, needs = replication_groups(file_bytes, g.placement, self.jump, self.factor)
            moved = {"intra": 0, "inter": 0}
            finish = 0.0
            if needs:
                plan = self._plan(holdings, needs, file_table(file_bytes))
                incoming: dict[int, dict[int, Manifest]] = defaultdict(dict)
                for need in needs:
                    for param, _, _ in need.pieces:
                        incoming[need.workers[0]][rank_of(param)] = manifests[rank_of(param)]
                payloads = [
                    {
                        "iteration": iteration,
                        "root": str(self.root),
                        "run_id": self.run_id,
                        "incoming": incoming.get(w, {}),
                    }
                    for w in range(g.num_workers)
                ]
                exchanged = self._exchange(plan, "replicate", payloads, f"save iteration {iteration}: replicate", prog)
                finish = max(res.finish_seconds for res in exchanged)
                replicated_bytes = _moved(exchanged)
                moved = {"intra": replicated_bytes.bytes_intra_node, "inter": replicated_bytes.bytes_inter_node}
            else:
                self._call_all("ckpt_forget", f"save iteration {iteration}")
            replicated = time.perf_counter()
        except ReallocationError as exc:
            self._abort_save(iteration, exc, refs)
        finally:
            self._pending = None
        self._last_saved = iteration  # written and replicated: the save stands from here
        try:  # the older iterations go; a node that fails this keeps them, and loses nothing
            removed = self._on_nodes("ckpt_cleanup", f"save iteration {iteration}: remove others", keep=iteration)
        except ReallocationError as exc:
            log.warning(
                "checkpoint save of iteration %d is written and replicated; removing older iterations failed (%s): "
                "the next save removes them",
                iteration,
                exc,
            )
            removed = []
        stats = SaveStats(
            iteration=iteration,
            write_seconds=written - handle.started,
            replicate_seconds=replicated - written,
            total_seconds=time.perf_counter() - handle.started,
            bytes_written=sum(file_bytes.values()),
            bytes_replicated_inter_node=moved["inter"],
            bytes_replicated_intra_node=moved["intra"],
            replica_files=len(needs),
            removed_iterations=sorted({i for r in removed for i in r}),
            worker_write_seconds=max(res["seconds"] for res in results),
            replica_check_write_seconds=finish,
        )
        prog.nbytes = stats.bytes_written
        prog.detail = (
            f"{len(results)} rank files written in {stats.write_seconds:.3f} s, "
            f"{stats.replica_files} replicas ({moved['inter']} bytes inter-node, {moved['intra']} intra-node) "
            f"in {stats.replicate_seconds:.3f} s"
        )
        prog.end()
        return stats

    def _abort_save(self, iteration: int, cause: Exception, refs: list, acknowledged: bool = False) -> None:
        """Let in-flight writes end, delete the iteration on every live node, raise.

        ``refs``: the workers' calls that end with their writes, or (``acknowledged``, an async
        save whose snapshots failed) their acknowledgements of the snapshots: a worker whose
        snapshot was taken is writing in its background thread, which its ``ckpt_save_result``
        (on its save thread) waits for. Removing the iteration before those writes ended would
        let them put its files back. All of it within one deadline (``timeout_s``)."""
        g = self.group
        deadline = Deadline(self.timeout_s)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline.remaining())
        late = [r for r, ref in enumerate(refs) if ref not in ready]
        if acknowledged:  # a rank that answered (or failed) its snapshot has no write left to start
            started = [r for r, ref in enumerate(refs) if ref in ready]
            writes = [g.actors[r].ckpt_save_result.remote(iteration) for r in started]
            done, _ = ray.wait(writes, num_returns=len(writes), timeout=deadline.remaining())
            late += [r for r, ref in zip(started, writes) if ref not in done]
        dead = set(g.dead_workers())
        live = [r for r in range(g.num_workers) if r not in dead]
        try:
            self._on_nodes("ckpt_cleanup", f"clean up failed save {iteration}", only=iteration, ranks=live)
            gather(
                g.workers.subset(live),
                [g.actors[r].ckpt_forget.remote() for r in live],
                g.timeout_s,
                "clean up failed save",
                layout=str(g.layout),
            )
        except ReallocationError:
            pass  # best effort: a later successful save removes older leftovers
        self._pending = None
        previous = (
            f"iteration {self._last_saved} stays loadable"
            if self._last_saved is not None
            else "earlier iterations are untouched"
        )
        unsettled = sorted(set(late) - dead)
        still = (
            f" (ranks {unsettled} were still writing after {self.timeout_s:.0f}s: a file they finish later is "
            "an incomplete iteration, which loads ignore and the next successful save removes)"
            if unsettled
            else ""
        )
        raise CheckpointError(
            f"save of iteration {iteration} (run {self.run_id}) failed and was removed from the "
            f"live nodes{still}; {previous}. Cause: {cause}"
        ) from cause

    def _finish_pending(self) -> None:
        if self._pending is not None:
            self._pending.wait()

    # -- find and load ---------------------------------------------------------------------
    def catalog(self, iterations: list[int] | None = None) -> Catalog:
        """Usable rank files of this run on the nodes that host live workers (one listing per node)."""
        listings = self._on_nodes("ckpt_list", "list checkpoints", iterations=iterations)
        return Catalog(listings, self.group.spec)

    def find_latest(self) -> int | None:
        """The newest iteration whose stored shards all have a usable copy on a live node, or None.

        Example:
            >>> manager.find_latest()  # doctest: +SKIP
            200
        """
        self._finish_pending()
        with self.group.ledger.exclusive("find checkpoints"):
            return self.catalog().latest_complete(self.group.spec)

    def load(self, iteration: int | None = None) -> LoadStats:
        """Restore ``iteration`` (default: :meth:`find_latest`) into the group's current layout.

        Same layout and every rank file available: each rank gets its own file, from its node's
        directory when there, else from replicas (planner: local first, senders balanced). Any
        other case (another layout, lost rank files whose shards survive in dp twins): each stored
        shard is read once by a balanced reader and the planner moves it where it is needed.
        Raises :class:`MissingShardsError` naming the shards no live node has.
        """
        if iteration is not None:
            check_iteration(iteration)
        self._model_dtypes("load")
        self._finish_pending()
        which = "the newest iteration" if iteration is None else f"iteration {iteration}"
        with Progress(log, f"checkpoint load of {which} (run {self.run_id})") as prog:
            try:
                with self.group.ledger.exclusive("load checkpoint"):
                    stats = self._load(iteration, prog)
            except HookError:
                raise  # the load committed; a user hook failed after it, as after any other change
            except CheckpointError:
                fire(self.group.workers, "ckpt_forget")  # what its reads cached; the weights are as before
                raise
            except ReallocationError as exc:
                fire(self.group.workers, "ckpt_forget")  # dead workers cannot answer
                raise CheckpointError(f"load of run {self.run_id} failed: {exc}") from exc
            prog.nbytes = stats.bytes_read
            prog.detail = (
                f"iteration {stats.iteration} by {stats.method}, then {stats.bytes_inter_node} bytes moved "
                f"inter-node, {stats.bytes_intra_node} intra-node, {stats.bytes_local} locally"
                + (f"; {len(stats.corrupt_copies)} corrupt copies skipped" if stats.corrupt_copies else "")
            )
        metrics.record_checkpoint(self.group.name, stats.method, stats)
        return stats

    def _load(self, iteration: int | None, prog: Progress) -> LoadStats:
        g = self.group
        started = time.perf_counter()
        catalog = self.catalog(None if iteration is None else [iteration])
        nodes = sorted(set(g.placement.nodes))
        if iteration is None:
            iteration = catalog.latest_complete(g.spec)
            if iteration is None:
                newest = catalog.iterations()[-1] if catalog.iterations() else None
                missing = catalog.missing(newest, g.spec) if newest is not None else []
                detail = f"; newest partial iteration {newest} lacks {missing[:3]}" if newest is not None else ""
                raise MissingShardsError(
                    f"no complete checkpoint of run {self.run_id} under {self.root} on the live nodes {nodes}{detail}",
                    missing,
                )
        missing = catalog.missing(iteration, g.spec)
        if missing:
            raise MissingShardsError(
                f"iteration {iteration} of run {self.run_id} cannot be loaded: {len(missing)} stored shards have no "
                f"usable copy on the live nodes {nodes}, e.g. {missing[:3]} (unusable files: {catalog.problems[:3]})",
                missing,
            )
        scanned = time.perf_counter()
        reference = catalog.any_manifest(iteration)
        # The workers cache what this load reads for its rounds and its exchange, under this id: what
        # an earlier load read (one that failed after its reads) is never taken for this one's.
        load_id = uuid.uuid4().hex
        if reference.layout(g.spec) == g.layout and len(catalog.usable(iteration)) == g.num_workers:
            stats = self._restore(iteration, catalog, prog, load_id)
        else:
            stats = self._reshard(iteration, catalog, set(), [], prog, load_id)
        stats.scan_seconds = scanned - started
        stats.total_seconds = time.perf_counter() - started
        return stats

    def _restore(self, iteration: int, catalog: Catalog, prog: Progress, load_id: str) -> LoadStats:
        """Each rank gets its own file. Per rank, copies are tried in the catalog's order of
        candidates; a copy whose bytes fail its own checksums is excluded and the next round
        re-plans without it (a disagreeing manifest never outvotes an intact copy)."""
        g = self.group
        excluded: set[tuple[str, int]] = set()
        corrupt: list[str] = []
        read_bytes, read_seconds, plan_seconds = 0, 0.0, 0.0
        for _ in range(MAX_READ_ROUNDS):
            usable = catalog.usable(iteration, excluded)
            if len(usable) < g.num_workers:
                # A rank lost every copy: its shards may survive in a dp twin's file.
                return self._reshard(iteration, catalog, excluded, corrupt, prog, load_id)
            manifests = {r: c.manifest for r, c in usable.items()}
            file_bytes = {r: m.file_bytes for r, m in manifests.items()}
            t0 = time.perf_counter()
            holdings, needs = retrieval_groups(
                {r: c.nodes for r, c in usable.items()}, file_bytes, g.placement, range(g.num_workers)
            )
            plan = self._plan(holdings, needs, file_table(file_bytes))
            t1 = time.perf_counter()
            reads = files_read_by(plan)
            workers = sorted(reads)
            prog.step("read rank files", sum(file_bytes[r] for rs in reads.values() for r in rs))
            with each_result(lambda _, res: prog.advance(res["bytes"])):
                results = self._get(
                    [
                        g.actors[w].ckpt_read_files.remote(
                            str(self.root), self.run_id, {r: manifests[r] for r in reads[w]}, load_id
                        )
                        for w in workers
                    ],
                    "load: read rank files",
                    ranks=workers,
                )
            plan_seconds += t1 - t0
            read_seconds += time.perf_counter() - t1
            read_bytes += sum(res["bytes"] for res in results)
            bad = [
                (g.placement.nodes[w], r, reason)
                for w, res in zip(workers, results)
                for r, reason in res["bad"].items()
            ]
            if not bad:
                break
            fire(g.workers, "ckpt_forget")  # the next round reads other copies, maybe of other candidates
            excluded |= {(n, r) for n, r, _ in bad}
            corrupt += [f"{n}: rank {r} file: {reason}" for n, r, reason in bad]
        else:
            raise CheckpointError(
                f"load of iteration {iteration}: still finding corrupt copies after "
                f"{MAX_READ_ROUNDS} rounds: {corrupt[:5]}"
            )
        payloads = [{"incoming": {w: manifests[w]}} for w in range(g.num_workers)]
        t0 = time.perf_counter()
        results = self._exchange(plan, "restore", payloads, f"load iteration {iteration}", prog)
        return self._load_stats(
            iteration,
            "restore",
            results,
            time.perf_counter() - t0,
            read_bytes,
            read_seconds,
            plan_seconds,
            corrupt,
            max((sum(file_bytes[r] for r in rs) for rs in reads.values()), default=0),
        )

    def _reshard(
        self,
        iteration: int,
        catalog: Catalog,
        excluded: set[tuple[str, int]],
        corrupt: list[str],
        prog: Progress,
        load_id: str,
    ) -> LoadStats:
        """Each stored box is read once (crc-checked) by a balanced reader, then planned into the
        current layout. Every candidate of a rank stores the same boxes (the catalog checked each
        manifest against its layout), so boxes already read stay valid when a copy is excluded."""
        g = self.group
        read_bytes, read_seconds, plan_seconds = 0, 0.0, 0.0
        keep: list = []
        for _ in range(MAX_READ_ROUNDS):
            t0 = time.perf_counter()
            usable = catalog.usable(iteration, excluded)
            # A rank whose every copy failed its checks drops out of ``usable``, and its boxes out of
            # what the readers must cover: unless a dp twin's file (or an earlier round) has them,
            # they are lost, and the load stops here, before any weight changes.
            lost = catalog.missing(iteration, g.spec, excluded, read=[t.key for t in keep])
            if lost:
                self._lost_shards(iteration, catalog, usable, excluded, lost, corrupt)
            manifests = {r: c.manifest for r, c in usable.items()}
            assignment = assign_readers(
                {r: m.shards for r, m in manifests.items()},
                {r: c.nodes for r, c in usable.items()},
                g.placement,
                exclude=excluded,
                keep=keep,
            )
            plan_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            workers = sorted(w for w, ts in assignment.tasks.items() if ts)
            prog.step("read stored shards", sum(t.nbytes for w in workers for t in assignment.tasks[w]))
            with each_result(lambda _, res: prog.advance(res["bytes"])):
                results = self._get(
                    [
                        g.actors[w].ckpt_read_boxes.remote(
                            str(self.root), self.run_id, assignment.tasks[w], manifests, load_id
                        )
                        for w in workers
                    ],
                    "load: read stored shards",
                    ranks=workers,
                )
            read_seconds += time.perf_counter() - t0
            read_bytes += sum(res["bytes"] for res in results)
            bad = [task for res in results for task, _ in res["bad"]]
            if not bad:
                break
            corrupt += [f"{t.node}: rank {t.rank} file: {reason}" for res in results for t, reason in res["bad"]]
            excluded |= {(t.node, t.rank) for t in bad}
            failed = set(bad)
            keep = [t for t in assignment.all() if t not in failed]
        else:
            raise CheckpointError(
                f"load of iteration {iteration}: still finding corrupt copies after "
                f"{MAX_READ_ROUNDS} rounds: {corrupt[:5]}"
            )
        t0 = time.perf_counter()
        holdings, needs = reshard_groups(assignment, g.layout)
        plan = self._plan(holdings, needs, param_table(g.spec))
        plan_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        results = self._exchange(
            plan, "reshard", [{} for _ in range(g.num_workers)], f"load iteration {iteration}", prog
        )
        return self._load_stats(
            iteration,
            "reshard",
            results,
            time.perf_counter() - t0,
            read_bytes,
            read_seconds,
            plan_seconds,
            corrupt,
            max(assignment.loads().values(), default=0),
        )

    def _lost_shards(
        self,
        iteration: int,
        catalog: Catalog,
        usable: dict,
        excluded: set[tuple[str, int]],
        lost: list[str],
        corrupt: list[str],
    ) -> None:
        """Raise :class:`MissingShardsError` for a load whose corrupt copies left ``lost`` boxes
        with no readable copy (nothing of the load was installed)."""
        g = self.group
        gone = sorted(set(catalog.candidates(iteration)) - set(usable))
        # One line per corrupt copy of those ranks: its first failure (a copy fails once per box read).
        copies = [
            next((c for c in corrupt if c.startswith(f"{n}: rank {r} file:")), f"{n}: rank {r} file")
            for n, r in sorted(excluded, key=lambda c: (c[1], c[0]))
            if r in gone
        ]
        raise MissingShardsError(
            f"iteration {iteration} of run {self.run_id} cannot be loaded: every copy of the files of ranks "
            f"{gone} failed its checks when read ({len(copies)} corrupt copies: {copies[:8]}), so {len(lost)} "
            f"stored shards have no usable copy on the live nodes {sorted(set(g.placement.nodes))}, e.g. "
            f"{lost[:3]}. Nothing was loaded: group {g.name!r} keeps its weights and layout {g.layout.topology}",
            lost,
        )

    @staticmethod
    def _load_stats(
        iteration: int,
        method: str,
        results: list[ExchangeReport],
        exchange_seconds: float,
        read_bytes: int,
        read_seconds: float,
        plan_seconds: float,
        corrupt: list[str],
        max_reader: int,
    ) -> LoadStats:
        moved = _moved(results)
        return LoadStats(
            iteration=iteration,
            method=method,
            scan_seconds=0.0,
            read_seconds=read_seconds,
            plan_seconds=plan_seconds,
            exchange_seconds=exchange_seconds,
            total_seconds=0.0,
            bytes_read=read_bytes,
            bytes_local=moved.bytes_local,
            bytes_intra_node=moved.bytes_intra_node,
            bytes_inter_node=moved.bytes_inter_node,
            corrupt_copies=corrupt,
            max_reader_bytes=max_reader,
            install_seconds=max(r.finish_seconds for r in results),
        )

    # -- Hugging Face ----------------------------------------------------------------------
    def _model_dtypes(self, what: str) -> None:
        """``ValueError`` (before any traffic) for checkpoints of a group in another weight format."""
        fmt = self.group.spec.weight_format
        if fmt is not None:
            raise ValueError(
                f"{what}: group {self.group.name!r} holds weight format {fmt!r}; node-local checkpoints and HF "
                "exports hold a model's own dtypes (use the group it was copied from; import_hf reads "
                "block-FP8 checkpoints into it)"
            )

    def import_hf(self, path: "str | Path") -> dict:
        """Load a HF safetensors directory (visible at ``path`` on every node) into the current layout.

        Checked on the driver first, before any traffic (``ValueError``): every tensor present
        with the model's shape, no change of dtype kind (float dtypes are cast, integers never
        become floats), and a checkpoint that holds both names of a tied pair holds the same
        bytes under both (:func:`~realloc.ckpt.hf.check_ties`); tensors read as the format their
        dtypes and ``config.json`` say, both agreeing (a ``*_scale_inv`` only beside a float8 weight:
        :func:`~realloc.ckpt.hf.match_spec`, :func:`~realloc.ckpt.hf.check_declared_format`). Each rank then reads only its own
        slices, checking that each tensor is still what the driver scanned; a file changed in
        between fails the import (:class:`~actors.errors.ReallocationError`, the weights as before).

        Example:
            >>> manager.import_hf("/models/llama-7b")  # doctest: +SKIP
        """
        self._finish_pending()
        g = self.group
        with Progress(log, f"HF import from {path}") as prog:
            tensors = scan_hf_dir(path)
            mapping = match_spec(tensors, g.spec)
            check_declared_format(path, tensors, g.spec)
            check_ties(path, tensors, g.spec)
            started = time.perf_counter()
            prog.step("read shards", sum(s.nbytes for r in range(g.num_workers) for s in g.layout.shards(r)))
            read = g.fill(
                f"import HF checkpoint {path}",
                "hf",
                str(path),
                tensors,
                mapping,
                timeout_s=self.timeout_s,
                on_result=lambda _, nbytes: prog.advance(nbytes),
            )
            stats = {"bytes_read": sum(read), "seconds": time.perf_counter() - started}
            prog.nbytes = stats["bytes_read"]
            prog.detail = f"{len(tensors)} tensors into layout {g.layout.topology} on {g.num_workers} workers"
            metrics.record_checkpoint(g.name, "import_hf", stats)
        return stats

    def export_hf(
        self,
        path: "str | Path",
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        config: "dict | None" = None,
        generation_config: "dict | None" = None,
        *,
        writers: int | None = None,
    ) -> list[Path]:
        """Write the model as a HF directory that ``AutoModelForCausalLM.from_pretrained`` loads.

        Written: the weight files (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
        of at most ``max_shard_bytes`` tensor bytes each plus ``model.safetensors.index.json``),
        ``config.json`` (``config``, default :func:`~realloc.spec.hf_config.hf_config_of` of the spec:
        the HF config it was made from, or one derived from its parameters) and
        ``generation_config.json`` (``generation_config``, default the config's bos/eos/pad ids;
        none when it has none). The tied head is not written.

        Each tensor is assembled whole on one writer worker (``writers`` of them, default: as many
        as the files; :mod:`realloc.ckpt.hf_export`) by one planned exchange from the current
        layout, and the writers write their files on their own nodes: with workers on several
        nodes ``path`` must be one shared directory. The driver holds no tensor; it writes the
        JSON files, the index last.

        Nothing at ``path`` changes until the new export is complete: the files go into a staging
        directory beside it, which is verified (every file there with the size planned, its
        header naming its tensors, the index naming only those files) and then swapped in whole;
        other files at ``path`` (a tokenizer) are kept. A failed export (a full disk, a read-only
        or vanished directory, a dead worker) raises :class:`~realloc.ckpt.errors.CheckpointError`
        naming the directory and what to do, and leaves what was there as it was; ``ValueError``
        for bad arguments (``path`` an existing file) before any traffic. Returns the paths
        written; what each writer did is in :attr:`last_hf_export`.

        Example:
            >>> manager.export_hf("/shared/out", max_shard_bytes=2 << 30)  # doctest: +SKIP
        """
        self._model_dtypes("export")
        check_max_shard_bytes(max_shard_bytes)
        target = check_export_dir(path)
        g = self.group
        config = hf_config_of(g.spec) if config is None else check_config_fits(config, g.spec)
        if config.get("quantization_config") is not None:
            raise ValueError(
                f"config declares a quantization_config ({config['quantization_config']!r}), but the export writes "
                "the weights in the model's dtypes: from_pretrained would read them as quantized; drop the key"
            )
        if generation_config is None:
            generation_config = generation_config_of(config)
        elif not isinstance(generation_config, dict):
            raise ValueError(f"generation_config must be a dict, got {type(generation_config).__name__}")
        else:
            generation_config = json.loads(canonical_json(generation_config, "generation_config"))
        self._finish_pending()
        with Progress(log, f"HF export to {target}") as prog:
            written = self._export_hf(target, max_shard_bytes, config, generation_config, writers, prog)
            stats = self.last_hf_export
            prog.nbytes = stats.bytes_written
            prog.detail = (
                f"{len(stats.files)} files by {len(stats.writers)} writers, "
                f"{stats.bytes_inter_node} bytes moved inter-node, {stats.bytes_intra_node} intra-node"
            )
        return written

    def _export_hf(
        self, target: Path, max_shard_bytes: int, config: dict, generation_config: dict, writers, prog: Progress
    ) -> list[Path]:
        g = self.group
        started = time.perf_counter()
        with g.ledger.exclusive(f"export HF checkpoint {target}"):
            assignment = assign_writers(g.layout, g.placement, max_shard_bytes, writers)
            plan = self._plan(g.layout.groups(), assignment.needs(), param_table(g.spec))
            arenas = {w: assignment.arena(w) for w in assignment.writers}
            planned = time.perf_counter()
            staged = begin_hf_dir(target)
            try:
                payloads = [{"root": str(staged.path), "arena": arenas.get(w)} for w in range(g.num_workers)]
                prog.step("transfer and write files", sum(f.nbytes for f in assignment.files))
                try:
                    results = self._exchange(plan, "export", payloads, f"export HF checkpoint to {target}", prog)
                except ReallocationError as exc:
                    raise CheckpointError(
                        f"HF export to {str(target)!r} failed; what was there before is unchanged. Cause: {exc}"
                    ) from exc
                exchanged = time.perf_counter()
                reports = [f for res in results for f in res.files]
                check_reported(assignment, reports)
            except BaseException:
                staged.discard()
                raise
            order = [f.name for f in assignment.files]
            reports.sort(key=lambda f: order.index(f["name"]))
            expected = {f.name: (f.nbytes, f.tensors) for a in arenas.values() for f in a.files}
            extra = {CONFIG_FILE: config, **({GENERATION_CONFIG_FILE: generation_config} if generation_config else {})}
            written = finish_hf_dir(
                staged, {n: expected[n] for n in order}, assignment.weight_map(), g.spec.total_bytes(), extra
            )
        moved = _moved(results)
        self.last_hf_export = HFExportStats(
            path=str(target),
            files=reports,
            writers=assignment.writers,
            plan_seconds=planned - started,
            exchange_seconds=exchanged - planned,
            write_seconds=max(res.finish_seconds for res in results),
            total_seconds=time.perf_counter() - started,
            bytes_written=sum(f["bytes"] for f in reports),
            bytes_local=moved.bytes_local,
            bytes_intra_node=moved.bytes_intra_node,
            bytes_inter_node=moved.bytes_inter_node,
            max_writer_bytes=max(assignment.loads().values()),
        )
        metrics.record_checkpoint(g.name, "export_hf", self.last_hf_export)
        return written

    # -- plumbing --------------------------------------------------------------------------
    def _plan(self, holdings, needs, params) -> Plan:
        config = self.group.config
        return plan_exchange(
            holdings,
            needs,
            self.group.placement,
            params,
            bucket_bytes=config.bucket_bytes,
            bandwidths=config.bandwidths,
        )

    def _exchange(self, plan: Plan, mode: str, payloads: list[dict], what: str, prog: Progress) -> list[ExchangeReport]:
        """Run a checkpoint plan on every worker. ``restore``/``reshard`` write new weights, so they
        run as one operation of the protocol (prepare, exchange, commit, or abort everywhere);
        ``replicate``/``export`` only read them.

        ``prog`` counts each worker's part as it finishes: the bytes it received (an export: the
        bytes of the files it wrote, in the step its caller started); DEBUG records give the
        plan's statistics and the slowest worker's seconds."""
        results = self._run_exchange(plan, mode, payloads, what, prog)
        log.debug(
            "%s: %s; slowest: %s",
            what,
            mode,
            phase_summary([{"exchange": r.seconds, "finish": r.finish_seconds} for r in results]),
        )
        return results

    def _run_exchange(
        self, plan: Plan, mode: str, payloads: list[dict], what: str, prog: Progress
    ) -> list[ExchangeReport]:
        g = self.group
        log.debug("%s: %s plan: %s", what, mode, plan_summary(plan.stats))
        if mode == "export":
            progress = each_result(lambda _, res: prog.advance(sum(f["bytes"] for f in res.files)))
        else:
            prog.step(mode, plan.stats.get("bytes_total", 0) + plan.stats.get("bytes_local_copy", 0))
            progress = each_result(lambda _, res: prog.advance(sum(res.bytes.values())))
        world = g.world_for(MOVE)
        peers = [PeerView(world.rank_of(a), g.placement.nodes[i], None, None) for i, a in enumerate(g.actors)]
        plan.validate(g.num_workers)
        shares = [ray.put(share) for share in worker_shares(plan, peers)]
        if mode in ("replicate", "export"):  # no weights change: no operation
            refs = [
                a.ckpt_exchange.remote(None, world.id, [shares[i]], i, mode, payloads[i])
                for i, a in enumerate(g.actors)
            ]
            try:
                with progress:
                    return self._get(refs, what)
            except ReallocationError:
                world.mark_broken()
                fire(g.workers, "ckpt_forget")
                raise
        op = g.weights_operation(f"{what} (run {self.run_id})", self.timeout_s)
        op.prepare()
        try:
            with progress:
                results = op.call(
                    [
                        a.ckpt_exchange.remote(op.id, world.id, [shares[i]], i, mode, payloads[i])
                        for i, a in enumerate(g.actors)
                    ],
                    "exchange",
                )
        except ReallocationError:
            world.mark_broken()
            raise
        op.commit()
        g.announce(ShardChange("load", g.layout, g.layout))
        return results

    def _get(self, refs: list, what: str, ranks: list[int] | None = None) -> list[Any]:
        g = self.group
        workers = g.workers if ranks is None else g.workers.subset(ranks)
        return gather(workers, refs, self.timeout_s, what, layout=str(g.layout))

    def _call_all(self, method: str, what: str, *args: Any) -> list[Any]:
        return self._get([getattr(a, method).remote(*args) for a in self.group.actors], what)

    def _on_nodes(self, method: str, what: str, ranks: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` once per node that hosts one of ``ranks`` (default: all workers)."""
        g = self.group
        first: dict[str, int] = {}
        for r in range(g.num_workers) if ranks is None else ranks:
            first.setdefault(g.placement.nodes[r], r)
        chosen = sorted(first.values())
        refs = [getattr(g.actors[r], method).remote(str(self.root), self.run_id, **kwargs) for r in chosen]
        return self._get(refs, what, ranks=chosen)


def _moved(results: list[ExchangeReport]) -> PhaseResult:
    """The bytes the workers' exchange reports (``ckpt_exchange``) received, by link kind, summed
    as a move's are (:meth:`~actors.records.PhaseResult.of`)."""
    return PhaseResult.of([WorkerReport(r.bytes) for r in results], timed=False)
