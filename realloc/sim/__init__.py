"""A cluster simulator: a plan's steps on a model of a GPU cluster (``realloc simulate``). Pure:
numpy and the plan only, no torch, Ray or actors."""

from realloc.sim.cluster import PRESETS, Cluster, cluster_preset
from realloc.sim.engine import RESOURCES, SimResult, simulate

__all__ = ["PRESETS", "RESOURCES", "Cluster", "SimResult", "cluster_preset", "simulate"]
