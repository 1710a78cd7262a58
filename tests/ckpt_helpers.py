"""Helpers shared by the pure checkpoint tests."""

from __future__ import annotations

from pathlib import Path

from realloc.ckpt.files import read_shard
from realloc.ckpt.local_store import NodeStore
from realloc.ckpt.reshard import box_of_local, boxes_store
from realloc.shards import ShardStore


def reader_stores(root: Path, run_id: str, assignment, manifests) -> dict[int, ShardStore]:
    """What each reader of a resharding load holds after reading its boxes (crc-checked) from disk."""
    stores = {}
    for worker, tasks in assignment.tasks.items():
        boxes = {}
        for t in tasks:
            path = NodeStore(root, run_id, t.node).paths(manifests[t.rank].id)[0]
            boxes[t.key] = box_of_local(read_shard(path, manifests[t.rank], t.record), t.record)
        stores[worker] = boxes_store(boxes)
    return stores
