"""Asynchronous RL with staged updates: the rollout fleet keeps generating while the trainer trains.

A trainer group (``TrainerWorker``: the Llama of ``examples/llama.py`` bound to its shards, plain
SGD, layout ``dp=2`` by default) trains on synthetic token batches, one
``call("train_step", ..., writes=True)`` per step. A rollout fleet of replica groups
(``RolloutWorker``, ``tp=2`` each, vLLM-style fused views) generates *all the time*, one
background thread per replica, each batch in ONE long ``call("generate", ..., writes=False)``
that calls ``ctx.safe_point()`` between decode steps and records, for every generated token,
the weight version in effect (``ctx.version``) and its logits row.

Every ``k`` trainer steps the driver snapshots the trainer's full weights (``state_dict()``)
under ``trainer.version``, stages them into every replica (``Fleet.stage``: the bytes move into
shadow buffers while the replicas keep decoding on the old weights), waits, and commits with
``at="safe_point"``: each replica switches at its next safe point, the same decode step on both
of its tp ranks, so most swaps land in the middle of a sequence.

At the end every generated token is checked against a single-process reference Llama loaded
with the snapshot of the version recorded for that token, on the same prefix. Exit status 1 when
a token's logits differ from its version's reference by more than ``--atol`` (default 1e-4: the
float32 noise of tp=2 against one process measured 5e-7 to 1e-6, while the nearest *other*
version's logits differ by 0.28 or more), when a recorded version has no snapshot, when no swap
happened mid-sequence (nothing would have been exercised) or when the versions cannot be told apart.

Run it directly (starts a local Ray sized for the groups) or on a cluster::

    python examples/async_rl.py
    python examples/async_rl.py --steps 12 --every 3 --replicas 3
    RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python examples/async_rl.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402  (the user's model code, next to this file)

from actors import Fleet, ModelGroup, ShardWorker  # noqa: E402
from realloc import Topology  # noqa: E402

# The workers cannot import this folder: ship the model code (and this module) by value.
ray.cloudpickle.register_pickle_by_value(llama)
if __name__ != "__main__":
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONFIG = llama.LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
)
LR = 0.5  # plain SGD: large enough that consecutive versions give clearly different logits
ATOL = 1e-4


# -- user code in the workers -----------------------------------------------------------------------
class TrainerWorker(ShardWorker):
    """The trainer: a Llama bound to this rank's shards (no copies) and an SGD optimizer."""

    def setup(self, config: dict, lr: float) -> None:
        torch.set_num_threads(1)
        self.config = llama.LlamaConfig(**config)
        self.lr = lr
        self.model = self.optimizer = None
        self._bind(self.context())

    def on_shards_changed(self, ctx, change) -> None:
        if getattr(self, "config", None) is not None:
            self._bind(ctx)

    def _bind(self, ctx) -> None:
        t = ctx.topology
        if t.pp != 1:
            raise ValueError(f"this trainer runs one pipeline stage, not {t}")
        if self.model is None:
            self.model = llama.Llama(
                self.config, tp_group=ctx.groups.tp if t.tp > 1 else None, tp_size=t.tp, tp_rank=ctx.tp_rank
            )
            ctx.bind(self.model)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr)
        else:
            ctx.bind(self.model)  # same Parameter objects: the optimizer keeps them

    def train_step(self, tokens: torch.Tensor) -> float:
        """One SGD step; this dp replica trains on its share of ``tokens`` (gradients averaged over dp)."""
        ctx = self.context()
        mine = tokens.chunk(ctx.topology.dp)[ctx.dp_rank]
        return llama.train_step(self.model, self.optimizer, mine, dp_group=ctx.groups.dp, dp_size=ctx.topology.dp)


class RolloutWorker(ShardWorker):
    """A rollout replica's rank: a fused (vLLM-style) Llama on its shards, greedy decoding with
    a safe point between decode steps."""

    def setup(self, config: dict) -> None:
        torch.set_num_threads(1)
        self.config = llama.LlamaConfig(**config)
        self.model = None
        self._bind(self.context())

    def on_shards_changed(self, ctx, change) -> None:  # also runs inside safe_point() when it switches
        if getattr(self, "config", None) is not None:
            self._bind(ctx)

    def _bind(self, ctx) -> None:
        t = ctx.topology
        if t.pp != 1:
            raise ValueError(f"generation runs on one pipeline stage, not {t}")
        if self.model is None:
            self.model = llama.Llama(
                self.config,
                tp_group=ctx.groups.tp if t.tp > 1 else None,
                tp_size=t.tp,
                tp_rank=ctx.tp_rank,
                fused=True,
            )
        ctx.bind(self.model, fused=True)

    def generate(self, prompts: torch.Tensor, new_tokens: int, step_delay_s: float = 0.0) -> dict:
        """Greedy decoding of ``prompts`` (every rank of the replica decodes the whole batch, tp
        inside each step). Returns the tokens, and per generated step the version in effect, the
        logits and the steps where an update switched in."""
        ctx = self.context()
        tokens, versions, rows, switched_at = prompts, [], [], []
        with torch.no_grad():
            for step in range(new_tokens):
                if step and ctx.safe_point():  # a committed update switches in here (hook rebinds)
                    switched_at.append(step)
                logits = self.model(tokens)[:, -1]
                versions.append(ctx.version)
                rows.append(logits)
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True).to(tokens.dtype)], dim=1)
                if step_delay_s:
                    time.sleep(step_delay_s)
        return {
            "tp_rank": ctx.tp_rank,
            "tokens": tokens,
            "versions": versions,
            "logits": torch.stack(rows, dim=1),
            "switched_at": switched_at,
        }


# -- the driver ------------------------------------------------------------------------------------
@dataclass
class Record:
    """One generate call of one replica (tp ranks checked to agree)."""

    replica: int
    batch: int
    prompt_len: int
    tokens: torch.Tensor  # [batch, prompt_len + new_tokens]
    versions: list  # per generated step
    logits: torch.Tensor  # [batch, new_tokens, vocab]
    switched_at: list  # decode steps where an update switched in (safe points)


@dataclass
class UpdateInfo:
    version: int
    trainer_step: int
    stage_seconds: float  # fleet.stage(...).wait()
    transfer_seconds: dict  # replica name -> the workers' transfer time
    committed: list


@dataclass
class Rollout:
    """What the asynchronous loop produced: records, snapshots by version, updates."""

    records: list = field(default_factory=list)
    snapshots: dict = field(default_factory=dict)  # version -> full state dict (the trainer's, when staged)
    updates: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    loop_seconds: float = 0.0


