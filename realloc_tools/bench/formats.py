"""``realloc bench --weight-format FMT``: a trainer copied into a generator that holds another
weight format, beside the same copy in the trainer's format (issue 25).

A trainer group (``--src``, the model's dtypes, synthetic weights) copies into a generator group
(``--dst``) twice per format: once untimed (plans, communicators), then ``--repeats`` timed
``copy_to`` calls. First a generator in the trainer's own format (the plain move), then one of
``FMT`` (realloc/plan/formats.py converts on the senders when their ranks hold whole blocks: the
wire then carries FP8). Per format: bytes on the wire (routes between workers, inside and across
nodes), local copies, seconds (median pause of the timed copies and of their execute phase),
where it converted, and whether every shard of every generator worker is exactly the trainer's
synthetic weights in that format (``ModelGroup.verify_synthetic``: each worker checks its own
boxes, the synthetic values of the box cast or quantized block by block; the quantizer itself is
checked against an independent reference by tests/test_formats.py).
"""

from __future__ import annotations

import os
import statistics

from actors import ModelGroup
from actors.wire.zero_copy import SHM_DIR
from realloc.layout import Topology


def peak_reset(ctx) -> int:
    """Reset this worker process's peak resident memory to what it holds now (``/proc`` clear_refs
    5: VmHWM := VmRSS); returns that, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_now(ctx) -> int:
    """This worker process's peak resident memory since its last :func:`peak_reset`, in bytes."""
    return _status("VmHWM")


def buffer_bytes(ctx) -> int:
    """Bytes of the shared-memory buffer files this worker process holds (its weights, the spare
    set it keeps for the next move, a converted copy): ``/dev/shm/realloc-p<pid>-*``."""
    prefix = f"realloc-p{os.getpid()}-"
    return sum(os.path.getsize(os.path.join(SHM_DIR, n)) for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure(
    spec,
    src: Topology,
    dst: Topology,
    weight_format: str,
    repeats: int,
    bucket_bytes: int,
    seed: int = 0,
    log=print,
    **settings,
) -> list[dict]:
    """One row per generator format (the model's own, then ``weight_format``); Ray must be up.
    ``settings`` are the groups' other :class:`~actors.GroupConfig` fields (bench-gpu: ``use_gpu``)."""
    rows = []
    trainer = ModelGroup.create(spec, src, name="format-trainer", bucket_bytes=bucket_bytes, **settings)
    try:
        trainer.init_synthetic(seed)
        for fmt in (None, weight_format):
            gen = ModelGroup.create(
                spec,
                dst,
                name="format-gen",
                weight_format=fmt,
                bucket_bytes=bucket_bytes,
                **settings,
            )
            try:
                trainer.copy_to(gen)  # warm-up: plans, the process group
                pauses, executes = [], []
                trainer.trim_memory()  # its spare set: resting is its weights alone
                resting = {g: g.run(peak_reset, writes=False) for g in (trainer, gen)}
                for _ in range(repeats):
                    stats = trainer.copy_to(gen)
                    pauses.append(stats.pause_seconds)
                    executes.append(stats.seconds)
                # memory per worker above what it held before the timed copies (its weights, kept
                # staging), at its peak during them
                above = {g: max(p - r for p, r in zip(g.run(peak_now, writes=False), resting[g])) for g in resting}
                held = {g: max(g.run(buffer_bytes, writes=False)) for g in resting}
                gen.trim_memory()  # the rollback set: room for the check on a small machine
                bad = sorted(b for slots in gen.verify_synthetic(seed).values() for b in slots)
                row = {
                    "model": spec.name,
                    "src": str(src),
                    "dst": str(dst),
                    "weight_format": fmt or "model dtypes",
                    "conversion": stats.conversion,
                    "wire_bytes": stats.bytes_inter_node + stats.bytes_intra_node,
                    "inter_node_bytes": stats.bytes_inter_node,
                    "local_bytes": stats.bytes_local,
                    "dst_bytes_per_replica": gen.layout.spec.total_bytes(),
                    "pause_seconds": statistics.median(pauses),
                    "execute_seconds": statistics.median(executes),
                    "sender_peak_extra_bytes": above[trainer],
                    "receiver_peak_extra_bytes": above[gen],
                    "sender_buffer_bytes": held[trainer],
                    "receiver_buffer_bytes": held[gen],
                    "repeats": repeats,
                    "verified": not bad,
                    "mismatched": bad[:5],
                }
                rows.append(row)
                log(
                    f"{row['weight_format']}: wire {row['wire_bytes'] / 1e6:.1f} MB (inter-node "
                    f"{row['inter_node_bytes'] / 1e6:.1f} MB), pause {row['pause_seconds']:.3f} s, "
                    f"converted {row['conversion'] or '-'}, shm buffers per worker: sender "
                    f"{row['sender_buffer_bytes'] / 1e6:.0f} MB, receiver {row['receiver_buffer_bytes'] / 1e6:.0f} MB; "
                    "peak RSS above resting (peers' mapped buffers count): sender "
                    f"{row['sender_peak_extra_bytes'] / 1e6:.0f} MB, receiver {row['receiver_peak_extra_bytes'] / 1e6:.0f} MB, "
                    f"verified {row['verified']}"
                )
            finally:
                gen.shutdown()
    finally:
        trainer.shutdown()
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| generator format | converted | wire MB (inter-node) | local MB | pause s (median) | execute s "
        "| buffers MB per sender / receiver | peak RSS MB above resting per sender / receiver | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = rows[0]["wire_bytes"] if rows else 0
    for r in rows:
        share = f" ({100 * r['wire_bytes'] / base:.0f}%)" if base else ""
        lines.append(
            f"| {r['weight_format']} | {r['conversion'] or '-'} | {r['wire_bytes'] / 1e6:.1f}{share} "
            f"({r['inter_node_bytes'] / 1e6:.1f}) | {r['local_bytes'] / 1e6:.1f} | {r['pause_seconds']:.3f} | "
            f"{r['execute_seconds']:.3f} | {r['sender_buffer_bytes'] / 1e6:.0f} / {r['receiver_buffer_bytes'] / 1e6:.0f} | "
            f"{r['sender_peak_extra_bytes'] / 1e6:.0f} / "
            f"{r['receiver_peak_extra_bytes'] / 1e6:.0f} | {'yes' if r['verified'] else 'NO ' + ', '.join(r['mismatched'])} |"
        )
    return "\n".join(lines)
