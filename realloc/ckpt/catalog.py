"""The cluster-wide view of one run's checkpoints: which rank files are usable on which live node.

Coverage is decided per stored box, not per rank file: dp replicas store identical shards, so a
lost rank file whose boxes survive in a dp twin's file does not make an iteration unloadable.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable

from realloc.ckpt.local_store import Listing
from realloc.ckpt.manifest import Manifest
from realloc.spec import ModelSpec


class Catalog:
    """Usable rank files per iteration, rank and node, from the listings of the live nodes.

    Example:
        >>> Catalog([]).latest_complete(ModelSpec.preset("tiny")) is None
        True
    """

    def __init__(self, listings: Iterable[Listing]):
        self.problems: list[str] = []
        raw: dict[int, list[tuple[str, Manifest]]] = defaultdict(list)
        for listing in listings:
            self.problems += [f"{listing.node}: {p}" for p in listing.problems]
            for m in listing.manifests:
                raw[m.id.iteration].append((listing.node, m))
        self._manifests: dict[int, dict[int, Manifest]] = {}
        self._copies: dict[int, dict[int, set[str]]] = {}
        for iteration, entries in raw.items():
            # One save writes one layout; a stray file of another layout or content is not a copy.
            key = Counter(m.layout_key() for _, m in entries).most_common(1)[0][0]
            digests = Counter((m.id.rank, m.sha256) for _, m in entries if m.layout_key() == key)
            manifests: dict[int, Manifest] = {}
            copies: dict[int, set[str]] = defaultdict(set)
            for node, m in entries:
                best = max((d for d in digests if d[0] == m.id.rank), key=lambda d: (digests[d], d[1]), default=None)
                if m.layout_key() != key or best != (m.id.rank, m.sha256):
                    self.problems.append(f"{node}: {m.id} disagrees with the other files of iteration {iteration}")
                    continue
                manifests.setdefault(m.id.rank, m)
                copies[m.id.rank].add(node)
            self._manifests[iteration] = manifests
            self._copies[iteration] = dict(copies)

    def iterations(self) -> list[int]:
        return sorted(self._manifests)

    def manifests(self, iteration: int) -> dict[int, Manifest]:
        """One manifest per rank that has a usable copy (copies of one rank are identical)."""
        return dict(self._manifests.get(iteration, {}))

    def copies(self, iteration: int) -> dict[int, set[str]]:
        """Rank -> nodes holding a usable copy of its file."""
        return {r: set(n) for r, n in self._copies.get(iteration, {}).items()}

    def any_manifest(self, iteration: int) -> Manifest | None:
        manifests = self._manifests.get(iteration)
        return manifests[min(manifests)] if manifests else None

    def missing(self, iteration: int, spec: ModelSpec) -> list[str]:
        """Stored boxes of ``iteration`` with no usable copy, with the ranks whose files held them."""
        reference = self.any_manifest(iteration)
        if reference is None:
            return [f"every rank file of iteration {iteration}"]
        layout = reference.layout(spec)
        available = {rec.key for m in self._manifests[iteration].values() for rec in m.shards}
        lost: dict[tuple, list[int]] = defaultdict(list)
        for rank in range(reference.world_size):
            for s in layout.shards(rank):
                if s.numel and (s.param, tuple(s.offsets), tuple(s.sizes)) not in available:
                    lost[s.param, tuple(s.offsets), tuple(s.sizes)].append(rank)
        return [f"{p} offsets={o} sizes={z} (stored by ranks {ranks})" for (p, o, z), ranks in lost.items()]

    def latest_complete(self, spec: ModelSpec) -> int | None:
        """The newest iteration whose stored boxes all have a usable copy."""
        for iteration in reversed(self.iterations()):
            if not self.missing(iteration, spec):
                return iteration
        return None
