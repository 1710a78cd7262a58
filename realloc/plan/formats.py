"""Moves between layouts of different weight formats: where the conversion runs, as data.

A plan moves tensors of one format. A move from a layout of one format to a layout of another
(bf16 trainer -> block-FP8 generator, fp32 masters -> bf16) is one such plan plus a local
conversion (:func:`realloc.shards.convert.convert_store`) on one side, decided here:

* ``"source"``: each sender converts its shards into the *wire* layout (the source topology in
  the destination's format) before sending. Chosen when that format is smaller (the wire then
  carries the smaller bytes: half for bf16 -> FP8) and the source's ranks hold whole blocks of
  every quantized weight (:func:`realloc.layout.formats.check_block_layout`).
* ``"destination"``: the plan moves the source's format into the wire layout (the destination
  topology in the source's format) and each receiver converts from it. Chosen when the
  destination format is not smaller (dequantizing, widening casts) or the source's ranks cut
  blocks (FSDP chunks, a tp that splits a weight mid-block).

Each falls back to the other when its wire layout cannot exist (an FP8 source dequantized for a
destination whose tp splits blocks converts on the senders); when neither can (two block formats
whose topologies each split the other's blocks), ``ValueError`` names both reasons.
* ``None``: both layouts hold one format; the plan is the whole move.

The wire layout is the converting side's placement exactly (its pipeline stages included, pinned
as a ``layer_split`` where a rule chose them: ``pp_split="balanced"`` depends on the bytes of the
format), in the other side's format.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from realloc.layout import Layout
from realloc.spec.formats import unformatted

__all__ = ["Conversion", "conversion", "same_placement"]


@dataclass(frozen=True)
class Conversion:
    """Where a move converts (``"source"``, ``"destination"`` or ``None``) and the layout on the
    plan's converting end (``wire``: the layout the plan moves from or to, in the other format);
    ``reason`` says why, for reports."""

    where: str | None
    wire: Layout | None
    reason: str

    def plan_sides(self, src: Layout, dst: Layout) -> tuple[Layout, Layout]:
        """The ``(source, destination)`` layouts of the plan that moves the bytes."""
        if self.where == "source":
            return self.wire, dst
        if self.where == "destination":
            return src, self.wire
        return src, dst


def _without_format(layout: Layout) -> dict:
    options = dict(layout.options)
    options.pop("weight_format")
    return options


def _in_format(spec, layout: Layout) -> Layout:
    """``layout``'s placement of every element (topology, stages, conventions) holding the tensors
    of ``spec``, a formatted spec of the same model. The stages are pinned to ``layout``'s own:
    ``pp_split="balanced"`` splits by bytes, so the rule applied to another format's bytes could
    give other stages (3/3/2 in bf16, 2/4/2 in FP8), and the wire would not be ``layout``'s ranks."""
    topology = layout.topology
    if topology.layer_split is None and topology.pp > 1:
        topology = replace(topology, layer_split=layout.layer_counts)
    return Layout(spec, topology, **_without_format(layout))


def same_placement(a: Layout, b: Layout) -> bool:
    """Whether ``a`` and ``b`` hold one model with every element in the same place (topology,
    stages, padding, conventions), whatever weight format each holds: equal layouts, or one the
    other in another format (a :class:`Conversion`'s ``wire`` and the layout it stands for). A
    worker that sends a layout it does not hold accepts only this (it converts as it sends);
    anything else is a plan of another layout (actors/worker/guard.py).

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> spec = ModelSpec.preset("tiny")
        >>> tp2 = Layout(spec, Topology(tp=2))
        >>> same_placement(tp2, Layout(spec, Topology(tp=2), weight_format="bfloat16"))
        True
        >>> same_placement(tp2, Layout(spec, Topology(dp=2))), same_placement(tp2, Layout(spec, Topology(tp=2), 64))
        (False, False)
    """
    # Layout.key is (spec, then everything that places an element): equal keys past the spec
    # place every element alike; the specs then differ by their weight format at most
    return a.key[1:] == b.key[1:] and unformatted(a.spec) == unformatted(b.spec)


def conversion(src: Layout, dst: Layout) -> Conversion:
    """Where a move from ``src`` to ``dst`` converts formats (module docstring).

    ``ValueError`` when the layouts hold different models (not only different formats).

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> spec = ModelSpec.preset("bench-1gb")
        >>> c = conversion(Layout(spec, Topology(tp=2)), Layout(spec, Topology(dp=2), weight_format="fp8_block128"))
        >>> c.where, str(c.wire)
        ('source', 'dp=1,tp=2,pp=1 format fp8_block128')
    """
    if src.spec == dst.spec:
        return Conversion(None, None, "one format")
    a, b = unformatted(src.spec), unformatted(dst.spec)
    if a != b:
        a.check_same_as(b)  # names what differs
        raise ValueError(f"layouts of different models: {a.name!r} and {b.name!r}")
    src_bytes, dst_bytes = src.spec.total_bytes(), dst.spec.total_bytes()
    reason = f"{src.spec.weight_format or 'model dtypes'} -> {dst.spec.weight_format or 'model dtypes'}"
    # the side where the wire carries fewer bytes first; the other when that side cannot hold the
    # other format (a topology that splits blocks)
    sides = ("source", "destination") if dst_bytes < src_bytes else ("destination", "source")
    problems = []
    for where in sides:
        try:
            if where == "source":
                wire = _in_format(dst.spec, src)
            else:
                wire = _in_format(src.spec, dst)
        except ValueError as e:
            problems.append(f"the {where} ranks cannot convert ({e})")
            continue
        why = "converted before sending" if where == "source" else "converted after receiving"
        more = f": {problems[0]}" if problems else f" ({src_bytes} -> {dst_bytes} bytes)"
        return Conversion(where, wire, f"{reason}: {why}{more}")
    raise ValueError(f"{reason}: neither side can hold the other's format: {'; '.join(problems)}")
