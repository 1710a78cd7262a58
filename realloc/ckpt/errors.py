"""Errors of the checkpoint layer (bad arguments are plain ``ValueError``s, raised before any I/O).

Every error pickles with its message and attributes (Ray ships a worker's exception to the
driver by pickling it; one that does not round-trip arrives as an ``UnserializableException``).
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A save or load failed at run time (a worker died, a write failed, data went missing)."""


class MissingShardsError(CheckpointError):
    """No readable copy is left of some stored shards; ``missing`` names them (param, box, ranks)."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self):
        # Exception's default reduce calls ``cls(*self.args)``, which lacks ``missing``.
        return type(self), (self.args[0], self.missing), dict(self.__dict__)


class CorruptFileError(CheckpointError):
    """A checkpoint file does not match its recorded checksum, size or identity."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return type(self), (self.path, self.reason), dict(self.__dict__)
