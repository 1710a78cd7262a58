"""Parallel topologies (data x sharded data x tensor x pipeline), their rank order and pipeline layer splits.

Rank order is Megatron's: tensor-parallel rank fastest, then data-parallel, then pipeline
stage slowest::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the tp ranks of one replica's stage are neighbours (and share a node when a node holds tp
or more workers), which is what tensor parallelism wants.

Sharded data parallelism (FSDP2 ``fully_shard``; with dp > 1 too, HSDP) is a fourth size,
``fsdp``, between tp and dp, as torchtitan's device mesh orders its dims
(``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``, tp fastest)::

    rank = tp_rank + tp * (fsdp_rank + fsdp * (dp_rank + dp * pp_rank))

With ``fsdp == 1`` this is the order above. :meth:`Topology.coords` keeps returning
``(dp_rank, tp_rank, pp_rank)``; :meth:`Topology.coords4` gives ``(dp, fsdp, tp, pp)`` ranks.
``Topology.fsdp_split`` names how the fsdp ranks cut a tp shard (:data:`FSDP_SPLIT_RULES`):
``"fsdp2"`` (default, FSDP2's ``torch.chunk`` rows) or ``"zero3"`` (DeepSpeed ZeRO-3's flat,
padded partitions; realloc/layout/zero3.py). With ``fsdp == 1`` both are the same and it reads ``"fsdp2"``.
ZeRO++ hpZ and MiCS are refused with their reasons (:data:`NOT_FSDP_SPLITS`; docs/conventions.md).

Which transformer layers a pipeline stage holds must be what the engine holding the weights
builds, or the shards are the wrong layers. ``Topology.layer_split`` gives the counts per stage
explicitly; without it ``Topology.pp_split`` names the rule (see :data:`PP_SPLIT_RULES` and
docs/conventions.md):

* ``"vllm"`` (default): vLLM's ``get_pp_indices`` (vllm/distributed/utils.py): ``L // pp``
  layers per stage, the ``L % pp`` leftover layers one each to the stages before the last,
  from stage ``pp - 2`` backwards. Equal to Megatron-core's split whenever pp divides L.
* ``"megatron"``: Megatron-core's default (``get_num_layers_to_build`` in
  megatron/core/transformer/transformer_block.py): ``L / pp`` per stage, and pp must divide L.
  Its uneven options (``num_layers_in_first_pipeline_stage`` /
  ``num_layers_in_last_pipeline_stage``) are an explicit ``layer_split``.
* ``"balanced"``: :func:`balanced_split`, the contiguous split with the smallest largest stage
  in bytes. No engine uses it on its own: give the engine the same counts (vLLM's
  ``VLLM_PP_LAYER_PARTITION``, Megatron's first/last-stage options).

Every rule puts the embedding on stage 0 and the final norm and head on the last stage.

Expert parallelism (``ep``, ``etp``; docs/conventions.md, "Expert parallelism") lays out the
routed experts of MoE layers apart from the dense parts, which keep the order above. Within a
pipeline stage, position ``i = tp_rank + tp * dp_rank`` (the rank modulo ``dp * tp``) is, in
Megatron-core's expert mesh (``RankGenerator`` with order ``"tp-ep-dp-pp"`` in
megatron/core/parallel_state.py ``initialize_model_parallel``)::

    i = etp_rank + etp * (ep_rank + ep * edp_rank)

``etp`` (expert tensor parallelism, Megatron's ``expert_tensor_parallel_size``) defaults to tp;
the expert data-parallel size ``edp = dp * tp / (ep * etp)`` is what is left. With ``etp = 1``
and ``ep = dp * tp`` this is vLLM's ``ep_rank = dp_rank * tp_size + tp_rank``
(``FusedMoEParallelConfig.make`` in vllm/model_executor/layers/fused_moe/config.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from realloc._checks import check_positive, is_int

if TYPE_CHECKING:
    from realloc.spec import ModelSpec

#: Names ``Topology.pp_split`` accepts; the first is the default.
PP_SPLIT_RULES = ("vllm", "megatron", "balanced")
DEFAULT_PP_SPLIT = PP_SPLIT_RULES[0]
#: Names ``Topology.fsdp_split`` accepts (how fsdp ranks cut a tp shard); the first is the default.
FSDP_SPLIT_RULES = ("fsdp2", "zero3")
DEFAULT_FSDP_SPLIT = FSDP_SPLIT_RULES[0]
_HPZ = (
    "fsdp_split={name!r}: DeepSpeed ZeRO++ hpZ (zero_hpz_partition_size=g) is not a layout here. Its "
    "primary partitions (param.ds_tensor) are ZeRO-3's over the whole data-parallel world W: use "
    "fsdp=W,fsdp_split=zero3. Its secondary copy (ds_secondary_tensor, Init._partition_param_sec in "
    "deepspeed/runtime/zero/partition_parameters.py) pads numel to a multiple of W and gives each rank "
    "of a group of g ceil(numel / W) * W / g elements, which is not ZeRO-3 over g ranks replicated "
    "W / g times (dp=W/g,fsdp=g,fsdp_split=zero3 has ceil(numel / g)) unless W divides numel; it is "
    "rebuilt from the primary partitions. Allowed fsdp_split: " + ", ".join(FSDP_SPLIT_RULES)
)
#: Sharded-DP variants that are refused with their own reason (lower-case names).
NOT_FSDP_SPLITS = {name: _HPZ.format(name=name) for name in ("hpz", "zero3_hpz", "zero++", "zeropp", "zero_hpz")} | {
    name: f"fsdp_split={name!r}: MiCS was removed from DeepSpeed (0.19); allowed fsdp_split: "
    + ", ".join(FSDP_SPLIT_RULES)
    for name in ("mics", "zero3_mics")
}

_PART = re.compile(r"^\s*([A-Za-z_]+)\s*=\s*(\S*)\s*$")
_INT = re.compile(r"^-?\d+$")
_EXPECTED = (
    "expected dp=N, ep=N, etp=N, fsdp=N, tp=N or pp=N (optionally pp_split=NAME, layer_split=A/B/... "
    "and fsdp_split=NAME) separated by commas"
)
_SIZES = ("dp", "fsdp", "tp", "pp", "ep", "etp")


def _check_rule(rule: object, field: str = "pp_split", rules: tuple[str, ...] = PP_SPLIT_RULES) -> None:
    allowed = ", ".join(rules)
    if not isinstance(rule, str):
        raise ValueError(f"topology {field} must be a string naming a rule ({allowed}), got {rule!r}")
    if rule not in rules:
        raise ValueError(f"unknown {field} {rule!r}; allowed: {allowed}")


def pp_layer_counts(num_layers: int, pp: int, rule: str = DEFAULT_PP_SPLIT) -> tuple[int, ...]:
    """Layers of each pipeline stage under a count-only ``rule`` (``"vllm"`` or ``"megatron"``).

    ``"balanced"`` depends on the parameter sizes: use :func:`balanced_split` (or
    :meth:`Topology.stage_counts`) for it.

    Example:
        >>> pp_layer_counts(32, 4), pp_layer_counts(30, 4), pp_layer_counts(30, 4, "vllm")
        ((8, 8, 8, 8), (7, 8, 8, 7), (7, 8, 8, 7))
        >>> pp_layer_counts(32, 4, "megatron")
        (8, 8, 8, 8)
    """
    _check_rule(rule)
    for what, value in (("num_layers", num_layers), ("pp", pp)):
        check_positive(what, value)
    if pp > num_layers:
        raise ValueError(f"pp={pp} is larger than the {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    if rule == "vllm":
        counts = [base] * pp
        for stage in range(pp - 1 - extra, pp - 1):  # stages pp-2, pp-3, ... take one more each
            counts[stage] += 1
        return tuple(counts)
    if rule == "megatron":
        if extra:
            example = "/".join(map(str, _megatron_uneven_example(num_layers, pp)))
            raise ValueError(
                f"pp_split='megatron' needs pp to divide the layer count, but {num_layers} layers do not split "
                f"evenly over pp={pp}; give the stages explicitly with layer_split (Megatron's "
                f"num_layers_in_first/last_pipeline_stage), e.g. layer_split={example}"
            )
        return (base,) * pp
    raise ValueError(
        f"pp_split={rule!r} depends on parameter sizes, not only on the layer count: use balanced_split(spec, pp)"
    )


def _megatron_uneven_example(num_layers: int, pp: int) -> tuple[int, ...]:
    """A split Megatron-core accepts through its first/last-stage options: equal middle stages
    (as many layers as the largest even stage), the rest shared by the first and last stage."""
    if pp == 1:
        return (num_layers,)
    for middle in (-(-num_layers // pp), num_layers // pp):
        rest = num_layers - (pp - 2) * middle
        if rest >= 2:
            return (rest // 2,) + (middle,) * (pp - 2) + (rest - rest // 2,)
    raise AssertionError("unreachable: pp <= num_layers")


@dataclass(frozen=True)
class Topology:
    """A data x tensor x pipeline layout of ``dp * fsdp * tp * pp`` ranks (``fsdp``: sharded
    data parallelism, FSDP2; with ``dp > 1`` too, HSDP; see the module docstring for the order).

    ``layer_split`` optionally fixes how many transformer layers each pipeline stage holds;
    without it ``pp_split`` names the rule that decides (default ``"vllm"``: the split vLLM and
    Megatron-core build; see the module docstring). The embedding is on the first stage, the
    final norm and head on the last. ``ep``/``etp`` lay out the routed experts of MoE models
    (expert parallelism, module docstring); ``etp`` reads ``None`` when it is tp.

    Example:
        >>> t = Topology.parse("dp=2,tp=4,pp=2")
        >>> t.world_size, t.coords(13)
        (16, (1, 1, 1))
        >>> str(Topology(pp=4, pp_split="balanced")), str(Topology(pp=3, layer_split=(2, 3, 3)))
        ('dp=1,tp=1,pp=4,pp_split=balanced', 'dp=1,tp=1,pp=3,layer_split=2/3/3')
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    layer_split: tuple[int, ...] | None = None
    pp_split: str = DEFAULT_PP_SPLIT
    #: Sharded data-parallel size (FSDP2 / HSDP): each replica's tp shards are further cut
    #: along dim 0 over ``fsdp`` ranks (see realloc.layout and docs/conventions.md).
    fsdp: int = 1
    #: How the fsdp ranks cut a tp shard (:data:`FSDP_SPLIT_RULES`); reads the default when fsdp == 1.
    fsdp_split: str = DEFAULT_FSDP_SPLIT
    #: Expert-parallel size: routed experts are split in contiguous blocks over ``ep`` ranks of
    #: every pipeline stage (module docstring; 1: every rank holds every expert of its stage).
    ep: int = 1
    #: Expert tensor-parallel size (Megatron's ``expert_tensor_parallel_size``); ``None`` (the
    #: default) means ``tp``, and an ``etp`` equal to ``tp`` reads ``None``. Use :attr:`expert_tp`.
    etp: int | None = None

    def __post_init__(self) -> None:
        for dim in _SIZES:
            value = getattr(self, dim)
            if dim == "etp" and value is None:
                continue
            check_positive(f"topology {dim}", value)
        if self.etp == self.tp:  # the default, spelled out
            object.__setattr__(self, "etp", None)
        if self.fsdp > 1 and self.expert_parallel:
            self._check_fsdp_experts()
        block, experts = self.dp * self.tp, self.ep * self.expert_tp
        if self.fsdp == 1 and block % experts:
            raise ValueError(
                f"topology ep={self.ep} x etp={self.expert_tp} = {experts} must divide dp x tp = {block} (the ranks "
                f"of a pipeline stage, which Megatron-core's expert mesh tp-ep-dp-pp splits into etp x ep x edp); "
                f"e.g. dp={experts // math.gcd(experts, self.tp)} with tp={self.tp}"
            )
        if self.layer_split is not None:
            split = tuple(self.layer_split)
            object.__setattr__(self, "layer_split", split)
            if len(split) != self.pp:
                raise ValueError(f"layer_split {split} has {len(split)} stages but pp={self.pp}")
            if any(not is_int(n) or n < 1 for n in split):
                raise ValueError(f"layer_split {split}: every stage needs at least one layer")
        _check_rule(self.pp_split)
        if isinstance(self.fsdp_split, str) and self.fsdp_split.lower() in NOT_FSDP_SPLITS:
            raise ValueError(NOT_FSDP_SPLITS[self.fsdp_split.lower()])
        _check_rule(self.fsdp_split, "fsdp_split", FSDP_SPLIT_RULES)
        if self.fsdp == 1:  # one fsdp rank holds its whole tp shard under every rule
            object.__setattr__(self, "fsdp_split", DEFAULT_FSDP_SPLIT)

    def _check_fsdp_experts(self) -> None:
        """Expert parallelism with fsdp is torchtitan's composition (``torchtitan_experts``): ``ValueError``
        unless ep > 1, etp = 1, ep divides fsdp x tp and the split is FSDP2's."""
        where = f"fsdp={self.fsdp} with ep={self.ep}, etp={self.expert_tp}"
        if self.ep == 1 or self.expert_tp != 1:
            raise ValueError(
                f"{where}: with fsdp, experts are laid out as torchtitan composes EP and FSDP: ep > 1 and "
                "etp=1 (torchtitan's experts are not tensor parallel under EP); use ep > 1 with etp=1, or "
                "ep=1 without etp"
            )
        if (self.fsdp * self.tp) % self.ep:
            raise ValueError(
                f"{where}: torchtitan's ep must divide its dp_shard x tp = fsdp x tp = {self.fsdp * self.tp} "
                "(its sparse mesh efsdp x ep covers the same ranks)"
            )
        if self.fsdp_split != DEFAULT_FSDP_SPLIT:
            raise ValueError(
                f"{where}: fsdp_split={self.fsdp_split!r} with expert parallelism is not described; "
                "torchtitan shards with FSDP2 (fsdp_split='fsdp2')"
            )

    @property
    def torchtitan_experts(self) -> bool:
        """Whether routed experts follow torchtitan's EP + FSDP composition (``fsdp > 1`` and
        ``ep > 1``): :meth:`expert_coords` over its sparse mesh, and :mod:`realloc.layout.torchtitan`."""
        return self.fsdp > 1 and self.expert_parallel

    @property
    def expert_tp(self) -> int:
        """The effective expert tensor-parallel size: ``etp``, or ``tp`` when not given."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: the ranks of a pipeline stage holding one expert-parallel
        rank's experts (Megatron's edp; with fsdp torchtitan's efsdp x dp_replicate)."""
        return self.dp * self.fsdp * self.tp // (self.ep * self.expert_tp)

    @property
    def expert_parallel(self) -> bool:
        """Whether routed experts are laid out apart from the dense tp split (``ep > 1`` or ``etp != tp``)."""
        return self.ep > 1 or self.etp is not None

    @staticmethod
    def parse(text: str) -> "Topology":
        """Parse ``"dp=2,tp=4,pp=2"`` or ``"dp=2,fsdp=4,tp=2"``; a missing dimension means 1.

        Optional parts: ``pp_split=NAME`` (a rule of :data:`PP_SPLIT_RULES`),
        ``layer_split=A/B/...`` (layers per stage), ``fsdp_split=NAME`` (a rule of
        :data:`FSDP_SPLIT_RULES`), ``ep=N`` and ``etp=N`` (expert parallelism; etp defaults to
        tp). With ``ep`` but no ``dp``, dp is the smallest that ``ep * etp`` fits in:
        ``ep * etp / gcd(ep * etp, tp)`` (``ep=8,tp=1`` is dp=8; ``ep=4,tp=2`` is dp=4, etp=2).
        ``Topology.parse(str(t)) == t`` for every ``t``.

        Example:
            >>> t = Topology.parse("ep=4,tp=2")
            >>> t.dp, t.world_size, str(t), str(Topology.parse("ep=8,etp=1,tp=2"))
            (4, 8, 'dp=4,tp=2,pp=1,ep=4', 'dp=4,tp=2,pp=1,ep=8,etp=1')
        """
        if not isinstance(text, str):
            raise ValueError(f"a topology string looks like 'dp=2,tp=4,pp=2', got {type(text).__name__} {text!r}")
        if not text.strip():
            raise ValueError("topology string is empty; expected e.g. 'dp=2,tp=4,pp=2'")
        fields: dict[str, object] = {}
        for part in text.split(","):
            match = _PART.match(part)
            key, value = (match.group(1), match.group(2)) if match else (None, "")
            if key in _SIZES and _INT.match(value):
                parsed: object = int(value)
            elif key in ("pp_split", "fsdp_split") and value:
                parsed = value
            elif key == "layer_split" and value and all(_INT.match(n) for n in value.split("/")):
                parsed = tuple(int(n) for n in value.split("/"))
            else:
                raise ValueError(f"bad topology part {part!r} in {text!r}; {_EXPECTED}")
            if key in fields:
                raise ValueError(f"topology {text!r} gives {key} twice")
            fields[key] = parsed
        if "ep" in fields and "dp" not in fields and fields.get("fsdp", 1) == 1:  # the smallest dp ep x etp fits in
            tp, ep = fields.get("tp", 1), fields["ep"]
            etp = fields.get("etp", tp)
            if all(isinstance(v, int) and v >= 1 for v in (tp, ep, etp)):
                fields["dp"] = ep * etp // math.gcd(ep * etp, tp)  # type: ignore[operator]
        return Topology(**fields)  # type: ignore[arg-type]

    def __str__(self) -> str:
        text = f"dp={self.dp}," + (f"fsdp={self.fsdp}," if self.fsdp > 1 else "") + f"tp={self.tp},pp={self.pp}"
        if self.layer_split is not None:
            text += ",layer_split=" + "/".join(map(str, self.layer_split))
        if self.pp_split != DEFAULT_PP_SPLIT:
            text += f",pp_split={self.pp_split}"
        if self.fsdp_split != DEFAULT_FSDP_SPLIT:
            text += f",fsdp_split={self.fsdp_split}"
        if self.ep != 1:
            text += f",ep={self.ep}"
        if self.etp is not None:
            text += f",etp={self.etp}"
        return text

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int, fsdp_rank: int = 0) -> int:
        return tp_rank + self.tp * (fsdp_rank + self.fsdp * (dp_rank + self.dp * pp_rank))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, tp_rank, pp_rank)`` of ``rank`` (its fsdp rank: :meth:`coords4`)."""
        dp_rank, _, tp_rank, pp_rank = self.coords4(rank)
        return dp_rank, tp_rank, pp_rank

    def coords4(self, rank: int) -> tuple[int, int, int, int]:
        """``(dp_rank, fsdp_rank, tp_rank, pp_rank)`` of ``rank``.

        Example:
            >>> Topology.parse("dp=2,fsdp=3,tp=2").coords4(7)
            (1, 0, 1, 0)
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1} of {self}")
        tp_rank = rank % self.tp
        rest = rank // self.tp
        fsdp_rank = rest % self.fsdp
        rest //= self.fsdp
        return rest % self.dp, fsdp_rank, tp_rank, rest // self.dp

    def replica_ranks(self, tp_rank: int, pp_rank: int, fsdp_rank: int = 0) -> list[int]:
        """Ranks holding the same shard (coordinate ``(fsdp_rank, tp_rank, pp_rank)``) in every dp replica."""
        return [self.rank(d, tp_rank, pp_rank, fsdp_rank) for d in range(self.dp)]

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(edp_rank, ep_rank, etp_rank, pp_rank)`` of ``rank`` in the expert mesh (tp-ep-dp-pp).

        Example:
            >>> Topology.parse("dp=4,tp=2,pp=2,ep=4,etp=1").expert_coords(13)
            (1, 1, 0, 1)
        """
        dp_rank, fsdp_rank, tp_rank, pp_rank = self.coords4(rank)
        # the rank inside its stage; with fsdp torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep)
        i, etp = tp_rank + self.tp * (fsdp_rank + self.fsdp * dp_rank), self.expert_tp
        return i // (etp * self.ep), (i // etp) % self.ep, i % etp, pp_rank

    def expert_replica_ranks(self, etp_rank: int, ep_rank: int, pp_rank: int) -> list[int]:
        """Ranks holding the experts of coordinate ``(etp_rank, ep_rank, pp_rank)``: the expert
        data-parallel group (without fsdp they hold the same expert shard; with fsdp, torchtitan's
        efsdp x dp_replicate ranks, each an FSDP chunk of them)."""
        step = self.expert_tp * self.ep
        first = etp_rank + self.expert_tp * ep_rank + self.dp * self.fsdp * self.tp * pp_rank
        return list(range(first, first + step * self.expert_dp, step))

    def stage_counts(self, spec: "ModelSpec") -> tuple[int, ...]:
        """Number of transformer layers of each pipeline stage: ``layer_split`` if given, else
        the ``pp_split`` rule applied to ``spec``."""
        if self.pp > spec.num_layers:
            raise ValueError(f"pp={self.pp} is larger than the {spec.num_layers} layers of {spec.name}")
        if self.layer_split is not None:
            split = self.layer_split
        elif self.pp_split == "balanced":
            split = balanced_split(spec, self.pp)
        else:
            try:
                split = pp_layer_counts(spec.num_layers, self.pp, self.pp_split)
            except ValueError as err:
                raise ValueError(f"{spec.name}: {err}") from None
        if sum(split) != spec.num_layers:
            raise ValueError(f"layer_split {split} sums to {sum(split)} but {spec.name} has {spec.num_layers} layers")
        return split

    def stage_layers(self, spec: "ModelSpec") -> list[range]:
        """Transformer layers of each pipeline stage (contiguous, in order).

        Example:
            >>> from realloc.spec import ModelSpec
            >>> [len(r) for r in Topology(pp=4).stage_layers(ModelSpec.preset("qwen2.5-7b"))]
            [7, 7, 7, 7]
        """
        stages, start = [], 0
        for n in self.stage_counts(spec):
            stages.append(range(start, start + n))
            start += n
        return stages

    def check(self, spec: "ModelSpec") -> None:
        """Raise ``ValueError`` if ``spec`` cannot take this topology."""
        experts = self.expert_parallel
        problems = [
            msg for p in spec.params if not (experts and p.expert is not None) and (msg := p.tp_problem(self.tp))
        ]
        if problems:
            raise ValueError(f"tp={self.tp} does not fit {spec.name}: " + "; ".join(problems[:3]))
        if experts:
            count = 1 + max((p.expert for p in spec.params if p.expert is not None), default=-1)
            if count == 0:
                raise ValueError(
                    f"ep={self.ep}, etp={self.expert_tp}: {spec.name} has no routed experts; use ep=1 without etp"
                )
            if self.ep > count:
                raise ValueError(
                    f"ep={self.ep} is larger than the {count} routed experts of {spec.name}: every "
                    f"expert-parallel rank holds at least one expert (ep <= {count})"
                )
            if self.torchtitan_experts and count % self.ep:
                raise ValueError(
                    f"ep={self.ep} with fsdp={self.fsdp}: torchtitan needs num_experts divisible by ep "
                    f"(torchtitan/models/common/decoder.py), and {spec.name} has {count} routed experts"
                )
            problems = [msg for p in spec.params if p.expert is not None and (msg := p.tp_problem(self.expert_tp))]
            if problems:
                raise ValueError(
                    f"etp={self.expert_tp} does not fit the experts of {spec.name}: " + "; ".join(problems[:3])
                )
        self.stage_layers(spec)


def balanced_split(spec: "ModelSpec", pp: int) -> tuple[int, ...]:
    """Contiguous layer counts per stage minimising the largest stage's bytes (``pp_split="balanced"``).

    The embedding weighs on stage 0 and the final norm and head on the last stage (a tied head
    counts its copy there). Binary search on the bottleneck with a greedy feasibility check, so
    it is exact for contiguous splits with at least one layer per stage.
    """
    layers = [0] * spec.num_layers
    first = last = 0
    for p in spec.params:
        if p.role == "layer":
            layers[p.layer] += p.nbytes
        elif p.role == "embed":
            first += p.nbytes
            if spec.tied_head_of(p.name):
                last += p.nbytes
        else:
            last += p.nbytes
    if pp == 1:
        return (spec.num_layers,)
    if pp > spec.num_layers:
        raise ValueError(f"pp={pp} is larger than the {spec.num_layers} layers of {spec.name}")

    def split_under(cap: int) -> list[int] | None:
        counts, i, n = [], 0, len(layers)
        for stage in range(pp):
            load = first if stage == 0 else 0
            tail = last if stage == pp - 1 else 0
            stages_after = pp - stage - 1
            take = 0
            while i + take < n - stages_after:
                extra = layers[i + take] + (tail if i + take == n - 1 else 0)
                if take and load + extra > cap:
                    break
                load += extra
                take += 1
            if take == 0 or load > cap:
                return None
            counts.append(take)
            i += take
        return counts if i == n else None

    lo, hi = max(layers), sum(layers) + first + last
    while lo < hi:
        mid = (lo + hi) // 2
        if split_under(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    result = split_under(lo)
    assert result is not None
    return tuple(result)
