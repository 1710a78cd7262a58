"""``realloc bench``: our ``reallocate`` against the transfers a user would otherwise write.

One run, one set of actors (8 by default, on 2 simulated nodes), one model (``bench-1gb``,
1.02 GB bf16), one transition (train ``dp=2,tp=2,pp=2`` -> generation ``dp=4,tp=2,pp=1``):

* ``ours``: ``ModelGroup.reallocate`` there and back ``--repeats`` times (driver wall time of
  each direction, after untimed warm-up round trips; the first also forms the process group).
* ``driver``: every source shard of dp replica 0 is fetched to the driver (``ray.get``), full
  tensors are assembled there, re-sliced per destination shard coordinate and pushed back
  (``ray.put``; each actor ``ray.get``s its coordinate's object and writes it into fresh
  destination buffers).
* ``broadcast`` (OpenRLHF style): per parameter, the owners of its tp shards send them to one
  owner, which assembles the full tensor and ``dist.broadcast``s it to every rank; every rank
  slices its destination boxes out of it.
* ``gather`` (veRL's path from an FSDP trainer, ``DTensor.full_tensor()``): per parameter, every
  rank all-gathers the full tensor over its data-parallel replica (the boxes of every rank,
  padded to one size), then slices its destination boxes out of it.
* ``dcp``: ``torch.distributed.checkpoint.save`` of ShardedTensors in the source layout (one
  replica writes each box) to ``/dev/shm``, ``dcp.load`` into ShardedTensors of the destination
  layout (DCP's planner reshards), then the directory is removed.

Every method must leave exact destination shards: ours is checked with the workers'
``verify_synthetic`` (dp replica 0 of the destination; the other replicas must be byte-identical,
or every rank with ``--verify exact``); baselines against ``synthetic_box`` (``--verify exact``)
or, by default, against CRC32s of ours' verified destination shards (``--verify digest``: the
same bytes, 25x cheaper on a 2-core machine). The same run measures gloo bandwidth between the two
nodes and memcpy, from which it derives a lower bound (formula in ``docs/benchmarks.md`` and in
the JSON's ``lower_bound_formula``).

The run fits the node's memory (issue 22): before each run of a baseline its peak is estimated
(:func:`~realloc_tools.bench.memory.baseline_memory_estimate`) and a baseline that would take the node past Ray's
memory-monitor threshold is skipped or cut short, with the reason in the report; each run's peak
is measured (:class:`~realloc_tools.bench.memory.MemorySampler`); a baseline that fails is recorded with its error and the
group restored (:func:`~realloc_tools.bench.faults.recover_group`); ``driver``, which leaves object-store pages touched, runs
after every direction's others (``DEFERRED_BASELINES``).

The modules, one concern each (a module imports only those below it):
``cli`` (the parser, ``run_bench``) -> ``moves`` (the run, our moves, resident layouts) ->
``baselines`` (the four strategies) -> ``report`` (summary, lower bound, table) -> ``staged``
(the staged update) -> ``faults``, ``verify`` (CRC32 digests), ``probes`` (gloo, memcpy),
``memory`` (estimates, sampler, guard) -> ``common``. ``gpu`` (``realloc bench-gpu``), ``scale``
(``realloc bench-scale``), ``delta`` (``realloc bench --delta``) and ``formats``
(``realloc bench --weight-format``) are the other benches.
"""

from realloc_tools.bench.cli import add_bench_parser

__all__ = ["add_bench_parser"]
