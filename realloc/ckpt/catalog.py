"""The cluster-wide view of one run's checkpoints: which rank files are usable on which live node.

Every listed manifest is first checked against the model: one of another model, or whose shard
table is not exactly what its recorded layout gives its rank, is a problem, not a copy. Copies of
one rank that still disagree (a manifest edited or damaged on one node) are not settled by vote:
each distinct content is a :class:`Candidate`, and the bytes decide when they are read, since a
copy is only trusted once its file matches its own recorded checksums.

Coverage is decided per stored box, not per rank file: dp replicas store identical shards, so a
lost rank file whose boxes survive in a dp twin's file does not make an iteration unloadable.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import AbstractSet, Iterable

from realloc.ckpt.errors import CorruptFileError
from realloc.ckpt.local_store import Listing
from realloc.ckpt.manifest import Manifest, param_table
from realloc.layout import Layout
from realloc.spec import ModelSpec


@dataclass(frozen=True)
class Candidate:
    """One content of a rank's file (its manifest) and the nodes whose copy has that manifest.

    Nodes of one candidate hold byte-identical manifests, so one reader's verdict on its copy
    says nothing about the others: a corrupt copy is excluded per ``(node, rank)``.
    """

    manifest: Manifest
    nodes: frozenset[str]


class Catalog:
    """Usable rank files per iteration, rank and node, from the listings of the live nodes,
    for the model ``spec``.

    Example:
        >>> catalog = Catalog([], ModelSpec.preset("tiny"))
        >>> catalog.latest_complete() is None, catalog.iterations()
        (True, [])
    """

    def __init__(self, listings: Iterable[Listing], spec: ModelSpec):
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"Catalog needs the model's ModelSpec as spec, got {type(spec).__name__}")
        self.spec = spec
        self.problems: list[str] = []
        self._layouts: dict[tuple, Layout | str] = {}
        raw: dict[int, list[tuple[str, Manifest]]] = defaultdict(list)
        for listing in listings:
            self.problems += [f"{listing.node}: {p}" for p in listing.problems]
            for m in listing.manifests:
                problem = self._check(m)
                if problem is None:
                    raw[m.id.iteration].append((listing.node, m))
                else:
                    self.problems.append(f"{listing.node}: {problem}")
        self._candidates: dict[int, dict[int, list[Candidate]]] = {}
        for iteration, entries in sorted(raw.items()):
            self._candidates[iteration] = self._rank_candidates(iteration, entries)

    def _check(self, manifest: Manifest) -> str | None:
        """Why ``manifest`` cannot be a copy of a save of this model (see :meth:`Manifest.check_layout`)."""
        try:
            manifest.check_spec(self.spec)
            layout = self._layout(manifest)
            if isinstance(layout, str):
                return f"{manifest.id}: {layout}"
            manifest.check_records(layout)
        except (ValueError, CorruptFileError) as exc:
            return str(exc)
        return None

    def _layout(self, manifest: Manifest) -> Layout | str:
        """The saved layout of ``manifest`` over the model (built once per save), or why there is none."""
        key = (
            manifest.topology,
            manifest.vocab_pad_multiple,
            manifest.vocab_pad_rule,
            manifest.qkv_order,
            manifest.expert_order,
        )
        if key not in self._layouts:
            try:
                self._layouts[key] = Layout(self.spec, *key)
            except ValueError as exc:
                self._layouts[key] = f"model {self.spec.name!r} cannot be laid out in {key[0]}: {exc}"
        return self._layouts[key]

    def _rank_candidates(self, iteration: int, entries: list[tuple[str, Manifest]]) -> dict[int, list[Candidate]]:
        # One save writes one layout; a stray file of another layout is not a copy.
        key = Counter(m.layout_key() for _, m in entries).most_common(1)[0][0]
        nodes: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        manifests: dict[str, Manifest] = {}
        for node, m in entries:
            if m.layout_key() != key:
                self.problems.append(f"{node}: {m.id} has another layout than the other files of iteration {iteration}")
                continue
            content = m.dumps()
            manifests[content] = m
            nodes[m.id.rank][content].add(node)
        return {rank: _by_preference(by_content, manifests) for rank, by_content in sorted(nodes.items())}

    # -- queries ------------------------------------------------------------------------------
    def iterations(self) -> list[int]:
        """Iterations with at least one usable copy of some rank file."""
        return sorted(it for it, ranks in self._candidates.items() if ranks)

    def candidates(self, iteration: int) -> dict[int, list[Candidate]]:
        """Rank -> every distinct content of its file on the live nodes, preferred first (more
        nodes, then by sha256); only copies that passed the model and layout checks."""
        return {r: list(cs) for r, cs in self._candidates.get(iteration, {}).items()}

    def usable(self, iteration: int, excluded: AbstractSet[tuple[str, int]] = frozenset()) -> dict[int, Candidate]:
        """Rank -> its first candidate with a copy on a node not in ``excluded``, with only those nodes.

        ``excluded`` holds ``(node, rank)`` copies found corrupt when read; calling again with
        them added falls back to the next candidate once a candidate's every copy failed. Ranks
        with no such candidate are left out.
        """
        out = {}
        for rank, cs in self._candidates.get(iteration, {}).items():
            for c in cs:
                left = frozenset(n for n in c.nodes if (n, rank) not in excluded)
                if left:
                    out[rank] = Candidate(c.manifest, left)
                    break
        return out

    def manifests(self, iteration: int) -> dict[int, Manifest]:
        """Rank -> the manifest of its preferred candidate (see :meth:`usable`)."""
        return {r: c.manifest for r, c in self.usable(iteration).items()}

    def copies(self, iteration: int) -> dict[int, set[str]]:
        """Rank -> nodes holding a copy of its preferred candidate."""
        return {r: set(c.nodes) for r, c in self.usable(iteration).items()}

    def any_manifest(self, iteration: int) -> Manifest | None:
        """The preferred manifest of the lowest rank with a copy (all share the layout), or None."""
        manifests = self.manifests(iteration)
        return manifests[min(manifests)] if manifests else None

    def missing(
        self,
        iteration: int,
        spec: ModelSpec | None = None,
        excluded: AbstractSet[tuple[str, int]] = frozenset(),
        read: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    ) -> list[str]:
        """Stored boxes of ``iteration`` with no candidate copy outside ``excluded``, with the ranks
        whose files held them. ``spec``, if given, must be the catalog's model. ``read``: keys
        ``(param, offsets, sizes)`` of boxes a load already read (and checked) in its earlier
        rounds; they are not missing even if every copy of the files they came from is excluded
        since."""
        self._check_same_model(spec)
        usable = self.usable(iteration, excluded)
        available = {rec.key for c in usable.values() for rec in c.manifest.shards} | set(read)
        candidates = self._candidates.get(iteration, {})
        if not candidates or not available:
            return [f"every rank file of iteration {iteration}"]
        # Every candidate of the iteration has the same layout (_rank_candidates), usable or not.
        reference = candidates[min(candidates)][0].manifest
        layout = self._layout(reference)  # a Layout: every candidate passed _check
        lost: dict[tuple, list[int]] = defaultdict(list)
        for rank in range(reference.world_size):
            for s in layout.shards(rank):
                if s.numel and (s.param, tuple(s.offsets), tuple(s.sizes)) not in available:
                    lost[s.param, tuple(s.offsets), tuple(s.sizes)].append(rank)
        return [f"{p} offsets={o} sizes={z} (stored by ranks {ranks})" for (p, o, z), ranks in lost.items()]

    def latest_complete(self, spec: ModelSpec | None = None) -> int | None:
        """The newest iteration whose stored boxes all have a candidate copy (``spec``: as :meth:`missing`)."""
        self._check_same_model(spec)
        for iteration in reversed(self.iterations()):
            if not self.missing(iteration):
                return iteration
        return None

    def _check_same_model(self, spec: ModelSpec | None) -> None:
        if spec is None:
            return
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"spec must be a ModelSpec or None, got {type(spec).__name__}")
        if param_table(spec) != param_table(self.spec):
            raise ValueError(
                f"this catalog was built for model {self.spec.name!r}, whose parameters differ from "
                f"{spec.name!r}'s: build a Catalog with that spec instead"
            )


def _by_preference(by_content: dict[str, set[str]], manifests: dict[str, Manifest]) -> list[Candidate]:
    """One rank's candidates, more copies first, then in a fixed order (sha256, then the whole
    manifest) so every driver prefers the same one."""
    order = sorted(by_content, key=lambda c: (-len(by_content[c]), manifests[c].sha256, c))
    return [Candidate(manifests[c], frozenset(by_content[c])) for c in order]