@dataclass
class Summary:
    updates: int = 0
    versions: list = field(default_factory=list)
    generate_calls: int = 0
    tokens_checked: int = 0
    tokens_per_version: dict = field(default_factory=dict)
    swaps_mid_sequence: int = 0  # a version change between two decode steps of one call
    swaps_between_calls: int = 0  # the first token of a call in a newer version than the last of the previous
    max_abs_diff: float = 0.0  # against the reference of the recorded version
    min_other_version_diff: float = float("inf")  # against the nearest other version's reference
    mismatches: int = 0  # tokens beyond atol
    atol: float = ATOL
    loop_seconds: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def token_batch(config, n: int, length: int, seed: int) -> torch.Tensor:
    """Learnable sequences: token t+1 = token t + stride (mod vocab), random start and stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(length)) % config.vocab_size


def prompt_batch(config, n: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n, length), generator=g)


def reference_init(config, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        p.name: torch.ones(p.shape) if p.name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02
        for p in config.spec().params
    }


class _Rollouts:
    """One background thread per replica calling ``generate`` until stopped."""

    def __init__(self, replicas, prompts: int, prompt_len: int, new_tokens: int, step_delay_s: float):
        self.replicas = replicas
        self.args = (prompts, prompt_len, new_tokens, step_delay_s)
        self.records: list[Record] = []
        self.served = [0] * len(replicas)  # the newest version each replica generated a token with
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"rollout-{i}", daemon=True)
            for i in range(len(replicas))
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        prompts, prompt_len, new_tokens, delay = self.args
        batch = 0
        try:
            while not self.stop.is_set():
                prompt = prompt_batch(CONFIG, prompts, prompt_len, seed=10_000 * (i + 1) + batch)
                outs = self.replicas[i].call("generate", prompt, new_tokens, delay, writes=False)
                first = outs[0]
                for other in outs[1:]:  # every rank of a replica: same tokens, same versions, same step
                    if not (
                        torch.equal(other["tokens"], first["tokens"])
                        and other["versions"] == first["versions"]
                        and other["switched_at"] == first["switched_at"]
                    ):
                        raise AssertionError(f"replica {i}: its tp ranks disagree on tokens or versions")
                record = Record(
                    i, batch, prompt_len, first["tokens"], first["versions"], first["logits"], first["switched_at"]
                )
                with self.cond:
                    self.records.append(record)
                    self.served[i] = max(self.served[i], max(record.versions))
                    self.cond.notify_all()
                batch += 1
        except BaseException as err:  # noqa: BLE001 - reported by the driver
            with self.cond:
                self.errors.append(err)
                self.cond.notify_all()
            self.stop.set()

    def wait_served(self, version: int, timeout_s: float) -> None:
        """Until every replica generated a token with ``version`` (the update switched in everywhere)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while min(self.served) < version and not self.errors:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"replicas serve versions {self.served}, not {version}, after {timeout_s}s")
                self.cond.wait(left)
        self.raise_errors()

    def raise_errors(self) -> None:
        if self.errors:
            raise RuntimeError(f"a rollout thread failed: {self.errors[0]!r}") from self.errors[0]

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def run_async(
    steps: int = 8,
    every: int = 2,
    replicas: int = 2,
    train: str = "dp=2",
    tp: int = 2,
    prompts: int = 4,
    prompt_len: int = 4,
    new_tokens: int = 24,
    step_delay_s: float = 0.0,
    name: str = "async-rl",
    timeout_s: float = 120,
    log=print,
) -> Rollout:
    """The asynchronous loop on a running Ray; returns the records and snapshots to check."""
    if steps < 1 or every < 1 or replicas < 1 or tp < 1 or new_tokens < 2:
        raise ValueError("steps, every, replicas, tp must be >= 1 and new_tokens >= 2")
    out = Rollout()
    spec = CONFIG.spec()
    trainer = ModelGroup.create(spec, train, name=f"{name}-trainer", worker_cls=TrainerWorker, timeout_s=timeout_s)
    groups = [trainer]
    rollouts = None
    try:
        for i in range(replicas):
            groups.append(
                ModelGroup.create(
                    spec, f"tp={tp}", name=f"{name}-rollout{i}", worker_cls=RolloutWorker, timeout_s=timeout_s
                )
            )
        fleet_groups = groups[1:]
        trainer.load_state_dict(reference_init(CONFIG, seed=0))
        trainer.call("setup", asdict(CONFIG), LR, writes=False)
        trainer.copy_to(fleet_groups[0])  # the first replica from the trainer...
        fleet = Fleet(fleet_groups[:1])
        for g in fleet_groups[1:]:
            fleet.join(g)  # ...the others seeded from a serving replica
        for g in fleet_groups:
            g.call("setup", asdict(CONFIG), writes=False)
            if g.version != trainer.version:
                out.failures.append(f"{g.name} serves version {g.version} after seeding, the trainer {trainer.version}")
        out.snapshots[trainer.version] = trainer.state_dict()
        log(
            f"trainer {trainer.layout} ({trainer.num_workers} workers), fleet of {replicas} x {fleet_groups[0].layout}; "
            f"version {trainer.version}"
        )

        rollouts = _Rollouts(fleet_groups, prompts, prompt_len, new_tokens, step_delay_s)
        started = time.perf_counter()
        rollouts.start()
        last_version = trainer.version
        for step in range(1, steps + 1):
            data = token_batch(CONFIG, 8, 16, seed=100 + step % 2)
            losses = trainer.call("train_step", data)  # writes=True: the trainer's version moves on
            out.losses.append(sum(losses) / len(losses))
            rollouts.raise_errors()
            if step % every:
                continue
            # The previous update must have switched in on every replica before the next is staged: a
            # replica that reached no safe point since its commit refuses staging (GroupBusyError) and
            # the Fleet would drop it. The trainer trains on this thread only, so nothing writes it
            # between the snapshot and the staging (a concurrent writer would race the version label).
            rollouts.wait_served(last_version, timeout_s)
            key, snapshot = trainer.version, trainer.state_dict()  # nothing writes the trainer until staged
            t0 = time.perf_counter()
            update = fleet.stage(trainer)  # the trainer is held while its bytes leave it
            stats = update.wait()
            stage_seconds = time.perf_counter() - t0
            versions = {n: u.version for n, u in update.updates.items()}
            if update.version != key or set(versions.values()) != {key}:
                out.failures.append(f"step {step}: snapshot of version {key}, staged {update.version} {versions}")
            committed = update.commit(at="safe_point")
            if committed != fleet.names or update.errors or fleet.dropped:
                out.failures.append(f"step {step}: committed on {committed}, errors {update.errors}")
            out.snapshots[key] = snapshot
            last_version = key
            out.updates.append(
                UpdateInfo(key, step, stage_seconds, {n: s.seconds for n, s in stats.items()}, committed)
            )
            log(
                f"step {step}: loss {out.losses[-1]:.4f}; staged version {key} into {len(stats)} replicas in "
                f"{stage_seconds:.3f}s, committed at safe points"
            )
        rollouts.wait_served(last_version, timeout_s)  # every update served before the fleet stops
        rollouts.finish()
        rollouts.raise_errors()
        out.loop_seconds = time.perf_counter() - started
        out.records = sorted(rollouts.records, key=lambda r: (r.replica, r.batch))
    finally:
        if rollouts is not None:
            rollouts.finish()
        for g in reversed(groups):
            g.shutdown()
    return out


