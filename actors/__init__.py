"""Ray side: actors that own model shards, and the driver API (:class:`ModelGroup`)."""

from actors.group import ModelGroup, ReallocationError, ReallocStats

__all__ = ["ModelGroup", "ReallocationError", "ReallocStats"]
