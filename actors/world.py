"""A collective world: one process group over a set of actors (one or several model groups).

Formed once and reused by every plan among its actors. A copy between two groups forms one
world over both (and keeps it for later copies and reallocations); a failure marks it broken
and the next operation forms a fresh one, so the number of communicators stays bounded.
"""

from __future__ import annotations


class World:
    def __init__(self, actors: list, names: list[str], backend: str):
        self._rank = {a._actor_id: i for i, a in enumerate(actors)}
        self.names, self.backend = names, backend
        self.alive = True

    @staticmethod
    def form(actors: list, names: list[str], timeout_s: float) -> "World":
        from actors.group import _get  # the fail-fast ray.get

        n = len(actors)
        addr, port = _get(actors[:1], [actors[0].open_store.remote(n, timeout_s)], names[:1], timeout_s, "form world")[0]
        backends = _get(actors, [a.join.remote(addr, port, r, n, timeout_s) for r, a in enumerate(actors)],
                        names, timeout_s + 30, "form world")
        if len(set(backends)) != 1:
            raise ValueError(f"workers disagree on the backend ({sorted(set(backends))}): mixing GPU and CPU "
                             "workers in one world is not supported")
        return World(actors, names, backends[0])

    def rank_of(self, actor) -> int:
        return self._rank[actor._actor_id]

    def covers(self, actors: list) -> bool:
        return all(a._actor_id in self._rank for a in actors)

    def mark_broken(self) -> None:
        self.alive = False