# -- the check -------------------------------------------------------------------------------------
def reference_model(config, state: dict[str, torch.Tensor]) -> llama.Llama:
    model = llama.Llama(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[n])
    return model.eval()


def check(rollout: Rollout, config=CONFIG, atol: float = ATOL) -> Summary:
    """Every generated token against a single-process reference with its recorded version's weights."""
    s = Summary(atol=atol, loop_seconds=rollout.loop_seconds, failures=list(rollout.failures))
    s.updates = len(rollout.updates)
    s.versions = sorted(rollout.snapshots)
    s.generate_calls = len(rollout.records)
    models = {v: reference_model(config, state) for v, state in rollout.snapshots.items()}
    per_version: Counter = Counter()
    last_seen: dict[int, int] = {}
    missing = set()
    with torch.no_grad():
        for rec in rollout.records:
            # a causal model: one forward of the whole sequence gives the logits of every prefix
            full = {v: m(rec.tokens) for v, m in models.items()}
            if last_seen.get(rec.replica, rec.versions[0]) < rec.versions[0]:
                s.swaps_between_calls += 1
            last_seen[rec.replica] = rec.versions[-1]
            for i, v in enumerate(rec.versions):
                if i and v != rec.versions[i - 1]:
                    if v < rec.versions[i - 1]:
                        s.failures.append(f"replica {rec.replica} batch {rec.batch}: version went back at step {i}")
                    s.swaps_mid_sequence += 1
                rows = rec.tokens.shape[0]
                per_version[v] += rows
                s.tokens_checked += rows
                if v not in models:
                    missing.add(v)
                    continue
                got = rec.logits[:, i]
                pos = rec.prompt_len + i - 1  # the logits of step i follow the prefix tokens[:, :pos + 1]
                diff = (got - full[v][:, pos]).abs().amax(-1)
                s.max_abs_diff = max(s.max_abs_diff, float(diff.max()))
                bad = int((diff > atol).sum())
                if bad and s.mismatches < 5:
                    s.failures.append(
                        f"replica {rec.replica} batch {rec.batch} step {i} (version {v}): {bad} token(s) differ "
                        f"from the reference by up to {float(diff.max()):.3e} > atol {atol:g}"
                    )
                s.mismatches += bad
                for other, logits in full.items():
                    if other != v:
                        gap = float((got - logits[:, pos]).abs().amax(-1).min())
                        s.min_other_version_diff = min(s.min_other_version_diff, gap)
    s.tokens_per_version = dict(sorted(per_version.items()))
    if missing:
        s.failures.append(f"tokens recorded with versions {sorted(missing)} that have no snapshot")
    if s.mismatches > 5:
        s.failures.append(f"{s.mismatches} tokens in all differ from their version's reference")
    if s.updates and s.swaps_mid_sequence == 0:
        s.failures.append("no update switched in mid-sequence: the safe points were never exercised")
    if len(s.versions) > 1 and not s.min_other_version_diff > atol:
        s.failures.append(
            f"two versions give logits within {s.min_other_version_diff:.2e} <= atol: the check cannot tell them apart"
        )
    if not rollout.records:
        s.failures.append("no token was generated")
    return s


