"""One node's checkpoint directory: ``<root>/<run_id>/<node_id>/iter_<N>/rank_<r>.{safetensors,json}``.

A node's directory holds the rank files of the ranks that ran there (primaries) and the copies
other nodes replicated to it; a file is named by its rank either way. Nothing here talks to
other nodes: the Ray workers call this on their own node, the driver combines the listings.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from realloc.ckpt.errors import CorruptFileError
from realloc.ckpt.files import TEMP_PREFIX, rank_paths, read_manifest
from realloc.ckpt.manifest import CheckpointId, Manifest, check_run_id, iteration_dir_name, parse_iteration_dir

ROOT_ENV = "REALLOC_CKPT_ROOT"
_RANK = re.compile(r"^rank_([0-9]{5,})\.json$")


def default_root() -> Path:
    """``$REALLOC_CKPT_ROOT``, else ``/dev/shm/realloc-ckpt`` (node-local RAM), else the temp dir."""
    env = os.environ.get(ROOT_ENV)
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / "realloc-ckpt"
    return Path(tempfile.gettempdir()) / "realloc-ckpt"


@dataclass(frozen=True)
class Listing:
    """What one node's directory offers: usable rank files and why the others are unusable."""

    node: str
    manifests: list[Manifest]
    problems: list[str]


class NodeStore:
    """The checkpoint directory of one run on one node.

    Example:
        >>> import tempfile
        >>> store = NodeStore(tempfile.mkdtemp(), "run-a", "node-0")
        >>> store.iteration_dir(7).name, store.list().manifests
        ('iter_00000007', [])
    """

    def __init__(self, root: "str | Path", run_id: str, node: str):
        if not node or "/" in node or node in (".", ".."):
            raise ValueError(f"node id {node!r} cannot name a directory")
        self.root, self.run_id, self.node = Path(root), check_run_id(run_id), node
        self.dir = self.root / run_id / node

    def iteration_dir(self, iteration: int) -> Path:
        return self.dir / iteration_dir_name(iteration)

    def paths(self, ckpt_id: CheckpointId) -> tuple[Path, Path]:
        if ckpt_id.run_id != self.run_id:
            raise ValueError(f"checkpoint {ckpt_id} belongs to another run than {self.run_id!r}")
        return rank_paths(self.iteration_dir(ckpt_id.iteration), ckpt_id)

    def iterations(self) -> list[int]:
        """Iterations with a directory here: every name :meth:`iteration_dir` writes, no other."""
        if not self.dir.is_dir():
            return []
        return sorted(it for p in self.dir.iterdir() if (it := parse_iteration_dir(p.name)) is not None and p.is_dir())

    def list(self, iterations: "set[int] | None" = None) -> Listing:
        """Rank files whose manifest parses, names this run, iteration and rank, and whose tensors
        file has the recorded size (checksums are checked when the bytes are read)."""
        manifests, problems = [], []
        for it in self.iterations():
            if iterations is not None and it not in iterations:
                continue
            for meta in sorted(self.iteration_dir(it).iterdir()):
                rank = _parse_rank_file(meta.name)
                if rank is None:
                    continue
                expect = CheckpointId(self.run_id, it, rank)
                tensors, _ = self.paths(expect)
                try:
                    manifest = read_manifest(meta, expect)
                    size = tensors.stat().st_size if tensors.exists() else None
                    if size != manifest.file_bytes:
                        raise CorruptFileError(str(tensors), f"size {size} != recorded {manifest.file_bytes}")
                except CorruptFileError as exc:
                    problems.append(str(exc))
                    continue
                manifests.append(manifest)
        return Listing(self.node, manifests, problems)

    def remove_iterations(self, *, keep: int | None = None, only: int | None = None) -> list[int]:
        """Delete every iteration but ``keep`` (after it saved successfully: older ones, and newer
        leftovers of a run rolled back to an earlier iteration), or exactly ``only`` (a failed save);
        stray temp files go too. Returns the iterations removed."""
        if (keep is None) == (only is None):
            raise ValueError("give exactly one of keep= or only=")
        removed = []
        for it in self.iterations():
            if (keep is not None and it != keep) or it == only:
                shutil.rmtree(self.iteration_dir(it), ignore_errors=True)
                removed.append(it)
            else:
                for stray in self.iteration_dir(it).glob(f"{TEMP_PREFIX}*"):
                    stray.unlink(missing_ok=True)
        return removed


def _parse_rank_file(name: str) -> int | None:
    """The rank whose manifest is named ``name`` (as :attr:`CheckpointId.stem` writes it), or None."""
    match = _RANK.match(name)
    if not match:
        return None
    rank = int(match.group(1))
    return rank if f"{CheckpointId('r', 0, rank).stem}.json" == name else None
