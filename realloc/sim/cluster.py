"""The hardware a plan is simulated on (:func:`realloc.sim.simulate`), as data that checks itself.

Every rate is in GB/s (10^9 bytes per second) in one direction, every time in seconds. A field
that is wrong raises ``ValueError`` naming it. The presets and where each number comes from are
written out in docs/benchmarks.md ("Cluster simulator").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from realloc._checks import check_number, check_positive

__all__ = ["Cluster", "PRESETS", "cluster_preset"]


@dataclass(frozen=True)
class Cluster:
    """A cluster of nodes of ``gpus_per_node`` workers each.

    Inter-node bytes leave through the sender's NIC and enter through the receiver's: a node has
    ``nics_per_node`` NICs of ``nic_gbps`` each way, shared by consecutive workers (worker ``l``
    of a node uses NIC ``l * nics_per_node // gpus_per_node``). Same-node bytes go over the
    worker's link (``nvlink_gbps`` each way: NVLink on GPUs, a zero-copy read on the CPU
    machine); a worker's local copies at ``copy_gbps``.

    Costs of the executor beside the bytes: ``step_latency_s`` per route (posting a step's send
    and receive and the handshake), ``message_latency_s`` per message of which
    ``buckets_in_flight`` are on the wire at once, and each end's host (CPU) time per route,
    ``host_route_s + host_message_s * messages``, which overlaps the wire (a route takes the
    longer of the two). The driver dispatches the move to every worker, ``driver_s_per_worker``
    each, before the last one starts.

    ``machine_inter_gbps`` / ``machine_copy_gbps`` (both or neither): every node shares one
    machine's cores (the CPU bench: simulated nodes of one host), which move all inter-node bytes
    at ``machine_inter_gbps`` and all copies at ``machine_copy_gbps``, one after the other.
    """

    name: str
    gpus_per_node: int
    nic_gbps: float
    nics_per_node: int
    nvlink_gbps: float
    copy_gbps: float
    step_latency_s: float
    message_latency_s: float
    buckets_in_flight: int
    host_route_s: float
    host_message_s: float
    driver_s_per_worker: float
    machine_inter_gbps: float | None = None
    machine_copy_gbps: float | None = None
    #: Where the numbers come from (free text, reported with every simulation).
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"cluster name must be a non-empty string, got {self.name!r}")
        check_positive("cluster gpus_per_node", self.gpus_per_node)
        check_positive("cluster nics_per_node", self.nics_per_node)
        if self.nics_per_node > self.gpus_per_node:
            raise ValueError(
                f"cluster nics_per_node must be at most gpus_per_node ({self.gpus_per_node}), got {self.nics_per_node}"
            )
        check_positive("cluster buckets_in_flight", self.buckets_in_flight)
        for name in ("nic_gbps", "nvlink_gbps", "copy_gbps"):
            _rate(name, getattr(self, name))
        for name in ("step_latency_s", "message_latency_s", "host_route_s", "host_message_s", "driver_s_per_worker"):
            check_number(f"cluster {name}", getattr(self, name), minimum=0, finite=True)
        pooled = (self.machine_inter_gbps is None, self.machine_copy_gbps is None)
        if pooled[0] != pooled[1]:
            raise ValueError(
                "cluster machine_inter_gbps and machine_copy_gbps are given together (nodes sharing one "
                f"machine's cores) or not at all, got {self.machine_inter_gbps!r} and {self.machine_copy_gbps!r}"
            )
        if not pooled[0]:
            _rate("machine_inter_gbps", self.machine_inter_gbps)
            _rate("machine_copy_gbps", self.machine_copy_gbps)
        if not isinstance(self.source, str):
            raise ValueError(f"cluster source must be a string, got {self.source!r}")

    @property
    def shared_machine(self) -> bool:
        return self.machine_inter_gbps is not None

    def replace(self, **changes: Any) -> "Cluster":
        """A copy with ``changes`` (checked again)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"cluster has no field(s) {unknown}")
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "Cluster":
        if not isinstance(data, Mapping):
            raise ValueError(f"a cluster is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(Cluster)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"cluster has no field(s) {unknown}")
        missing = sorted(f.name for f in dataclasses.fields(Cluster) if f.default is dataclasses.MISSING)
        missing = [m for m in missing if m not in data]
        if missing:
            raise ValueError(f"cluster lacks field(s) {missing}")
        return Cluster(**data)

    @staticmethod
    def from_bench(transport: Mapping[str, float], workers_per_node: int, cores: int) -> "Cluster":
        """The CPU machine as the bench measured it (``realloc bench --json``'s ``transport``): one
        gloo pair's rate per worker pair, every gloo pair at once for the machine, a zero-copy read
        and a local copy at one core's memcpy, the machine's copies at the bench bound's rate
        (``min(max(cores copying, every actor copying), cores x one core)``)."""
        try:
            p2p, pairs = transport["gloo_p2p_gbps"], transport["gloo_aggregate_gbps"]
            one, many = (
                transport["memcpy_1core_gbps"],
                max(transport["memcpy_cores_gbps"], transport["memcpy_aggregate_gbps"]),
            )
        except KeyError as err:
            raise ValueError(f"bench transport lacks {err}") from None
        return cluster_preset("cpu").replace(
            name="cpu (measured)",
            gpus_per_node=workers_per_node,
            nics_per_node=workers_per_node,
            nic_gbps=p2p,
            nvlink_gbps=one,
            copy_gbps=one,
            machine_inter_gbps=max(p2p, pairs),
            machine_copy_gbps=min(many, cores * one),
            source="rates measured by realloc bench in the same run; latencies of the cpu preset",
        )


def _rate(name: str, value: object) -> float:
    check_number(f"cluster {name}", value, positive=True, finite=True, allowed="a positive finite number of GB/s")
    return float(value)  # type: ignore[arg-type]


#: Hopper GPUs as the anchors ran them: NVLink 4 (NVSwitch) at 450 GB/s each way per GPU
#: (900 GB/s bidirectional, NVIDIA's H100/H200/H20 datasheets), one 400 Gb/s NIC per GPU
#: (ConnectX-7, 8 per node) achieving about 45 GB/s of its 50. Device-to-device copies at half
#: the HBM bandwidth (a copy reads and writes): H100 3.35 TB/s, H200 4.8 TB/s, H20 4.0 TB/s.
#: Executor costs (assumed, docs/benchmarks.md): 25 us per route (an NCCL send/recv pair
#: posted and matched), 8 us per message, 4 buckets in flight, 50 us host time per route and
#: 5 us per message, 0.1 ms of driver dispatch per worker (one Ray actor call).
_HOPPER = dict(
    gpus_per_node=8,
    nic_gbps=45.0,
    nics_per_node=8,
    nvlink_gbps=450.0,
    step_latency_s=25e-6,
    message_latency_s=8e-6,
    buckets_in_flight=4,
    host_route_s=50e-6,
    host_message_s=5e-6,
    driver_s_per_worker=1e-4,
)

PRESETS: dict[str, dict] = {
    "h100": dict(_HOPPER, name="h100", copy_gbps=1675.0, source="H100 SXM: NVLink 4, 400 Gb/s NIC per GPU"),
    "h200": dict(_HOPPER, name="h200", copy_gbps=2400.0, source="H200 SXM: NVLink 4, 400 Gb/s NIC per GPU"),
    "h20": dict(_HOPPER, name="h20", copy_gbps=2000.0, source="H20: NVLink 4, 400 Gb/s NIC per GPU"),
    # This machine (2 vCPUs, simulated nodes of one host, gloo over loopback): rates of a typical
    # bench run, 2026-11-25 (replaced by the run's own with Cluster.from_bench); latencies from
    # benchmarks/move_overhead.py (docs/benchmarks.md: 14 ms a small move on 8 workers).
    "cpu": dict(
        name="cpu",
        gpus_per_node=8,
        nic_gbps=2.7,
        nics_per_node=8,
        nvlink_gbps=8.8,
        copy_gbps=8.8,
        step_latency_s=1e-3,
        message_latency_s=2e-4,
        buckets_in_flight=1,
        host_route_s=5e-4,
        host_message_s=1e-4,
        driver_s_per_worker=1.75e-3,
        machine_inter_gbps=2.7,
        machine_copy_gbps=9.4,
        source="this 2-vCPU machine, gloo over loopback",
    ),
}


def cluster_preset(name: str, **changes: Any) -> Cluster:
    """A preset (``h100``, ``h200``, ``h20``, ``cpu``) with ``changes`` applied."""
    if name not in PRESETS:
        raise ValueError(f"cluster preset must be one of {', '.join(sorted(PRESETS))}, got {name!r}")
    return Cluster(**PRESETS[name]).replace(**changes)
