"""realloc as vLLM's trainer-side weight-transfer engine, inside the user's trainer processes.

RL frameworks keep their trainers in their own processes and call vLLM's trainer API on every
rank (vllm/distributed/weight_transfer/base.py ``TrainerWeightTransferEngine``; factory.py
``WeightTransferTrainerFactory``)::

    engine = WeightTransferTrainerFactory.trainer_init(
        ReallocTrainerInitInfo(rank=dist.get_rank()), client=client, source=ShardSource(model))
    ...
    engine.send_weights()          # every rank, each step

Every rank sends only what the plan gives it, from its local shards as they are
(:class:`~actors.trainer.source.ShardSource`): no full tensor is gathered anywhere. Rank 0 also
drives the update (planning, the engine's rounds, deadlines: :class:`~actors.driver.vllm.VLLMEngine`)
with no service to start.

``trainer_init`` (every rank; the only collectives on the trainer's own process group, whose
timeout bounds them): each rank reads its holdings; one ``all_gather_object`` of what each holds
(or why it refuses); rank 0 checks they make one layout, has the engine bake and check its
layout (``VLLMEngine.init``), and hosts a control store; one ``broadcast_object_list`` of the
verdict. A refusal anywhere is the same ``ValueError`` on every rank, before any byte moves.

``send_weights`` (every rank), one round ``k`` through the control store, every wait bounded by
``timeout_s`` and naming who did not answer:

1. rank 0 plans (cached), opens the world's rendezvous, posts ``round/k`` (the world, the
   version, each rank's share) and opens the engine's round: vLLM's workers receive on a thread
   into shadow sets while the engine generates;
2. every rank copies its local shards into its send buffer (its own share of the model, never
   more), joins the world and sends its routes, then posts ``sent/k/<rank>``;
3. rank 0 reads every rank's report and every vLLM worker's outcome; then commits
   (``finish_weight_update(weight_version=...)``: one RPC between two forward steps) and posts
   ``verdict/k``; or, on any failure, posts the error (as ``verdict/k``, and as ``round/k`` if the
   round was not opened yet) and then closes the round (the engine serves its old weights,
   untouched);
4. every rank returns the verdict's version or raises its error (:class:`~actors.errors.ReallocationError`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from actors.driver.vllm import VLLMEngine, VLLMUpdateStats
from actors.errors import ReallocationError
from actors.lanes import STAGE
from actors.records import DeltaOrder
from actors.remote import FAILURE_GRACE_S, Deadline, check_timeout
from actors.trainer.source import ShardSource
from actors.vllm import decode, encode
from actors.wire.delta import Base, DeltaSides, sender_base, snapshot
from actors.wire.executor import Staging, StepRunner, checked_share
from actors.wire.transport import (
    abort_formation,
    address_toward,
    connect_rendezvous,
    host_rendezvous,
    join_world,
    ray_node_ip,
)
from realloc.plan import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

#: The backend's name (vLLM's ``WeightTransferConfig(backend=...)`` and the trainer factory's key).
BACKEND = "realloc"
#: How often a rank reads the control store while it waits.
POLL_S = 0.01


@dataclass
class ReallocTrainerInitInfo(TrainerInitInfo):
    """``trainer_init``'s arguments (every rank): ``rank`` (keyword, vLLM's: this rank in
    ``group``; rank 0 drives), ``name`` (the trainer's, in errors and in ``VLLMEngine.origin``),
    ``timeout_s`` (every wait of an update), ``bucket_bytes`` (the wire's buckets), ``delta``
    (after the first update, only the changed elements travel, checksummed per bucket: every
    rank keeps a copy of what it last sent, its share of the model, as the base),
    ``delta_anchor_every`` (with ``delta``: every this-many-th update into the engine is a full one,
    an anchor, as :class:`~actors.config.GroupConfig`'s; 1: every update), ``group`` (the
    trainer's ``torch.distributed`` process group; default: the default group, none for a
    one-rank trainer)."""

    backend: ClassVar[str] = BACKEND
    name: str = "trainer"
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    delta: bool = False
    delta_anchor_every: int = 10
    group: Any = None


class ReallocTrainerWeightTransferEngine(TrainerWeightTransferEngine[ReallocTrainerInitInfo]):
    """One trainer rank's part (see the module's docstring). ``version``: the last version
    committed on the engine; ``stats`` (rank 0): the last update's
    :class:`~actors.driver.vllm.VLLMUpdateStats`; ``sent_bytes``: what this rank sent last."""

    init_info_cls = ReallocTrainerInitInfo

    def __init__(self, *, client, source: ShardSource, is_sender: bool, info: ReallocTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.holdings = source.holdings()
        self.rounds = 0
        self.version = 0
        self.stats = None
        self.sent_bytes = 0
        self.engine: VLLMEngine | None = None
        self.nodes: tuple[str, ...] = ()  # rank 0: each trainer rank's node, in realloc rank order
        self.by_rank: dict[int, int] = {}  # rank 0: trainer rank -> its realloc (world) rank
        self.control = None  # the control store (rank 0 hosts it)
        self.addr = ""
        self.base: Base | None = None  # with delta=True: what this rank sent in the last committed update

    # -- init ------------------------------------------------------------------------------------
    @classmethod
    def trainer_init(cls, init_info: ReallocTrainerInitInfo, *, client=None, source=None):
        if not isinstance(init_info, ReallocTrainerInitInfo):
            raise ValueError(f"init_info must be a ReallocTrainerInitInfo, got {type(init_info).__name__}")
        if isinstance(source, torch.nn.Module):
            source = ShardSource(source)
        if not isinstance(source, ShardSource):
            raise ValueError(
                "the realloc trainer engine reads each rank's shards as they are: give source=ShardSource(model) "
                f"(or the model itself), got {type(source).__name__}"
            )
        group = init_info.group
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        problem = _check_info(init_info, group, size)
        desc: dict[str, Any] = {"rank": init_info.rank, "error": problem, "node": _node()}
        if problem is None:
            try:
                held = source.holdings()
                desc.update(layout=str(held.layout.topology), realloc_rank=held.rank)
            except ValueError as err:
                desc["error"] = str(err)
        descs = [desc]
        if size > 1:
            descs = [None] * size
            dist.all_gather_object(descs, desc, group=group)
        refused = refusal(descs, size)
        verdict: dict[str, Any] = {"error": refused}
        engine = None
        if init_info.rank == 0 and refused is None:
            engine = cls(client=client, source=source, is_sender=True, info=init_info)
            try:
                engine.start(descs)
                verdict.update(addr=engine.addr, port=engine.control.port)
            except (ValueError, ReallocationError) as err:
                verdict["error"] = f"{type(err).__name__}: {err}"
                verdict["kind"] = "value" if isinstance(err, ValueError) else "realloc"
        if size > 1:
            box = [verdict]
            dist.broadcast_object_list(box, group_src=0, group=group)
            verdict = box[0]
        if verdict["error"] is not None:
            message = verdict["error"]
            if verdict.get("kind") == "realloc":
                raise ReallocationError(f"trainer {init_info.name!r}: {message}")
            raise ValueError(f"trainer {init_info.name!r}: {message}")
        if engine is None:
            engine = cls(client=client, source=source, is_sender=False, info=init_info)
            engine.control = connect_rendezvous(verdict["addr"], verdict["port"], 1, init_info.timeout_s)
        return engine

    def start(self, descs: list[dict]) -> None:
        """Rank 0: the engine's handle (its layout baked and checked) and the control store."""
        order = sorted(descs, key=lambda d: d["realloc_rank"])
        self.nodes = tuple(d["node"] for d in order)
        self.by_rank = {d["rank"]: d["realloc_rank"] for d in descs}
        self.addr = _host_ip()
        self.engine = VLLMEngine(self.client, name="vllm", timeout_s=self.info.timeout_s)
        self.engine.init(self.source.spec)
        self.control = host_rendezvous(self.addr, 1, self.info.timeout_s)

    # -- an update ---------------------------------------------------------------------------------
    def send_weights(self, version: int | None = None) -> int:
        """Move this rank's shards to the vLLM engine and, on rank 0, commit them (every rank
        calls it); the version the engine serves afterwards. ``version`` (rank 0): the version
        to label it with (default: the last one plus one)."""
        self.rounds += 1
        if self.is_sender:
            if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
                message = f"version must be a non-negative int or None, got {version!r}"
                self._post(f"round/{self.rounds}", {"error": f"ValueError: {message}"})  # the other ranks' round ends
                raise ValueError(message)
            return self._drive(self.rounds, self.version + 1 if version is None else version)
        deadline = Deadline(self.info.timeout_s)
        opened = self._read(f"round/{self.rounds}", "trainer rank 0 did not open the update", deadline)
        if opened.get("error"):
            raise ReallocationError(f"trainer {self.info.name!r} rank 0 could not start the update: {opened['error']}")
        error = self._send_share(opened, deadline)
        self._post(f"sent/{self.rounds}/{self.info.rank}", {"error": error, "bytes": self.sent_bytes})
        # rank 0's wait for every report (its own deadline, from its own call), its reading of the
        # engine's outcomes and the switch all come after this rank's report: the verdict gets a
        # deadline of its own, and past it whether the engine switched is not known here
        verdict = self._read(
            f"verdict/{self.rounds}",
            "trainer rank 0 did not end the update",
            Deadline(self.info.timeout_s + FAILURE_GRACE_S),
            after="whether the engine switched to this update is rank 0's to say (it may have)",
        )
        if verdict.get("error"):
            self.base = None
            raise ReallocationError(verdict["error"])
        self.version = verdict["version"]
        self._keep_base()
        return self.version

    def _drive(self, k: int, version: int) -> int:
        """Rank 0's round ``k`` (see the module's docstring); one deadline for all of it, the
        engine's answers included."""
        engine, held = self.engine, self.holdings
        deadline = Deadline(self.info.timeout_s)
        stats = VLLMUpdateStats(version)
        update_id = uuid.uuid4().hex[:12]
        started = time.perf_counter()
        posted = True
        try:
            try:
                plan, stats.plan_seconds = engine.plan_from(
                    held.layout.spec, held.layout, self.nodes, self.info.bucket_bytes
                )
                shares = engine.shares(plan, held.layout, self.nodes)
                world = uuid.uuid4().hex[:12]
                rendezvous = host_rendezvous(self.addr, len(shares), self.info.timeout_s)
                base = delta_base(self.info, self.version, self.base is not None, engine)
                opened = {
                    "update_id": update_id,
                    "version": version,
                    "base": base,
                    "world": world,
                    "addr": self.addr,
                    "port": rendezvous.port,
                    "size": len(shares),
                    "shares": {str(r): encode(shares[w]) for r, w in self.by_rank.items()},
                }
                engine.open_round(
                    update_id, version, world, self.addr, rendezvous.port, shares, base, self.info.delta, deadline
                )
            except BaseException:
                posted = False  # the other ranks' round ends with the error below (what failed, the engine's state)
                raise
            self._post(f"round/{k}", opened)
            error = self._send_share(opened, deadline, rendezvous)
            self._check_reports(k, error, deadline)
            outcomes = engine.outcomes(update_id, deadline)
            stats.seconds = time.perf_counter() - started
            stats.commit_seconds = engine.switch(version, (self.info.name, version), deadline)
        except BaseException as err:
            self.base = None

            def announce(failure: BaseException) -> None:
                # before the engine's round is closed (two RPCs, each waiting for the engine's
                # step): the other ranks wait on these keys within their own deadlines, and would
                # otherwise time out saying rank 0 did not open (or end) the update
                if not posted:
                    self._post(f"round/{k}", {"error": f"{type(failure).__name__}: {failure}"})
                self._post(f"verdict/{k}", {"error": str(failure)})

            failure = engine.failed(err, self.info.name, announce)
            if failure is err:
                raise
            raise failure from err
        stats.received_bytes = [o["received_bytes"] for o in outcomes]
        stats.shadow_bytes = [o["shadow_bytes"] for o in outcomes]
        stats.stage_seconds = [o["seconds"] for o in outcomes]
        if base is not None:
            stats.delta = {key: sum(o["delta"][key] for o in outcomes) for key in outcomes[0]["delta"]}
        self.stats, self.version = stats, version
        if self.info.delta:
            engine.received_delta(DeltaOrder(base, version, "host"))  # one more delta in a row, or an anchor
        self._keep_base()
        self._post(f"verdict/{k}", {"version": version})
        return version

    def _keep_base(self) -> None:
        """With ``delta``: the send buffer as committed at ``self.version``, the next update's base."""
        if self.info.delta:
            held = self.holdings
            order = DeltaOrder(None, self.version, "host")
            self.base = snapshot(self.base, held.me, held.store.buffers, order)

    def _check_reports(self, k: int, error: str | None, deadline: Deadline) -> None:
        """Rank 0: every other rank's report of round ``k`` (``error``: rank 0's own); a
        :class:`~actors.errors.ReallocationError` naming the ranks that failed and those that did
        not report (dead or stalled: read until the deadline, or 2 s more once rank 0 failed)."""
        failed = [f"rank 0: {error}"] if error is not None else []
        wait = Deadline(max(deadline.remaining(), 2.0)) if error is not None else deadline
        silent = []
        for r in sorted(self.by_rank):
            if r == 0:
                continue
            try:
                report = self._read(f"sent/{k}/{r}", f"trainer rank {r} did not report its sends", wait)
            except ReallocationError:
                silent.append(r)
                continue
            if report["error"]:
                failed.append(f"rank {r}: {report['error']}")
        if failed or silent:
            said = [f"rank(s) {silent} did not report their sends within {self.info.timeout_s:.0f}s (dead or stalled)"]
            raise ReallocationError(
                f"trainer {self.info.name!r} could not send: " + "; ".join((said if silent else []) + failed),
                unresponsive=[f"trainer rank {r}" for r in silent],
            )

    @staticmethod
    def _abort_world(opened: dict, store, deadline: Deadline) -> None:
        """Mark the round's world aborted (best effort): its members waiting for this rank at the
        check-in leave at once, the vLLM workers posting that, instead of at their deadline."""
        try:
            if store is None:
                store = connect_rendezvous(
                    opened["addr"], opened["port"], opened["size"], max(deadline.remaining(), 1.0)
                )
            abort_formation(store, opened["world"])
        except Exception:  # noqa: BLE001 - the others then leave at their deadline; this rank's report says why
            log.warning("realloc trainer: could not mark world %s aborted", opened["world"], exc_info=True)

    def _send_share(self, opened: dict, deadline: Deadline, store=None) -> str | None:
        """Join the round's world and send this rank's routes from its local shards; the error
        (as text) or None. The world has the trainer's ranks first, in realloc rank order."""
        me = self.holdings.rank
        transport = None
        self.sent_bytes = 0
        try:
            try:  # this rank's checks, before any traffic: a refusal frees the world's other members at once
                plan, peers = checked_share(*decode(opened["shares"][str(self.info.rank)]), me)
                self.holdings.refresh()
                sides = None
                if opened.get("base") is not None:
                    order = DeltaOrder(opened["base"], opened["version"], "host")
                    sides = DeltaSides(sender_base(self.base, self.holdings.me, order), None)
            except BaseException:
                self._abort_world(opened, store, deadline)
                raise
            timeout = max(deadline.remaining(), 1.0)
            transport = join_world(
                opened["addr"], opened["port"], opened["world"], me, opened["size"], timeout, STAGE.prefix, store=store
            )
            cpu = torch.device("cpu")
            runner = StepRunner(
                transport, cpu, plan, me, peers, self.holdings.store, None, staging=Staging(cpu), delta=sides
            )
            for step, routes in sorted(plan.routes_by_step().items()):
                runner.run_step(step, routes)
                self.sent_bytes += sum(runner.list_bytes(j) for src, _, j in routes if src == me)
            if sides is not None:  # what went on the wire: deltas, headers, buckets resent whole
                self.sent_bytes = sides.stats["wire_bytes"]
            return None
        except BaseException as err:  # noqa: BLE001 - reported to rank 0, which decides the round
            log.warning("realloc trainer rank %d: sending failed: %s", self.info.rank, err)
            return f"{type(err).__name__}: {err}"
        finally:
            if transport is not None:
                transport.close()

    # -- the control store -------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"realloc-trainer/{self.info.name}/{name}"

    def _post(self, name: str, value: dict) -> None:
        try:
            self.control.set(self._key(name), json.dumps(value))
        except Exception:  # noqa: BLE001 - the reader's deadline names this rank
            log.warning("realloc trainer rank %d: could not post %s", self.info.rank, name, exc_info=True)

    def _read(
        self, name: str, what: str, deadline: Deadline, after: str = "the engine serves the version it served"
    ) -> dict:
        """The value posted under ``name``, waiting up to ``deadline``; past it, or when the
        control store is gone, a :class:`ReallocationError` saying ``what`` and ``after`` (what
        is true of the engine then)."""
        key = self._key(name)
        while True:
            try:
                if self.control.check([key]):
                    return json.loads(self.control.get(key))
            except Exception as err:  # the host (rank 0) is gone
                raise ReallocationError(
                    f"trainer {self.info.name!r} rank {self.info.rank}: {what}: its control store does not answer "
                    f"({type(err).__name__}: {err}); {after}",
                    unresponsive=["trainer rank 0"],
                ) from err
            if deadline.remaining() <= 0:
                raise ReallocationError(
                    f"trainer {self.info.name!r} rank {self.info.rank}: {what} within {deadline.seconds:.0f}s; {after}",
                    unresponsive=[what.split(" did not")[0]],
                )
            time.sleep(POLL_S)

    def shutdown(self) -> None:
        self.control = None


def _check_info(info: ReallocTrainerInitInfo, group, size: int) -> str | None:
    """What is wrong with ``info`` on this rank (None: nothing)."""
    try:
        check_timeout(info.timeout_s)
    except ValueError as err:
        return str(err)
    if isinstance(info.rank, bool) or not isinstance(info.rank, int):
        return f"rank must be an int, got {info.rank!r}"
    if isinstance(info.bucket_bytes, bool) or not isinstance(info.bucket_bytes, int) or info.bucket_bytes <= 0:
        return f"bucket_bytes must be a positive int, got {info.bucket_bytes!r}"
    if not isinstance(info.name, str) or not info.name:
        return f"name must be a non-empty string, got {info.name!r}"
    if not isinstance(info.delta, bool):
        return f"delta must be True or False, got {info.delta!r}"
    every = info.delta_anchor_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return f"delta_anchor_every must be an int >= 1, got {every!r}"
    here = dist.get_rank(group) if size > 1 else 0
    if info.rank != here:
        return f"rank={info.rank} but this process is rank {here} of the trainer's process group"
    return None


def delta_base(info: ReallocTrainerInitInfo, version: int, kept: bool, engine: VLLMEngine) -> int | None:
    """The base of the next update from the trainer ``info`` names, now at ``version`` (every rank
    ``kept`` its share as sent then): that version when the update may travel as a delta (``delta``
    on, the engine serving exactly the trainer's ``version``, not due an anchor), else None."""
    serves = engine.origin == (info.name, version)
    due = engine.deltas + 1 >= info.delta_anchor_every  # this update would be one delta too many in a row
    return version if info.delta and kept and serves and not due else None


def refusal(descs: list[dict], size: int) -> str | None:
    """Why the ranks' holdings do not make one trainer (None: they do); the same on every rank."""
    for d in descs:
        if d["error"] is not None:
            return f"rank {d['rank']}: {d['error']}"
    layouts = {d["layout"] for d in descs}
    if len(layouts) != 1:
        return f"the ranks hold different layouts: {sorted(layouts)}"
    ranks = sorted(d["realloc_rank"] for d in descs)
    if ranks != list(range(size)):
        return (
            f"the {size} ranks are ranks {ranks} of layout {layouts.pop()}: a trainer's ranks must be every rank "
            "of its layout once"
        )
    return None


def _node() -> str:
    """This process's node: its Ray node id inside Ray, else its address."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return _host_ip()


def _host_ip() -> str:
    """This host's address: its Ray node's inside Ray, else the one on its default route."""
    return ray_node_ip() or address_toward("10.255.255.255")


if BACKEND not in WeightTransferTrainerFactory._registry:
    WeightTransferTrainerFactory.register_engine(BACKEND, ReallocTrainerWeightTransferEngine)
