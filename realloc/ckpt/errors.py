"""Errors of the checkpoint layer (bad arguments are plain ``ValueError``s, raised before any I/O)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A save or load failed at run time (a worker died, a write failed, data went missing)."""


class MissingShardsError(CheckpointError):
    """No readable copy is left of some stored shards; ``missing`` names them (param, box, ranks)."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = list(missing)


class CorruptFileError(CheckpointError):
    """A checkpoint file does not match its recorded checksum, size or identity."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason
