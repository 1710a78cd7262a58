"""3D-parallel topologies (data x tensor x pipeline) and their rank order.

Rank order is Megatron's: tensor-parallel rank fastest, then data-parallel, then pipeline
stage slowest::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the tp ranks of one replica's stage are neighbours (and share a node when a node holds tp
or more workers), which is what tensor parallelism wants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from realloc.spec import ModelSpec

_DIM = re.compile(r"^\s*(dp|tp|pp)\s*=\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    """A data x tensor x pipeline layout of ``dp * tp * pp`` ranks.

    ``layer_split`` optionally fixes how many transformer layers each pipeline stage holds
    (default: balanced by parameter count, embedding on the first stage, head on the last).

    Example:
        >>> t = Topology.parse("dp=2,tp=4,pp=2")
        >>> t.world_size, t.coords(13)
        (16, (1, 1, 1))
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    layer_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for dim in ("dp", "tp", "pp"):
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"topology {dim} must be a positive integer, got {value!r}")
        if self.layer_split is not None:
            split = tuple(self.layer_split)
            object.__setattr__(self, "layer_split", split)
            if len(split) != self.pp:
                raise ValueError(f"layer_split {split} has {len(split)} stages but pp={self.pp}")
            if any((not isinstance(n, int)) or n < 1 for n in split):
                raise ValueError(f"layer_split {split}: every stage needs at least one layer")

    @staticmethod
    def parse(text: str) -> "Topology":
        """Parse ``"dp=2,tp=4,pp=2"``; a missing dimension means 1."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("topology string is empty; expected e.g. 'dp=2,tp=4,pp=2'")
        dims: dict[str, int] = {}
        for part in text.split(","):
            match = _DIM.match(part)
            if not match:
                raise ValueError(f"bad topology part {part!r} in {text!r}; expected dp=N, tp=N or pp=N separated by commas")
            key, value = match.group(1), int(match.group(2))
            if key in dims:
                raise ValueError(f"topology {text!r} gives {key} twice")
            dims[key] = value
        return Topology(**dims)

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp}"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, tp_rank, pp_rank)`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1} of {self}")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        return dp_rank, tp_rank, rank // (self.tp * self.dp)

    def replica_ranks(self, tp_rank: int, pp_rank: int) -> list[int]:
        """Ranks holding the same shard (coordinate ``(tp_rank, pp_rank)``) in every dp replica."""
        return [self.rank(d, tp_rank, pp_rank) for d in range(self.dp)]

    def stage_layers(self, spec: "ModelSpec") -> list[range]:
        """Transformer layers of each pipeline stage."""
        if self.pp > spec.num_layers:
            raise ValueError(f"pp={self.pp} is larger than the {spec.num_layers} layers of {spec.name}")
        split = self.layer_split or balanced_split(spec, self.pp)
        if sum(split) != spec.num_layers:
            raise ValueError(f"layer_split {split} sums to {sum(split)} but {spec.name} has {spec.num_layers} layers")
        stages, start = [], 0
        for n in split:
            stages.append(range(start, start + n))
            start += n
        return stages

    def check(self, spec: "ModelSpec") -> None:
        """Raise ``ValueError`` if ``spec`` cannot take this topology."""
        problems = spec.tp_problems(self.tp)
        if problems:
            raise ValueError(f"tp={self.tp} does not fit {spec.name}: " + "; ".join(problems[:3]))
        self.stage_layers(spec)


def balanced_split(spec: "ModelSpec", pp: int) -> tuple[int, ...]:
    """Contiguous layer counts per stage minimising the largest stage's bytes.

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
