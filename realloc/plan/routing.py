"""Steps 2 and 3 of the exchange planner (:mod:`realloc.plan.planner`): routing.

2. **Per (bundle, destination node).** A needing worker that holds the cell copies locally. If
   another worker of the node holds it, the copy stays in the node (least-loaded local holder).
   Otherwise it is a *remote demand*: the bytes enter the node exactly once, into one *entry*
   worker (least-loaded among the node's needing workers) and fan out inside the node from there.
3. **Sender balance.** Remote demands sharing a set of holder nodes form a class, balanced over
   the holder nodes' egress (``linear_sum_assignment`` on convex slot costs, a round robin when
   every row is alike, a largest-first greedy above :data:`LSA_MAX_ROWS` rows), cutting cells into
   up to :data:`MAX_SENDERS_PER_CELL` row parts when a class has more holder nodes than
   destination nodes.

:class:`Router` records the deliveries; :func:`realloc.plan.assemble.build_plan` turns them into
a plan.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from realloc.boxes import Box, split_rows
from realloc.plan.cells import Bundle, cells_bytes
from realloc.plan.inputs import Bandwidths, ParamTable
from realloc.plan.placement import Placement

__all__ = ["ID", "LSA_MAX_ROWS", "MAX_SENDERS_PER_CELL", "Router"]

LSA_MAX_ROWS = 512
#: Worker ids and route keys in the planner's arrays (half the memory traffic of int64).
ID = np.int32
#: Parts a cell may be cut into so that several holder nodes send it in parallel.
MAX_SENDERS_PER_CELL = 8


@dataclass(frozen=True)
class _NeedNodes:
    """A need map as arrays: needing nodes (node-map order) and, per node, its needing workers."""

    node_idx: np.ndarray  # node index of each needing node
    workers: list[list[int]]  # needing workers of each needing node
    padded: np.ndarray  # the same as a (nodes, most workers on a node) array, -1 padded
    position: dict[str, int]  # node name -> its position in these arrays
    everywhere: np.ndarray  # every position


@functools.cache
def _linear_sum_assignment():
    """scipy's ``linear_sum_assignment``, loaded when a plan first solves one (most never do).

    Importing ``scipy.optimize`` takes 0.4-0.8 s (it loads scipy.linalg, sparse and the
    optimizers) for one C function, itself the extension module ``scipy/optimize/_lsap*.so``
    with no Python around it; so that module is loaded alone from its file (about 10 ms): the
    same function the package exports. Where it is not found, the package is imported."""
    import importlib.machinery
    import importlib.util
    import os

    found = importlib.util.find_spec("scipy")  # where the package is, without importing it
    folders = found.submodule_search_locations if found is not None else None
    for folder in folders or ():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "optimize", "_lsap" + suffix)
            if os.path.isfile(path):
                loader = importlib.machinery.ExtensionFileLoader("scipy.optimize._lsap", path)
                module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
                loader.exec_module(module)
                return module.linear_sum_assignment
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment


class Router:
    """Steps 2 and 3: where each bundle's bytes come from and which worker they enter.

    Deliveries are recorded as ``(phase, src, dst, key)`` with keys ``(bundle, part, parts)``,
    ``(phase, src, dst)`` as one route number ``(phase * W + src) * W + dst`` (``W`` workers, in
    :attr:`route_dtype`); phase 0 moves bytes from holders (intra or inter node), phase 1 fans
    them out inside a node.
    A bundle's remote deliveries are recorded as arrays at once, with the result of choosing the
    least-loaded sender and entry worker one delivery at a time (:meth:`_deliver`,
    :meth:`_senders`); copies inside a node that holds the bundle are chosen one at a time.
    """

    def __init__(self, placement: Placement, params: ParamTable, bandwidths: Bandwidths):
        self.placement = placement
        self.params = params
        self.bandwidths = bandwidths
        self.node_names = sorted(set(placement.nodes))
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.node_of = np.array([self.node_index[n] for n in placement.nodes], dtype=np.int64)
        self.egress = np.zeros(placement.num_workers, dtype=np.int64)  # worker -> bytes sent
        self.ingress = np.zeros(placement.num_workers, dtype=np.int64)  # worker -> bytes received
        self.node_egress: dict[str, int] = defaultdict(int)
        self.bundles: list[Bundle] = []
        self.keys: list[tuple[int, int, int]] = []
        self.key_ids: dict[tuple[int, int, int], int] = {}
        self.key_bytes: list[int] = []
        # past 32,767 workers a route number needs 64 bits
        self.route_dtype = np.int32 if 2 * placement.num_workers**2 < 2**31 else np.int64
        self.deliveries: list[tuple[np.ndarray, int]] = []  # (route numbers, key)
        self.pending: tuple[list[int], list[int]] = ([], [])  # route numbers, keys: one at a time
        self.local: dict[int, list[int]] = defaultdict(list)  # worker -> key ids it copies locally
        # class (holder nodes) -> (bundle id, positions of its remote needing nodes in _NeedNodes)
        self.remote: dict[tuple[str, ...], list[tuple[int, np.ndarray]]] = defaultdict(list)
        self.pairs: set[tuple[str, str]] = set()
        self._need_nodes: dict[int, _NeedNodes] = {}
        self._holder_workers: dict[int, np.ndarray | None] = {}
        self._splits: dict[tuple[int, int, int], list[Box]] = {}
        self._holder_nodes: dict[int, tuple[str, ...]] = {}  # id of a holder map -> its nodes, sorted
        self._remote_of: dict[tuple[int, tuple[str, ...]], np.ndarray] = {}

    # -- keys --------------------------------------------------------------------------------
    def _key(self, bid: int, part: int, parts: int) -> int:
        k = (bid, part, parts)
        i = self.key_ids.get(k)
        if i is None:
            i = self.key_ids[k] = len(self.keys)
            self.keys.append(k)
            self.key_bytes.append(
                self.bundles[bid].nbytes
                if parts == 1
                else sum(  # whole: counted by bundles_of
                    len(names) * cells_bytes(cells, dtype) for names, dtype, cells in self.blocks_of(k)
                )
            )
        return i

    def blocks_of(self, key: tuple[int, int, int]) -> list[tuple[tuple[str, ...], str, list[Box]]]:
        """The blocks a key moves: its bundle's, or part ``part`` of ``parts`` of every cell."""
        bid, part, parts = key
        blocks = self.bundles[bid].blocks
        if parts == 1:
            return blocks
        out = []
        for names, dtype, cells in blocks:
            split = self._splits.get((id(cells), part, parts))
            if split is None:
                split = self._splits[id(cells), part, parts] = [
                    pieces[part] for c in cells if part < len(pieces := split_rows(c, parts))
                ]
            if split:
                out.append((names, dtype, split))
        return out

    # -- recording ---------------------------------------------------------------------------
    def _least(self, workers: list[int], load: np.ndarray) -> int:
        if len(workers) == 1:
            return workers[0]
        return min(workers, key=lambda w: (int(load[w]), w))

    def _send(self, phase: int, src: int, dst: int, key: int) -> None:
        width = self.placement.num_workers
        self.pending[0].append((phase * width + src) * width + dst)
        self.pending[1].append(key)
        nbytes = self.key_bytes[key]
        self.egress[src] += nbytes
        self.ingress[dst] += nbytes

    def _record(self, phase: int, src: np.ndarray, dst: np.ndarray, key: int) -> None:
        """``_send`` for many routes of one key at once."""
        if src.size:
            width = self.placement.num_workers
            self.deliveries.append(((phase * width + src.astype(self.route_dtype)) * width + dst, key))
            nbytes = self.key_bytes[key]
            for load, ends in ((self.egress, src), (self.ingress, dst)):
                if ends.size <= 2:  # most deliveries of expert bundles: one node (ufunc.at costs ~3 us a call)
                    for w in ends.tolist():
                        load[w] += nbytes
                elif ends.size > load.size // 4:
                    load += np.bincount(ends, minlength=load.size) * nbytes
                else:
                    np.add.at(load, ends, nbytes)

    def _need_nodes_of(self, needers: dict[str, list[int]]) -> _NeedNodes:
        info = self._need_nodes.get(id(needers))  # need maps are shared and live as long as the router
        if info is None:
            workers = list(needers.values())
            padded = np.full((len(workers), max(map(len, workers))), -1, dtype=ID)
            for i, ws in enumerate(workers):
                padded[i, : len(ws)] = ws
            info = self._need_nodes[id(needers)] = _NeedNodes(
                np.array([self.node_index[n] for n in needers], dtype=np.int64),
                workers,
                padded,
                {n: i for i, n in enumerate(needers)},
                np.arange(len(workers)),
            )
        return info

    def _single_holders(self, holders: dict[str, list[int]]) -> np.ndarray | None:
        """Node index -> its one holder worker (-1 elsewhere), or None when a node has several."""
        if id(holders) not in self._holder_workers:
            table = None
            if all(len(ws) == 1 for ws in holders.values()):
                table = np.full(len(self.node_names), -1, dtype=ID)
                for node, ws in holders.items():
                    table[self.node_index[node]] = ws[0]
            self._holder_workers[id(holders)] = table
        return self._holder_workers[id(holders)]

    # -- step 2 ------------------------------------------------------------------------------
    def route_bundle(self, b: Bundle) -> None:
        bid = len(self.bundles)
        self.bundles.append(b)
        for node, local_holders in b.holders.items():
            needers = b.needers.get(node)
            if needers is None:
                continue
            whole = self._key(bid, 0, 1)
            holding = set(local_holders)
            for w in needers:
                if w in holding:
                    self.local[w].append(whole)
                else:
                    self._send(0, self._least(local_holders, self.egress), w, whole)
        # bundles share their node maps: a holder map's nodes once per map, the needing nodes
        # no holder serves once per need map and holder nodes
        holder_nodes = self._holder_nodes.get(id(b.holders))
        if holder_nodes is None:
            holder_nodes = self._holder_nodes[id(b.holders)] = tuple(sorted(b.holders))
        remote = self._remote_of.get((id(b.needers), holder_nodes))
        if remote is None:
            info = self._need_nodes_of(b.needers)
            remote = info.everywhere
            served = [info.position[n] for n in holder_nodes if n in info.position]
            if served:
                remote = np.delete(remote, sorted(served))
            self._remote_of[id(b.needers), holder_nodes] = remote
        if remote.size:
            self.remote[holder_nodes].append((bid, remote))

    # -- step 3 ------------------------------------------------------------------------------
    def assign_remote(self) -> None:
        for holder_nodes in sorted(self.remote):
            demands = self.remote[holder_nodes]
            nodes = np.concatenate(
                [self._need_nodes_of(self.bundles[bid].needers).node_idx[pos] for bid, pos in demands]
            )
            weights = np.repeat(
                np.array([self.bundles[bid].nbytes for bid, _ in demands], dtype=np.int64),
                [pos.size for _, pos in demands],
            )
            node_bytes = np.zeros(len(self.node_names), dtype=np.int64)
            np.add.at(node_bytes, nodes, weights)
            dst_nodes = np.unique(nodes)  # node indices follow sorted node names
            parts = max(1, min(MAX_SENDERS_PER_CELL, len(holder_nodes) // len(dst_nodes)))
            rows = [
                (self.node_names[n], p, int(node_bytes[n]) // parts) for n in dst_nodes.tolist() for p in range(parts)
            ]
            chosen = self._balance(list(holder_nodes), rows)
            sender = np.full((len(self.node_names), parts), -1, dtype=np.int64)
            for (node, part, nbytes), h in zip(rows, chosen):
                self.node_egress[h] += nbytes
                self.pairs.add((h, node))
                sender[self.node_index[node], part] = self.node_index[h]
            for bid, pos in demands:
                for part in range(parts):
                    self._deliver(bid, pos, sender[:, part], part, parts)

    def _balance(self, holders: list[str], rows: list[tuple[str, int, int]]) -> list[str]:
        """Holder node for each row: min total cost with convex slot costs (see module doc)."""
        if len(holders) == 1:
            return holders * len(rows)
        mean = max(1, sum(r[2] for r in rows) // len(rows))
        slots_per = -(-len(rows) // len(holders))
        bonus = mean * 0.25
        row_nodes = {r[0] for r in rows}
        holder_set = set(holders)
        alike = len({r[2] for r in rows}) == 1 and not any(h in holder_set and n in row_nodes for h, n in self.pairs)
        if alike:
            order = sorted(holders, key=lambda h: (self.node_egress[h], h))
            return [order[i % len(order)] for i in range(len(rows))]
        if len(rows) <= LSA_MAX_ROWS:
            cost = np.empty((len(rows), len(holders) * slots_per))
            for c, h in enumerate(holders):
                for j in range(slots_per):
                    cost[:, c * slots_per + j] = self.node_egress[h] + j * mean
            for r, (node, _, nbytes) in enumerate(rows):
                cost[r] *= nbytes
                for c, h in enumerate(holders):
                    if (h, node) in self.pairs:
                        cost[r, c * slots_per : (c + 1) * slots_per] -= bonus * nbytes
            row_ind, col_ind = _linear_sum_assignment()(cost)
            out = [""] * len(rows)
            for r, c in zip(row_ind, col_ind):
                out[r] = holders[c // slots_per]
            return out
        load = {h: self.node_egress[h] for h in holders}
        out = [""] * len(rows)
        for r in sorted(range(len(rows)), key=lambda i: (-rows[i][2], i)):
            node, _, nbytes = rows[r]
            h = min(holders, key=lambda h: (load[h] - (bonus if (h, node) in self.pairs else 0), h))
            load[h] += nbytes
            out[r] = h
        return out

    def _deliver(self, bid: int, pos: np.ndarray, sender: np.ndarray, part: int, parts: int) -> None:
        """Part ``part`` of bundle ``bid`` into its needing nodes at ``pos``, each sent by the
        holder node ``sender[node]``: into one entry worker per node, then fanned out."""
        b = self.bundles[bid]
        key = self._key(bid, part, parts)
        nbytes = self.key_bytes[key]
        if not nbytes:
            return
        info = self._need_nodes_of(b.needers)
        holder_nodes = sender[info.node_idx[pos]]
        single = self._single_holders(b.holders)
        src = single[holder_nodes] if single is not None else self._senders(b, holder_nodes, nbytes)
        # The nodes' needing workers are disjoint, so each node's entry (least ingress, lowest
        # id on ties) does not depend on the other nodes' choices: all at once.
        candidates = info.padded[pos]
        if candidates.shape[1] == 1:  # one needing worker per node: it is the entry
            self._record(0, src, candidates[:, 0], key)
            return
        present = candidates >= 0
        load = np.where(present, self.ingress[candidates], np.iinfo(np.int64).max)
        choice = np.argmin(load, axis=1)
        entry = candidates[np.arange(pos.size), choice]
        fan = present.copy()
        fan[np.arange(pos.size), choice] = False
        fan_src, fan_dst = np.broadcast_to(entry[:, None], fan.shape)[fan], candidates[fan]
        self._record(0, src, entry, key)
        self._record(1, fan_src, fan_dst, key)

    def _senders(self, b: Bundle, holder_nodes: np.ndarray, nbytes: int) -> np.ndarray:
        """The holder worker sending each delivery: one at a time, each delivery would go to the
        holder of its node with the least egress (lowest id on ties), which then has ``nbytes``
        more. For ``k`` deliveries from one node that is the ``k`` smallest of
        ``(egress[w] + j * nbytes, w)`` over its holders ``w`` and ``j = 0..k-1``, in order."""
        src = np.empty(holder_nodes.size, dtype=ID)
        for h in np.unique(holder_nodes).tolist():
            at = np.flatnonzero(holder_nodes == h)
            workers = np.array(b.holders[self.node_names[h]], dtype=np.int64)
            loads = self.egress[workers][:, None] + np.arange(at.size, dtype=np.int64) * nbytes
            ids = np.broadcast_to(workers[:, None], loads.shape).ravel()
            src[at] = ids[np.lexsort((ids, loads.ravel()))[: at.size]]
        return src
