"""A vLLM engine as the destination of realloc moves: ``trainer.copy_to(engine)``.

:class:`VLLMEngine` is the driver's handle on one vLLM engine (one data-parallel replica, any
tensor parallel size) that was started with ``WeightTransferConfig(backend="realloc")``
(actors/vllm/engine.py runs in its workers). It talks to the engine only through vLLM's
weight-sync client protocol (vllm/distributed/weight_transfer/base.py ``VLLMWeightSyncClient``:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), so the engine can be an ``LLM`` in this process (:meth:`VLLMEngine.of`),
an ``AsyncLLM`` (:class:`AsyncLLMClient`), a ``vllm serve`` server (vLLM's
``HTTPVLLMWeightSyncClient``) or a Ray actor (``RayVLLMWeightSyncClient``). What the workers
report (their layout, the outcome of a transfer) comes back through a TCP store this handle
hosts, since the front ends return nothing from the workers.

One update (:meth:`VLLMEngine.stage`, and ``copy_to`` = stage, wait, commit):

1. **init** (first update): every vLLM worker bakes its layout from its own loaders for the
   trainer's checkpoint names (actors/vllm/bake.py) and posts it. The driver checks it against
   realloc's vLLM conventions (:func:`engine_layout`: :func:`vllm_layout` at the engine's tp, and
   its expert parallelism as the workers report it): any difference is a
   ``ValueError`` naming the tensor, before any byte moves, and so is a tensor the engine holds
   that the trainer does not send.
2. **stage**: one plan from the trainer's layout to the engine's (each byte enters a node once);
   a private world of the trainer's ranks and the engine's workers (hosted by the trainer's rank 0,
   joined by the trainer on its stage lane); ``start_weight_update`` and ``update_weights`` (each
   worker's share) return at once and the workers receive on a thread into shadow sets while the
   engine generates. The trainer is held (its weights cannot change) until the bytes left it.
3. **wait**: the trainer ranks' reports, then each worker's outcome from the store, within the
   deadline. Any failure: ``update_weights({"op": "abort"})`` and an empty
   ``finish_weight_update()`` on the engine, and a :class:`~actors.errors.ReallocationError`
   naming what failed and saying the engine serves its old version, untouched.
4. **commit**: ``finish_weight_update(weight_version=str(version))``: every worker switches its
   shadow set in between two forward steps; vLLM labels the outputs with the version. A commit
   every worker refused before writing anything gives vLLM back the label of the weights it still
   serves (``update_weight_version`` where the client has it, else an empty round:
   :meth:`VLLMEngine._relabel`).

Every read of the workers' answers in an update is bounded by the update's one deadline, and reads
every worker: a missing answer is one error naming every silent or dead worker and quoting the
errors of those that answered.

The workers never raise into vLLM (at tp >= 2 vLLM's executor would read later calls' replies out
of step): each answers ``update_weights`` (its share taken or refused) and the commit through the
store before its RPC returns, and this handle reads every worker's answer after the call and raises
naming the workers and their reasons (a refused share at once, not as the world's timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from actors.driver.group import ModelGroup
from actors.errors import ReallocationError
from actors.lanes import STAGE
from actors.records import MoveOrder
from actors.remote import Deadline, check_timeout, fire, gather
from actors.vllm import ABORT, control_key, init_payload, stage_payload
from actors.wire.shares import PeerView, worker_shares
from actors.wire.transport import host_rendezvous
from realloc.layout import Layout, Topology
from realloc.plan import Bandwidths, Placement, Plan, plan_reallocation

log = logging.getLogger(__name__)

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (vllm/model_executor/layers/vocab_parallel_embedding.py).
VLLM_VOCAB_PADDING = 64
#: How often the driver reads the workers' outcomes from the store.
POLL_S = 0.02


class LLMClient:
    """vLLM's weight-sync client protocol over an ``LLM`` of this process."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()