def format_summary(s: Summary) -> str:
    return (
        f"async RL: {s.updates} staged updates (versions {s.versions}), {s.generate_calls} generate calls, "
        f"{s.tokens_checked} tokens checked; tokens per version {s.tokens_per_version}; "
        f"swaps mid-sequence {s.swaps_mid_sequence}, between calls {s.swaps_between_calls}; "
        f"max |logit diff| vs the recorded version {s.max_abs_diff:.2e} (atol {s.atol:g}); "
        f"nearest other version differs by >= {s.min_other_version_diff:.2e}; loop {s.loop_seconds:.1f}s"
    )


def main(argv: list[str] | None = None, result: dict | None = None) -> int:
    """The command line; ``result`` (a dict), when given, receives the rollout and the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="trainer SGD steps (default 8)")
    parser.add_argument("--every", "-k", type=int, default=2, help="stage an update every k steps (default 2)")
    parser.add_argument("--replicas", type=int, default=2, help="rollout replica groups (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallelism of each replica (default 2)")
    parser.add_argument("--train", default="dp=2", help="the trainer's layout, pp=1 (default dp=2)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per generate call (default 4)")
    parser.add_argument("--new-tokens", type=int, default=24, help="decode steps per call (default 24)")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per decode step, seconds (default 0)")
    parser.add_argument("--atol", type=float, default=ATOL, help=f"logit tolerance (default {ATOL:g})")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    workers = Topology.parse(args.train).world_size + args.replicas * args.tp
    started = time.perf_counter()
    how = "on the running Ray"
    if not ray.is_initialized():
        how = "connecting to Ray included"
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=workers, include_dashboard=False, log_to_driver=False)
            how = "starting a local Ray included"
    rollout = run_async(
        args.steps,
        args.every,
        args.replicas,
        args.train,
        args.tp,
        args.prompts,
        new_tokens=args.new_tokens,
        step_delay_s=args.step_delay,
    )
    summary = check(rollout, CONFIG, args.atol)
    if result is not None:
        result.update(rollout=rollout, summary=summary)
    if args.json:
        print(json.dumps({**asdict(summary), "ok": summary.ok}, indent=2))
    for failure in summary.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print(format_summary(summary))
    print(f"wall time {time.perf_counter() - started:.1f}s ({how})")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