class AsyncLLMClient:
    """vLLM's weight-sync client protocol over an ``AsyncLLM`` running on event ``loop`` (another
    thread's): each call is run there and waited for."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 300.0):
        self.engine, self.loop, self.timeout_s = engine, loop, check_timeout(timeout_s)

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version=weight_version))

    def update_weight_version(self, new_version: str) -> None:
        self._run(self.engine.update_weight_version(new_version))

    def get_weight_version(self) -> str:
        return self._run(self.engine.get_weight_version())


@dataclass
class VLLMUpdateStats:
    """What one update of a vLLM engine did. ``received_bytes``/``shadow_bytes``/``stage_seconds``:
    per vLLM worker (its own clock); ``seconds``: the driver's, from the start to all bytes
    staged; ``commit_seconds``: the switch (``finish_weight_update``: the engine generates
    nothing meanwhile); ``plan_seconds``: planning (0 when the plan was cached)."""

    version: int
    seconds: float = 0.0
    plan_seconds: float = 0.0
    commit_seconds: float = 0.0
    delta: dict | None = None  # an update with delta=True that named a base: the buckets' counters, summed
    received_bytes: list[int] = field(default_factory=list)
    shadow_bytes: list[int] = field(default_factory=list)
    stage_seconds: list[float] = field(default_factory=list)


class VLLMEngine:
    """The driver's handle on one vLLM engine started with ``WeightTransferConfig(backend="realloc")``.

    ``client``: vLLM's weight-sync client of the engine (any object with its four methods; for
    an ``LLM`` of this process use :meth:`of`). ``node``: the Ray node id its workers run on
    (default: the node whose address the workers report, or this process's node when several
    share it, as simulated nodes do). ``timeout_s``: the deadline of each update (every wait of
    the driver, the workers' transport and rendezvous). ``version``: the weight version it serves
    (0: what vLLM loaded), ``layout``: its realloc layout once the first update ran.
    """

    def __init__(self, client: Any, *, name: str = "vllm", node: str | None = None, timeout_s: float = 60.0):
        for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
            if not callable(getattr(client, method, None)):
                raise ValueError(
                    f"client must be a vLLM weight-sync client (the four methods of vLLM's VLLMWeightSyncClient), "
                    f"{type(client).__name__} has no {method}(); for an LLM use VLLMEngine.of(llm)"
                )
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if node is not None and not isinstance(node, str):
            raise ValueError(f"node must be a Ray node id (str) or None, got {node!r}")
        self.client, self.name, self.node = client, name, node
        self.timeout_s = check_timeout(timeout_s)
        self.version = 0
        #: whose weights the engine serves unchanged: (trainer name, its version), None: not known
        self.origin: tuple[str, int] | None = None
        self.deltas = 0  # delta updates in a row since the last anchor
        self.layout: Layout | None = None
        self.workers: list[dict] = []
        self._id = uuid.uuid4().hex[:12]
        self._store = None
        self._plans: dict[tuple, Plan] = {}  # (trainer layout, its nodes) -> the plan to this engine
        self._shares: dict[tuple, tuple[Plan, list]] = {}  # the same key -> (that plan, its shares)
        self._pending: VLLMUpdate | None = None
        self._open = False  # a round is open on the engine (started, not finished)
        self._round = ""  # the update id of the last round opened
        #: why the engine's weights are not known (a commit that failed: its workers may differ)
        self.unknown: str | None = None
        #: vLLM's label of the weights it serves (``weight_version``): ``str(version)`` once an update
        #: committed; before, the engine's own as the client read it at init (None: it cannot say)
        self.label: str | None = None

    @classmethod
    def of(cls, llm: Any, **kwargs: Any) -> "VLLMEngine":
        """The handle of an ``LLM`` of this process."""
        return cls(LLMClient(llm), **kwargs)

    def __repr__(self) -> str:
        return f"VLLMEngine({self.name!r}, layout={self.layout}, version={self.version})"

    # -- init: the engine's layout, from its workers ----------------------------------------------
    def init(self, spec, deadline: Deadline | None = None) -> None:
        """Bake and check the engine's layout for ``spec`` (once; a later trainer must match it):
        ``ValueError`` naming the tensor where the engine's loaders and realloc's vLLM layout differ.
        ``deadline``: the update's, when the first update runs it (default: ``timeout_s`` from now)."""
        if self.layout is not None:
            self.layout.spec.check_same_as(spec)
            return
        deadline = deadline or Deadline(self.timeout_s)
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self._store = host_rendezvous(host, 1, self.timeout_s)
        params = [[p.name, list(p.shape), p.dtype] for p in spec.params]
        try:
            self.client.init_weight_transfer_engine(
                init_payload(host, self._store.port, self._id, params, self.timeout_s)
            )
        except Exception as err:
            raise ReallocationError(
                f"{self.name}: init_weight_transfer_engine failed ({type(err).__name__}: {err}); is the engine "
                "started with WeightTransferConfig(backend='realloc')?"
            ) from err
        first = self._read(("worker", 0), "describe itself", deadline)
        refused = [first] if "error" in first else []
        workers = [first]
        if not refused:
            others = range(1, first["workers"])
            workers += self._collect([(i, ("worker", i)) for i in others], "describe itself", deadline, self.serving())
            refused = [w for w in workers if "error" in w]
        if refused:
            if refused[0].get("failed"):  # not a refusal of the trainer's model: the worker's init broke
                raise ReallocationError(f"{self.name}: {refused[0]['error']}; {self.serving()}")
            raise ValueError(f"{self.name}: {refused[0]['error']}")
        if any(w["pp_size"] != 1 for w in workers):
            raise ValueError(
                f"{self.name}: pipeline parallel vLLM engines are not supported yet (pp={workers[0]['pp_size']})"
            )
        layout = engine_layout(spec, workers)
        if self.label is None and callable(getattr(self.client, "get_weight_version", None)):
            try:  # what a refused first commit puts back; a client that cannot say leaves it unknown
                self.label = str(self.client.get_weight_version())
            except Exception as err:  # noqa: BLE001 - the label stays unknown, which _relabel says
                log.warning(
                    "%s: could not read vLLM's weight version label (%s: %s)", self.name, type(err).__name__, err
                )
        self.layout, self.workers = layout, sorted(workers, key=lambda w: w["tp_rank"])
        if self.node is None:
            self.node = _node_of(workers[0]["ip"])

    def dead_workers(self) -> list[str]:
        """``"vLLM worker <i> (pid <p>) died"`` for each worker of this host whose process is gone
        (a worker on another host is not judged here: its silence is named by the deadline)."""
        return list(self._dead().values())

    def _dead(self) -> dict[int, str]:
        """:meth:`dead_workers`, by worker index."""
        here = {"127.0.0.1", _ip_of_this_host()}
        return {
            w["index"]: f"vLLM worker {w['index']} (pid {w['pid']}) died"
            for w in self.workers
            if w.get("ip") in here and not _alive(w["pid"])
        }

    def _read(self, key: tuple, what: str, deadline: Deadline | None = None) -> dict:
        """The value worker ``key[-1]`` posted under ``key``, waiting up to ``deadline``
        (:meth:`_collect` of one worker)."""
        return self._collect([(key[-1], key)], what, deadline or Deadline(self.timeout_s), self.serving())[0]

    def _collect(self, keys: list[tuple[int, tuple]], what: str, deadline: Deadline, state: str) -> list[dict]:
        """The values the workers posted, each under its key (``keys``: (worker index, key)), in
        order. Every worker is read until each one answered, or ``deadline`` passed, or every
        worker still silent died (a dead one is not waited for); then one
        :class:`~actors.errors.ReallocationError` names every dead and every silent worker and
        quotes the error each worker that did answer gave, followed by ``state`` (what is true of
        the engine then)."""
        names = {i: control_key(self._id, *key) for i, key in keys}
        got: dict[int, dict] = {}
        dead: dict[int, str] = {}
        while True:
            for i, name in names.items():
                if i not in got and i not in dead and self._store.check([name]):
                    got[i] = json.loads(self._store.get(name))
            silent = [i for i in names if i not in got and i not in dead]
            if silent:
                dead.update({i: d for i, d in self._dead().items() if i in silent})
                silent = [i for i in silent if i not in dead]
            if not silent or deadline.remaining() <= 0:
                break
            time.sleep(POLL_S)
        if not dead and not silent:
            return [got[i] for i, _ in keys]
        said = [f"{dead[i]} before it could {what}" for i in sorted(dead)]
        if silent:
            said.append(
                f"vLLM worker(s) {silent} did not {what} within {deadline.seconds:.0f}s "
                f"(store keys {[names[i] for i in silent]})"
            )
        said += [f"vLLM worker {i} answered: {a['error']}" for i, a in sorted(got.items()) if a.get("error")]
        raise ReallocationError(
            f"{self.name}: " + "; ".join(said) + (f"; {state}" if state else ""),
            dead=[dead[i] for i in sorted(dead)],
            unresponsive=[f"{self.name} worker {i}" for i in silent],
        )

    def answers(
        self, update_id: str, call: str, what: str, deadline: Deadline | None = None, state: str | None = None
    ) -> list[dict]:
        """Every worker's answer to ``call`` (``staging``, ``commit``) of round ``update_id``: each
        worker posts it before its RPC returns (actors/vllm/engine.py; it never raises into vLLM,
        whose executor would read the replies of a later call out of step), so it is read after
        that RPC, within ``deadline`` (the round's; default: ``timeout_s`` from now). A missing
        answer: one :class:`~actors.errors.ReallocationError` (:meth:`_collect`) naming every
        worker whose answer is missing and quoting the others' errors, then ``state`` (default:
        :meth:`serving`)."""
        keys = [(w["index"], (update_id, w["index"], call)) for w in self.workers]
        state = self.serving() if state is None else state
        return self._collect(keys, what, deadline or Deadline(self.timeout_s), state)

    # -- an update ---------------------------------------------------------------------------------
    def stage(self, trainer: Any, delta: bool = False) -> "VLLMUpdate":
        """Start moving ``trainer``'s weights (a :class:`~actors.driver.group.ModelGroup`) into
        shadow sets of the engine's workers; returns at once (the engine keeps generating).
        ``delta``: only the changed elements travel where the engine holds the trainer's last
        weights (the trainer made with ``GroupConfig(delta=...)``), checksummed per bucket."""
        if self._pending is not None and not self._pending.ended:
            raise ValueError(f"{self.name}: update to version {self._pending.version} is not committed or aborted yet")
        if not isinstance(delta, bool):
            raise ValueError(f"delta must be True or False, got {delta!r}")
        update = VLLMUpdate(self, trainer, delta)
        self._pending = update
        return update

    def receive_copy(self, source: ModelGroup, stage: bool, delta: bool) -> "VLLMUpdate | VLLMUpdateStats":
        """``source.copy_to(self, stage=, delta=)`` (``ModelGroup.copy_to``'s :class:`~actors.driver.group.CopyTarget`)."""
        return self.stage(source, delta) if stage else self.copy_from(source, delta)

    def copy_from(self, trainer: Any, delta: bool = False) -> VLLMUpdateStats:
        """Stage, wait and commit: the engine serves ``trainer``'s weights afterwards."""
        update = self.stage(trainer, delta)
        update.wait()
        return update.commit(update.deadline)  # one call, one deadline

    def received_delta(self, order) -> None:
        """An update carrying ``order`` (a :class:`~actors.records.DeltaOrder`) reached the engine:
        one more delta in a row, or an anchor (the trainer's ledger counts them for its anchor cadence)."""
        self.deltas = self.deltas + 1 if order.base is not None else 0

    # -- one round, whoever the trainer is (a ModelGroup: VLLMUpdate; ranks of the user's trainer
    # processes: actors/trainer/engine.py) ---------------------------------------------------------
    def plan_from(
        self, spec, layout: Layout, nodes: tuple[str, ...], bucket_bytes: int, bandwidths=None
    ) -> tuple[Plan, float]:
        """The plan from a trainer of ``layout`` (its ranks on ``nodes``) to this engine's workers
        (world ranks ``len(nodes)`` on) and the seconds planning took (0: cached)."""
        key = (layout, nodes)
        plan = self._plans.get(key)
        if plan is not None:
            return plan, 0.0
        started = time.perf_counter()
        n, m = len(nodes), len(self.workers)
        plan = plan_reallocation(
            spec,
            layout,
            self.layout,
            Placement(tuple(nodes) + (self.node,) * m),
            src_workers=range(n),
            dst_workers=range(n, n + m),
            bucket_bytes=bucket_bytes,
            bandwidths=bandwidths if bandwidths is not None else Bandwidths(),
        )
        self._plans = {key: plan}
        return plan, time.perf_counter() - started

    def shares(self, plan: Plan, layout: Layout, nodes: tuple[str, ...]) -> list:
        """Every world rank's share of ``plan``: the trainer's ``len(nodes)`` ranks, then the
        workers' (cut once per plan: they carry no per-round data)."""
        cached = self._shares.get((layout, nodes))
        if cached is not None and cached[0] is plan:
            return cached[1]
        n, m = len(nodes), len(self.workers)
        srcs = [layout.at(r) for r in range(n)] + [None] * m
        dsts = [None] * n + [self.layout.at(r) for r in range(m)]
        every = tuple(nodes) + (self.node,) * m
        out = worker_shares(plan, [PeerView(i, every[i], srcs[i], dsts[i], shared=False) for i in range(n + m)])
        self._shares = {(layout, nodes): (plan, out)}
        return out

    def open_round(
        self,
        update_id: str,
        version: int,
        world: str,
        addr: str,
        port: int,
        shares: list,
        base,
        delta: bool,
        deadline: Deadline | None = None,
    ) -> None:
        """Start a round on the engine and hand each worker its share (world ranks after the
        trainer's): the workers join world ``world`` at ``addr:port`` and receive on a thread.
        ``deadline``: the update's (default: ``timeout_s`` from now)."""
        m = len(self.workers)
        n = len(shares) - m
        self.client.start_weight_update()
        self._open = True
        self.client.update_weights(
            [
                stage_payload(update_id, version, world, addr, port, n + j, n + m, shares[n + j], base, delta)
                for j in range(m)
            ]
        )
        self._round = update_id
        # A worker that refuses its share (it fails the share's checks) answers why before its
        # update_weights returns, and never joins the world: said now, not as the world's timeout
        answers = self.answers(update_id, "staging", "answer update_weights", deadline)
        refused = [(w["index"], a["error"]) for w, a in zip(self.workers, answers) if a["error"]]
        if refused:
            raise ReallocationError(
                f"{self.name}: "
                + "; ".join(f"vLLM worker {i} refused its share of update {update_id}: {e}" for i, e in refused)
            )

    def outcomes(self, update_id: str, deadline: Deadline) -> list[dict]:
        """Each worker's report of round ``update_id`` (within ``deadline``); a
        :class:`~actors.errors.ReallocationError` naming the workers whose transfer failed (and,
        when some did not report, every silent or dead one too: :meth:`_collect`)."""
        keys = [(w["index"], (update_id, w["index"])) for w in self.workers]
        outcomes = self._collect(keys, "report its transfer", deadline, self.serving())
        failed = [(w["index"], o["error"]) for w, o in zip(self.workers, outcomes) if o["error"]]
        if failed:
            raise ReallocationError(
                f"{self.name}: the transfer failed on vLLM worker(s) " + "; ".join(f"{i}: {e}" for i, e in failed)
            )
        return outcomes

    def switch(self, version: int, origin: tuple[str, int] | None, deadline: Deadline | None = None) -> float:
        """Commit the staged round: every worker switches in between two forward steps, the
        outputs are labelled ``version``; ``origin``: whose weights it now serves; ``deadline``:
        the update's, for the workers' answers (default: ``timeout_s`` from now). Its seconds."""
        started = time.perf_counter()
        self._open = False
        try:
            self.client.finish_weight_update(weight_version=str(version))
            answers = self.answers(self._round, "commit", "answer finish_weight_update (the commit)", deadline, "")
        except BaseException as err:
            self.origin = None
            self.unknown = f"the commit of version {version} failed ({type(err).__name__}: {err})"
            raise ReallocationError(
                f"{self.name}: {self.unknown}; workers may differ: reload the engine's weights "
                "(collective_rpc('reload_weights')) or restart it",
                getattr(err, "dead", []),
                getattr(err, "unresponsive", []),
            ) from err
        failed = [(w["index"], a) for w, a in zip(self.workers, answers) if a["error"]]
        if failed:
            said = "; ".join(f"vLLM worker {i}: {a['error']}" for i, a in failed)
            if not any(a["touched"] for a in answers):  # refused by every worker before any write
                raise ReallocationError(
                    f"{self.name}: the commit of version {version} was refused ({said}); {self.serving()}; "
                    f"{self._relabel(version)}"
                )
            self.origin = None
            self.unknown = f"the commit of version {version} failed ({said})"
            raise ReallocationError(
                f"{self.name}: {self.unknown}; workers may differ: reload the engine's weights "
                "(collective_rpc('reload_weights')) or restart it"
            )
        self.version, self.origin, self.unknown, self.label = version, origin, None, str(version)
        return time.perf_counter() - started

    def _relabel(self, refused: int) -> str:
        """After a commit of version ``refused`` that every worker refused before any write: give
        vLLM back the label of the weights it serves, and say what its outputs are labelled now.
        vLLM took ``str(refused)`` as its label when ``finish_weight_update`` returned, whatever the
        workers did: each front end sets it after the RPC (vllm/entrypoints/rl/offline.py
        ``RLOfflineMixin.finish_weight_update``: ``collective_rpc("finish_weight_update")`` then
        ``llm_engine.set_weight_version``; vllm/v1/engine/async_llm.py ``finish_weight_update``;
        vllm/distributed/weight_transfer/clients.py: the HTTP route's, and the Ray client's
        ``update_weight_version`` after the call), into ``EngineCore._weight_version``, which
        stamps every later step's outputs (vllm/v1/engine/core.py ``_attach_weight_version``).
        A client with ``update_weight_version`` (``LLM``, ``AsyncLLM`` and vLLM's Ray client have
        it: vllm/entrypoints/rl/offline.py, vllm/v1/engine/async_llm.py; this module's adapters
        pass it on) sets the label alone. vLLM's client protocol does not have that call (its HTTP
        client has none), so for a client without it an empty round sets it:
        ``start_weight_update()``, ``finish_weight_update(weight_version=<label>)``; vLLM's worker
        allows a round without ``update_weights`` (vllm/v1/worker/gpu_worker.py
        ``Worker.finish_weight_update`` only needs a started round) and realloc's worker ends a
        round with nothing staged without touching anything (actors/vllm/engine.py
        ``finish_weight_update``). Where this handle does not know the label of what the engine
        serves (a client that cannot say it, before the first commit; or weights not known since a
        commit failed), no label is put back, and the message says so."""
        if self.label is None or self.unknown is not None:
            return (
                f"vLLM labels its outputs {refused}, which it does not serve (the label of what it serves is not "
                "known to this handle: none was put back)"
            )
        label = self.label
        set_label = getattr(self.client, "update_weight_version", None)
        if callable(set_label):
            try:
                set_label(label)
            except Exception as err:  # noqa: BLE001 - said in the error
                return (
                    f"giving vLLM back its label {label!r} failed ({type(err).__name__}: {err}): it labels its "
                    f"outputs {refused}, which it does not serve"
                )
            return f"vLLM labels its outputs {label!r} again"
        try:
            self.client.start_weight_update()
            self._open = True
            self.client.finish_weight_update(weight_version=label)
            self._open = False
        except Exception as err:  # noqa: BLE001 - said in the error
            closing = ""
            try:  # no round is left open for the next update to trip over
                self.close_round()
            except Exception as close_err:  # noqa: BLE001 - said in the error
                closing = f"; closing that round failed too ({type(close_err).__name__}: {close_err})"
            return (
                f"giving vLLM back its label {label!r} failed ({type(err).__name__}: {err}){closing}: it labels its "
                f"outputs {refused}, which it does not serve"
            )
        return f"vLLM labels its outputs {label!r} again"

    def close_round(self) -> None:
        """Drop an open round (its staged bytes); the engine serves what it served."""
        if self._open:
            self._open = False
            self.client.update_weights(ABORT)
            self.client.finish_weight_update(None)

    def serving(self) -> str:
        """What the engine serves after an update that did not commit: its version, untouched, or
        (after a commit that failed) that its weights are not known."""
        if self.unknown is not None:  # this update did not touch it, but what it serves is not known
            return (
                f"{self.name}'s weights are not known since {self.unknown}: its workers may differ; reload them "
                "(collective_rpc('reload_weights')) or restart the engine"
            )
        return f"{self.name} serves version {self.version}, untouched"

    def failed(
        self, err: BaseException, trainer: str, announce: Callable[[BaseException], None] | None = None
    ) -> BaseException:
        """The error to raise for an update from ``trainer`` that failed with ``err``, the round
        closed: it names what failed and says what the engine serves now. ``announce``: called
        with that error before the round is closed (closing is two RPCs, which wait for the
        engine's step), for those waiting on the update to learn the reason at once."""
        gone = self.dead_workers()
        if gone and not isinstance(err, ValueError):
            err = ReallocationError(
                f"{'; '.join(gone)} during the update of {self.name}; "
                f"{getattr(err, 'message', f'{type(err).__name__}: {err}')}",
                list(dict.fromkeys([*getattr(err, "dead", []), *gone])),
                getattr(err, "unresponsive", []),
                None,
                getattr(err, "waiting", []),
            )
        if announce is not None:
            try:
                announce(self._failure(err, trainer, gone, ""))
            except Exception as posting:  # noqa: BLE001 - the round is closed all the same; rank 0 raises err
                log.warning(
                    "%s: posting the failure to the other ranks failed (%s: %s)",
                    self.name,
                    type(posting).__name__,
                    posting,
                )
        note = ""
        try:
            self.close_round()
        except BaseException as closing:  # noqa: BLE001 - said in the error
            note = f" (closing the engine's round failed too: {type(closing).__name__}: {closing})"
        return self._failure(err, trainer, gone, note)

    def _failure(self, err: BaseException, trainer: str, gone: list[str], note: str) -> BaseException:
        """:meth:`failed`'s error, ``note`` said of the round's closing."""
        state = f"{self.serving()}{note}"
        if gone:
            state = (
                f"{self.name} lost {len(gone)} worker(s): vLLM ends an engine that loses a worker, restart it; "
                f"the trainer {trainer!r} is untouched{note}"
            )
        if isinstance(err, ReallocationError):
            said = err.message if state in err.message else f"{err.message}. {state}"
            out = ReallocationError(said, err.dead, err.unresponsive, str(self.layout), err.waiting)
        elif isinstance(err, ValueError):
            return err
        else:
            out = ReallocationError(f"update of {self.name} failed: {type(err).__name__}: {err}. {state}")
        out.__cause__ = err
        return out


class VLLMUpdate:
    """One update of a :class:`VLLMEngine` from a trainer group (:meth:`VLLMEngine.stage`).

    ``state``: ``staging``, ``staged``, ``committed``, ``failed`` or ``aborted``. ``wait()``
    returns once every byte is in the workers' shadow sets (or raises, the engine untouched);
    ``commit()`` switches them in; ``abort()`` drops them.
    """

    def __init__(self, engine: VLLMEngine, trainer: Any, delta: bool = False):
        if not isinstance(trainer, ModelGroup):
            raise ValueError(f"a vLLM engine is updated from a ModelGroup, got {type(trainer).__name__}")
        if trainer.layout.spec.weight_format is not None:
            raise ValueError(
                f"{engine.name}: the trainer holds {trainer.layout.spec.weight_format}; the vLLM backend moves the "
                "model's own dtypes for now"
            )
        self.engine, self.trainer, self.state = engine, trainer, "staging"
        self.deadline = Deadline(engine.timeout_s)
        self.id = uuid.uuid4().hex[:12]
        self._hold = contextlib.ExitStack()
        self._hold.enter_context(trainer.ledger.exclusive(f"update {engine.name}", deadline=self.deadline))
        forming = None  # the world whose formation the trainer's ranks wait in, until it is formed
        try:
            engine.init(trainer.spec, self.deadline)
            self.version = trainer.version
            self.stats = VLLMUpdateStats(self.version)
            holds = engine.origin[1] if engine.origin is not None and engine.origin[0] == trainer.name else None
            self.order = trainer.ledger.delta_order(delta, engine, holds)
            base = self.order.base if self.order is not None else None
            self._started = time.perf_counter()
            nodes = tuple(trainer.placement.nodes)
            plan, self.stats.plan_seconds = engine.plan_from(
                trainer.spec, trainer.layout, nodes, trainer.config.bucket_bytes, trainer.config.bandwidths
            )
            shares = engine.shares(plan, trainer.layout, nodes)
            n, m = len(nodes), len(engine.workers)
            world = uuid.uuid4().hex[:12]
            head = trainer.workers.actors[0]
            addr, port = gather(
                trainer.workers.subset([0]),
                [STAGE.method(head, "open_rendezvous").remote(STAGE, n + m, engine.timeout_s, world)],
                self.deadline,
                f"update {engine.name}: open the rendezvous",
            )[0]
            joins = [
                STAGE.method(a, "join").remote(STAGE, world, addr, port, r, n + m, engine.timeout_s)
                for r, a in enumerate(trainer.workers.actors)
            ]
            forming = world
            engine.open_round(self.id, self.version, world, addr, port, shares, base, delta, self.deadline)
            gather(trainer.workers, joins, self.deadline, f"update {engine.name}: form the world")
            forming = None
            self._runs = [
                a.stage_run.remote(
                    self.id,
                    world,
                    self.id,
                    [ray.put(shares[i])],
                    i,
                    {"op": "vllm"},
                    self.version,
                    MoveOrder(delta=self.order),
                )
                for i, a in enumerate(trainer.workers.actors)
            ]
        except BaseException as err:
            if forming is not None:  # the trainer's ranks wait at its rendezvous: free them now (World.form does)
                fire(trainer.workers, "abort_world", forming)
            self._fail(err)

    @property
    def ended(self) -> bool:
        return self.state in ("committed", "failed", "aborted")

    def wait(self) -> VLLMUpdateStats:
        """Block until every byte is staged on the engine (within the deadline); the stats."""
        if self.state != "staging":
            if self.state == "staged":
                return self.stats
            raise ValueError(f"update {self.id} of {self.engine.name} is {self.state}")
        try:
            try:
                gather(self.trainer.workers, self._runs, self.deadline, f"update {self.engine.name}: send")
            except BaseException:
                self.trainer.ledger.delta_done(self.trainer.layout, self.engine, self.order, False)
                raise
            self.trainer.ledger.delta_done(self.trainer.layout, self.engine, self.order, True)
            self._release()
            outcomes = self.engine.outcomes(self.id, self.deadline)
        except BaseException as err:
            self._fail(err)
        self.stats.received_bytes = [o["received_bytes"] for o in outcomes]
        self.stats.shadow_bytes = [o["shadow_bytes"] for o in outcomes]
        self.stats.stage_seconds = [o["seconds"] for o in outcomes]
        if self.order is not None and self.order.base is not None:
            self.stats.delta = {k: sum(o["delta"][k] for o in outcomes) for k in outcomes[0]["delta"]}
        self.stats.seconds = time.perf_counter() - self._started
        self.state = "staged"
        return self.stats

    def commit(self, deadline: Deadline | None = None) -> VLLMUpdateStats:
        """Switch the staged weights in on every worker (one RPC between two forward steps) and
        label the engine's outputs with the version. The workers' answers are read within
        ``deadline``; by default the update's, or, for a staged update committed once that passed
        (a call of its own, later), ``timeout_s`` from the commit."""
        if deadline is None:
            deadline = self.deadline if self.deadline.remaining() > 0 else Deadline(self.engine.timeout_s)
        self.wait()
        try:
            self.stats.commit_seconds = self.engine.switch(self.version, (self.trainer.name, self.version), deadline)
        except BaseException:
            self.state = "failed"
            raise
        self.state = "committed"
        return self.stats

    def abort(self) -> None:
        """Drop the staged weights; the engine keeps serving its version. While the bytes still
        leave the trainer, it waits for its ranks first (within the deadline): the trainer stays
        held until nothing reads its weights any more."""
        if self.ended:
            return
        if self.state == "staging":
            try:
                gather(self.trainer.workers, self._runs, self.deadline, f"update {self.engine.name}: abort")
            except ReallocationError:
                log.warning(
                    "update %s of %s: the trainer's ranks failed while it was aborted", self.id, self.engine.name
                )
            self.trainer.ledger.delta_done(self.trainer.layout, self.engine, self.order, False)
        self._release()
        self.engine.close_round()
        self.state = "aborted"

    # -- failure -------------------------------------------------------------------------------------
    def _release(self) -> None:
        self._hold.close()

    def _fail(self, err: BaseException):
        self.state = "failed"
        self._release()
        raise self.engine.failed(err, self.trainer.name)


#: vLLM's expert placements (vllm/config/parallel.py ``ExpertPlacementStrategy``) whose layout realloc
#: builds for an engine with expert parallelism: ``"linear"``, contiguous blocks of experts, the
#: first ``experts % ep`` ranks one more (vllm/model_executor/layers/fused_moe/expert_map_manager.py
#: ``determine_expert_map``), which is realloc's ``ep`` split with ``expert_order="vllm"``.
VLLM_EXPERT_PLACEMENTS = ("linear",)


def vllm_layout(spec, tp: int, ep: int = 1, expert_placement: str = "linear") -> Layout:
    """realloc's layout of ``spec`` in a vLLM engine of tensor parallel size ``tp`` (its
    conventions: docs/conventions.md): vLLM's vocabulary padding, its ``FusedMoE`` expert buffers.

    ``ep``: the engine's expert-parallel size, 1 (experts split by tensor parallelism) or ``tp``
    (``enable_expert_parallel=True``: vllm/model_executor/layers/fused_moe/config.py
    ``FusedMoEParallelConfig.make`` gives each of the tp ranks whole experts, ep = tp, expert tp 1),
    laid out as ``Topology(tp=tp, ep=tp, etp=1)``; ``expert_placement``: how vLLM places them, one
    of :data:`VLLM_EXPERT_PLACEMENTS`. ``ValueError`` for anything else, naming what is allowed."""
    moe = any(p.expert is not None for p in spec.params)
    if ep == 1:
        topology = Topology(tp=tp)
    elif ep == tp:
        if expert_placement not in VLLM_EXPERT_PLACEMENTS:
            raise ValueError(
                f"the vLLM engine places its experts {expert_placement!r} (expert_placement_strategy) under expert "
                f"parallelism; realloc lays out {list(VLLM_EXPERT_PLACEMENTS)} only: start the engine with "
                "expert_placement_strategy='linear'"
            )
        topology = Topology(tp=tp, ep=tp, etp=1)
    else:
        raise ValueError(
            f"a vLLM engine of tensor parallel size {tp} splits its experts over ep=1 (tensor parallel) or "
            f"ep={tp} (enable_expert_parallel=True, one data-parallel replica), got ep={ep}"
        )
    return Layout(
        spec,
        topology,
        vocab_pad_multiple=VLLM_VOCAB_PADDING,
        vocab_pad_rule="vllm",
        expert_order="vllm" if moe else "hf",
    )


def engine_layout(spec, workers: list[dict]) -> Layout:
    """The layout of the engine whose workers described themselves as ``workers`` (each worker's
    post: actors/vllm/engine.py ``_init``), checked against every worker's baked boxes
    (:func:`check_derived`). Expert parallelism is read from what the workers report of vLLM's own
    MoE layers (actors/vllm/bake.py ``describe_experts``). ``ValueError``, before any byte moves,
    for an expert placement other than :data:`VLLM_EXPERT_PLACEMENTS`, expert load balancing
    (``enable_eplb``: vLLM moves experts between ranks while it serves), workers that disagree, and
    any box that differs from the layout's."""
    first = workers[0]
    tp = first["tp_size"]
    for w in workers:
        if w["eplb"] or w["redundant_experts"]:
            raise ValueError(
                f"vLLM worker {w['index']} balances its experts (enable_eplb=True, {w['redundant_experts']} redundant "
                "experts): vLLM moves experts between ranks while it serves, so no layout says where a shard goes; "
                "start the engine with enable_eplb=False"
            )
        keys = ("tp_size", "expert_parallel", "ep_size", "expert_tp_size", "expert_placement")
        if any(w[k] != first[k] for k in keys):
            raise ValueError(
                f"vLLM workers {first['index']} and {w['index']} describe the engine differently: "
                f"{ {k: first[k] for k in keys} } vs { {k: w[k] for k in keys} }"
            )
    if first["expert_parallel"]:
        layout = vllm_layout(spec, tp, first["ep_size"], first["expert_placement"])  # refuses a placement first
        for w in workers:
            if w["ep_rank"] != w["tp_rank"] or w["expert_tp_size"] != 1:
                raise ValueError(
                    f"vLLM worker {w['index']} holds experts as ep rank {w['ep_rank']} of {w['ep_size']} with expert "
                    f"tp size {w['expert_tp_size']} at tp rank {w['tp_rank']} of {tp}; realloc lays out vLLM's expert "
                    "parallelism as ep rank = tp rank, expert tp size 1 (one data-parallel replica)"
                )
    else:
        layout = vllm_layout(spec, tp)
    check_derived(layout, workers, spec)
    return layout


def check_derived(layout: Layout, workers: list[dict], spec) -> None:
    """``ValueError`` unless every worker's baked boxes are ``layout``'s at its tp rank, and the
    engine holds nothing the trainer does not send, naming the first difference."""
    for w in workers:
        if w["missing"]:
            raise ValueError(
                f"vLLM worker {w['index']} holds {w['missing'][:5]} that the trainer's model does not send "
                f"({len(w['missing'])} tensors): the trainer's model is not the one vLLM serves"
            )
        want: dict[str, list] = {}
        for s in layout.shards(w["tp_rank"]):
            want.setdefault(s.param, []).append([list(s.offsets), list(s.sizes)])
        got = w["boxes"]
        for name in sorted(set(want) | set(got)):
            a, b = sorted(want.get(name, [])), sorted(got.get(name, []))
            if a != b:
                raise ValueError(
                    f"vLLM worker {w['index']} (tp rank {w['tp_rank']} of {w['tp_size']}) reads {name} as boxes {b} "
                    f"(offsets, sizes); realloc's vLLM layout {layout} says {a}"
                )
    unread = set.intersection(*(set(w["unread"]) for w in workers))
    if unread:
        raise ValueError(
            f"the vLLM engine reads nothing of {sorted(unread)[:5]}: the trainer's model is not the one vLLM serves"
        )


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed and not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _ip_of_this_host() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _node_of(ip: str) -> str:
    """The Ray node id of the host at ``ip`` (this process's node when several nodes share it);
    without Ray, the address itself names the node."""
    if not ray.is_initialized():
        return ip
    here = ray.get_runtime_context().get_node_id()
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("NodeManagerAddress") == ip]
    if len(nodes) == 1:
        return nodes[0]
    if here in nodes or not nodes:
        return here
    raise ValueError(f"several Ray nodes have address {ip}: give VLLMEngine(node=...) the engine's node id")
