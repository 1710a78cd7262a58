"""``realloc plan --svg FILE``: a picture of where a plan's bytes go.

Two views, both plain SVG written here (no plotting library), deterministic (the same plan gives
the same bytes) and carrying their numbers as ``data-*`` attributes so a program can read them
back:

* ``workers`` (small plans: at most :data:`WORKERS_VIEW_MAX_NODES` nodes of at most
  :data:`WORKERS_VIEW_MAX_PER_NODE` workers): one box per node (``<g class="node">``) with one row
  per worker (``<g class="worker">``: bars of the bytes it receives and sends, split into
  inter-node, intra-node and local copies), and one arrow per pair of nodes that exchange bytes
  (``<g class="pair">``), its width proportional to the bytes, rightward arrows above the boxes
  and leftward ones below.
* ``matrix`` (any size): a heatmap of inter-node bytes from node (rows) to node (columns), nodes
  taken together in consecutive groups when there are more than :data:`MATRIX_MAX_GROUPS`
  (``<rect class="pair">``), and beside each row the bytes leaving, entering and moving inside
  that group's nodes and its local copies (``<g class="node-group">``).

Bytes come from the plan's routes and segment lists as the simulator reads them
(:func:`realloc.sim.engine.route_arrays`, :func:`realloc.sim.engine.list_sizes`). Pure: numpy
and the plan only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np

from realloc._checks import check_choice
from realloc.atomic_files import atomic_write, check_output_file
from realloc.plan.records import Plan
from realloc.sim.engine import list_sizes, route_arrays
from realloc_tools.offline.units import decimal_size

__all__ = [
    "MATRIX_MAX_GROUPS",
    "VIEWS",
    "WORKERS_VIEW_MAX_NODES",
    "WORKERS_VIEW_MAX_PER_NODE",
    "Traffic",
    "check_svg_path",
    "plan_svg",
    "write_atomic",
]

#: ``auto`` draws workers when the plan is small enough for them, the matrix otherwise.
VIEWS = ("auto", "workers", "matrix")
#: The workers view draws every worker and an arrow per node pair: beyond this it is unreadable.
WORKERS_VIEW_MAX_NODES = 4
WORKERS_VIEW_MAX_PER_NODE = 16
#: Rows (and columns) of the matrix at most; more nodes are drawn in groups of consecutive nodes.
MATRIX_MAX_GROUPS = 32

INTER, INTRA, LOCAL = "#d95f02", "#1f78b4", "#8c8c8c"
#: Height of the title, the totals and the legend.
HEADER_H = 100
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
#: The matrix colour scale (light to dark orange), interpolated linearly in bytes.
HEAT = ((0xFF, 0xF1, 0xE0), (0xFD, 0x8D, 0x3C), (0x7F, 0x27, 0x04))


@dataclass(frozen=True)
class Traffic:
    """A plan's bytes by node and by worker (all int64 arrays).

    ``pair_bytes[i, j]``: bytes routed from workers on node ``i`` to workers on node ``j``
    (the diagonal: inside the node); ``sent[w]`` / ``received[w]``: worker ``w``'s bytes
    ``(inter-node, intra-node)``; ``local[w]``: the bytes it copies from its own source buffers.
    Nodes are numbered in the order of their first worker.
    """

    node_names: tuple[str, ...]
    node_of: np.ndarray
    pair_bytes: np.ndarray
    sent: np.ndarray
    received: np.ndarray
    local: np.ndarray

    @staticmethod
    def of(plan: Plan) -> "Traffic":
        workers = len(plan.nodes)
        index: dict[str, int] = {}
        node_of = np.array([index.setdefault(n, len(index)) for n in plan.nodes], dtype=np.int64)
        src, dst, lists, _ = route_arrays(plan)
        list_bytes, _ = list_sizes(plan)
        copies = np.array(plan.local_copies, dtype=np.int64).reshape(-1, 2)
        used = np.concatenate([src, dst, copies[:, 0]])
        if used.size and (used.min() < 0 or used.max() >= workers):
            raise ValueError(
                f"plan names worker {int(used.max()) if used.max() >= workers else int(used.min())} but places "
                f"{workers} workers (0..{workers - 1}) on nodes"
            )
        nbytes = list_bytes[lists]
        n = len(index)
        a, b = node_of[src], node_of[dst]
        inter = a != b

        def total(keys: np.ndarray, weights: np.ndarray, size: int) -> np.ndarray:
            # float64 sums of integers stay exact below 2**53 bytes (9 PB)
            return np.rint(np.bincount(keys, weights=weights, minlength=size)).astype(np.int64)

        def split(ends: np.ndarray) -> np.ndarray:
            return np.stack(
                [total(ends[inter], nbytes[inter], workers), total(ends[~inter], nbytes[~inter], workers)], 1
            )

        return Traffic(
            node_names=tuple(index),
            node_of=node_of,
            pair_bytes=total(a * n + b, nbytes, n * n).reshape(n, n),
            sent=split(src),
            received=split(dst),
            local=total(copies[:, 0], list_bytes[copies[:, 1]], workers),
        )

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def inter_node_bytes(self) -> int:
        return int(self.pair_bytes.sum() - np.trace(self.pair_bytes))

    @property
    def intra_node_bytes(self) -> int:
        return int(np.trace(self.pair_bytes))

    @property
    def local_bytes(self) -> int:
        return int(self.local.sum())

    def node_local(self) -> np.ndarray:
        return np.bincount(self.node_of, weights=self.local, minlength=self.num_nodes).astype(np.int64)

    def workers_per_node(self) -> np.ndarray:
        return np.bincount(self.node_of, minlength=self.num_nodes)


# -- the picture ----------------------------------------------------------------------------


def plan_svg(plan: Plan, *, title: str = "", view: str = "auto") -> str:
    """The SVG text of ``plan`` (see the module docstring); ``title`` is its first line.

    Example:
        >>> from realloc import ModelSpec, Topology, Placement, plan_reallocation
        >>> spec = ModelSpec.preset("tiny")
        >>> plan = plan_reallocation(spec, Topology(dp=2, tp=2), Topology(tp=4), Placement.blocks(4, 2))
        >>> plan_svg(plan).count('class="worker"')
        4
    """
    check_choice("view", view, VIEWS)
    traffic = Traffic.of(plan)
    per_node = int(traffic.workers_per_node().max())
    fits = traffic.num_nodes <= WORKERS_VIEW_MAX_NODES and per_node <= WORKERS_VIEW_MAX_PER_NODE
    if view == "workers" and not fits:
        raise ValueError(
            f"the workers view draws at most {WORKERS_VIEW_MAX_NODES} nodes of at most "
            f"{WORKERS_VIEW_MAX_PER_NODE} workers; this plan has {traffic.num_nodes} nodes of up to "
            f"{per_node} workers: use the matrix view (or auto)"
        )
    workers = view == "workers" or (view == "auto" and fits)
    if workers:
        body, width, height = _workers_view(traffic)
    else:
        body, width, height = _matrix_view(traffic)
    head = _header(traffic, title, "workers" if workers else "matrix")
    width = max(width, 20 + max(_text_width(line) for line in head))
    attrs = _attrs(
        xmlns="http://www.w3.org/2000/svg",
        width=width,
        height=height,
        viewBox=f"0 0 {width} {height}",
        font_family=FONT,
        font_size=12,
        data_view="workers" if workers else "matrix",
        data_workers=len(traffic.node_of),
        data_nodes=traffic.num_nodes,
        data_inter_node_bytes=traffic.inter_node_bytes,
        data_intra_node_bytes=traffic.intra_node_bytes,
        data_local_bytes=traffic.local_bytes,
    )
    background = f'<rect width="{width}" height="{height}" fill="#ffffff"/>'
    return "\n".join([f"<svg {attrs}>", background, *head, *body, "</svg>", ""])


def _header(t: Traffic, title: str, view: str) -> list[str]:
    total = t.inter_node_bytes + t.intra_node_bytes + t.local_bytes
    received = t.received.sum(1) + t.local
    busiest = int(received.argmax()) if received.size else 0
    lines = [
        _text(20, 26, title or "realloc plan", size=16, weight="bold"),
        _text(
            20,
            46,
            f"{len(t.node_of)} workers on {t.num_nodes} nodes; {decimal_size(total)} in all: "
            f"{decimal_size(t.inter_node_bytes)} between nodes, {decimal_size(t.intra_node_bytes)} inside nodes, "
            f"{decimal_size(t.local_bytes)} local copies",
        ),
        _text(
            20,
            64,
            f"most into one worker: {decimal_size(int(received.max(initial=0)))} (worker {busiest}); "
            "hover over a worker, node or arrow for its numbers",
            fill="#555555",
        ),
    ]
    x = 20
    for colour, name in ((INTER, "between nodes"), (INTRA, "inside a node"), (LOCAL, "local copy")):
        lines.append(f'<rect x="{x}" y="76" width="14" height="10" fill="{colour}"/>')
        lines.append(_text(x + 19, 85, name))
        x += 40 + 7 * len(name)
    if view == "matrix":
        lines.append(_text(x + 10, 85, "matrix: bytes from the row's nodes to the column's nodes", fill="#555555"))
    return lines


# -- workers view ---------------------------------------------------------------------------

NODE_W, GAP, ROW_H, LABEL_W, BAR_W = 270, 80, 18, 56, 92
NODE_TOP, NODE_BOTTOM = 62, 40
MAX_STROKE = 18.0


def _workers_view(t: Traffic) -> tuple[list[str], int, int]:
    n = t.num_nodes
    rows = int(t.workers_per_node().max())
    node_h = NODE_TOP + rows * ROW_H + NODE_BOTTOM
    inter = t.pair_bytes.copy()
    np.fill_diagonal(inter, 0)
    max_pair = int(inter.max(initial=0))
    max_span = max(n - 1, 1)

    def arc_height(span: int) -> float:
        return 46.0 + 38.0 * (span - 1)

    spans_up = [j - i for i in range(n) for j in range(n) if inter[i, j] and j > i]
    spans_down = [i - j for i in range(n) for j in range(n) if inter[i, j] and j < i]
    room_up = arc_height(max(spans_up)) + 24 if spans_up else 16
    room_down = arc_height(max(spans_down)) + 24 if spans_down else 16
    top = HEADER_H + room_up
    bottom = top + node_h
    out: list[str] = []

    # node boxes and their workers
    node_local = t.node_local()
    scale = max(int((t.received.sum(1) + t.local).max(initial=0)), int(t.sent.sum(1).max(initial=0)), 1)
    for i, name in enumerate(t.node_names):
        x = 20 + i * (NODE_W + GAP)
        members = np.flatnonzero(t.node_of == i).tolist()
        egress = int(inter[i].sum())
        ingress = int(inter[:, i].sum())
        intra = int(t.pair_bytes[i, i])
        out.append(
            "<g "
            + _attrs(
                class_="node",
                data_node=name,
                data_index=i,
                data_workers=len(members),
                data_egress_bytes=egress,
                data_ingress_bytes=ingress,
                data_intra_bytes=intra,
                data_local_bytes=int(node_local[i]),
            )
            + ">"
        )
        out.append(f"<title>{escape(name)}</title>")
        out.append(
            f'<rect x="{x}" y="{top}" width="{NODE_W}" height="{node_h}" rx="6" fill="#fafafa" stroke="#444444"/>'
        )
        out.append(_text(x + 10, top + 18, _short(name, 34), weight="bold", size=13))
        out.append(_text(x + 10, top + 35, f"out {decimal_size(egress)}  ·  in {decimal_size(ingress)}", fill=INTER))
        out.append(_text(x + LABEL_W, top + 54, "receives", fill="#555555", size=11))
        out.append(_text(x + LABEL_W + BAR_W + 12, top + 54, "sends", fill="#555555", size=11))
        for r, w in enumerate(members):
            out.extend(_worker_row(t, w, name, x, top + NODE_TOP + r * ROW_H, scale))
        foot = top + NODE_TOP + rows * ROW_H + 16
        out.append(_text(x + 10, foot, f"inside the node {decimal_size(intra)}", fill=INTRA))
        out.append(_text(x + 10, foot + 16, f"local copies {decimal_size(int(node_local[i]))}", fill="#666666"))
        out.append("</g>")

    # one arrow per node pair with bytes: rightward above the boxes, leftward below
    for i in range(n):
        for j in range(n):
            if i == j or not inter[i, j]:
                continue
            span = abs(j - i)
            reach = 0.45 * span / max_span
            xi, xj = 20 + i * (NODE_W + GAP), 20 + j * (NODE_W + GAP)
            if j > i:
                sx, ex, y, sign = xi + NODE_W * (1 - reach), xj + NODE_W * reach, top, -1
            else:
                sx, ex, y, sign = xi + NODE_W * reach, xj + NODE_W * (1 - reach), bottom, 1
            out.extend(
                _arrow(t.node_names[i], t.node_names[j], int(inter[i, j]), max_pair, sx, ex, y, sign, arc_height(span))
            )
    return out, int(40 + n * NODE_W + (n - 1) * GAP), int(bottom + room_down + 12)


def _worker_row(t: Traffic, w: int, node: str, x: float, y: float, scale: int) -> list[str]:
    (ri, ra), (si, sa), lc = t.received[w].tolist(), t.sent[w].tolist(), int(t.local[w])
    tip = (
        f"worker {w} on {node}: receives {decimal_size(ri)} from other nodes, {decimal_size(ra)} inside its node, "
        f"copies {decimal_size(lc)} locally; sends {decimal_size(si)} to other nodes, {decimal_size(sa)} inside its node"
    )
    out = [
        "<g "
        + _attrs(
            class_="worker",
            data_worker=w,
            data_node=node,
            data_recv_inter_bytes=ri,
            data_recv_intra_bytes=ra,
            data_local_bytes=lc,
            data_send_inter_bytes=si,
            data_send_intra_bytes=sa,
        )
        + ">",
        f"<title>{escape(tip)}</title>",
        _text(x + 10, y + 13, f"w{w}"),
    ]
    for bx, parts in (
        (x + LABEL_W, ((ri, INTER), (ra, INTRA), (lc, LOCAL))),
        (x + LABEL_W + BAR_W + 12, ((si, INTER), (sa, INTRA))),
    ):
        out.append(f'<rect x="{bx}" y="{y + 4}" width="{BAR_W}" height="10" fill="#eeeeee"/>')
        for nbytes, colour in parts:
            if nbytes:
                width = BAR_W * nbytes / scale
                out.append(f'<rect x="{_f(bx)}" y="{y + 4}" width="{_f(width)}" height="10" fill="{colour}"/>')
                bx += width
    out.append("</g>")
    return out


def _arrow(a: str, b: str, nbytes: int, largest: int, sx: float, ex: float, y: float, sign: int, h: float) -> list[str]:
    """A band from ``(sx, y)`` to ``(ex, y)`` bulging ``h`` up (``sign`` -1) or down (+1), with its head at the end."""
    stroke = max(1.5, MAX_STROKE * nbytes / largest)
    head = 9.0 + stroke * 0.6
    tip_y = y - sign * 1  # the head touches the box edge
    end_y = tip_y + sign * head
    path = f"M {_f(sx)} {_f(y + sign)} C {_f(sx)} {_f(y + sign * h)} {_f(ex)} {_f(y + sign * h)} {_f(ex)} {_f(end_y)}"
    half = stroke / 2 + 4
    arrowhead = f"{_f(ex - half)},{_f(end_y)} {_f(ex + half)},{_f(end_y)} {_f(ex)},{_f(tip_y)}"
    label_y = y + sign * (0.75 * h) + (-5 - stroke / 2 if sign < 0 else 13 + stroke / 2)
    return [
        "<g " + _attrs(class_="pair", data_src_node=a, data_dst_node=b, data_bytes=nbytes) + ">",
        f"<title>{escape(f'{a} -> {b}: {decimal_size(nbytes)} ({nbytes:,} bytes)')}</title>",
        f'<path d="{path}" fill="none" stroke="{INTER}" stroke-opacity="0.75" stroke-width="{_f(stroke)}"/>',
        f'<polygon points="{arrowhead}" fill="{INTER}"/>',
        _text((sx + ex) / 2, label_y, decimal_size(nbytes), anchor="middle", halo=True, weight="bold"),
        "</g>",
    ]


# -- matrix view ----------------------------------------------------------------------------

PANEL_W = 110


def _matrix_view(t: Traffic) -> tuple[list[str], int, int]:
    n = t.num_nodes
    per = math.ceil(n / MATRIX_MAX_GROUPS)
    groups = math.ceil(n / per)
    inter = t.pair_bytes.copy()
    np.fill_diagonal(inter, 0)
    padded = np.zeros((groups * per, groups * per), dtype=np.int64)
    padded[:n, :n] = inter
    block = padded.reshape(groups, per, groups, per).sum(axis=(1, 3))
    first = [g * per for g in range(groups)]
    last = [min(n, (g + 1) * per) - 1 for g in range(groups)]
    cell = max(8, min(28, 576 // groups))
    side = cell * groups
    mx, my = 96, HEADER_H + 56
    largest = int(block.max(initial=0))
    out = [
        _text(
            mx + side / 2, my - 34, "to node" + (" (groups of consecutive nodes)" if per > 1 else ""), anchor="middle"
        ),
        _text(mx - 60, my + side / 2, "from node", anchor="middle", rotate=True),
        f'<rect x="{mx}" y="{my}" width="{side}" height="{side}" fill="#f4f4f4" stroke="#999999"/>',
    ]

    def label(g: int) -> str:
        return str(first[g]) if first[g] == last[g] else f"{first[g]}–{last[g]}"

    # 10 px digits are about 6.2 px wide: label every step-th column so that labels do not touch
    step = math.ceil((6.2 * max(len(label(g)) for g in range(groups)) + 8) / cell)
    for g in range(0, groups, step):
        out.append(_text(mx + g * cell + cell / 2, my - 8, label(g), anchor="middle", size=10))
    for g in range(0, groups, math.ceil(13 / cell)):  # rows: one 10 px line each
        out.append(_text(mx - 6, my + g * cell + cell / 2 + 4, label(g), anchor="end", size=10))
    for r in range(groups):
        for c in range(groups):
            nbytes = int(block[r, c])
            if not nbytes:
                continue
            tip = f"nodes {label(r)} -> nodes {label(c)}: {decimal_size(nbytes)} ({nbytes:,} bytes)"
            out.append(
                "<rect "
                + _attrs(
                    class_="pair",
                    x=mx + c * cell,
                    y=my + r * cell,
                    width=cell,
                    height=cell,
                    fill=_heat(nbytes / largest),
                    data_src_nodes=f"{first[r]}-{last[r]}",
                    data_dst_nodes=f"{first[c]}-{last[c]}",
                    data_bytes=nbytes,
                )
                + f"><title>{escape(tip)}</title></rect>"
            )
    # colour scale under the matrix
    ky = my + side + 18
    for k in range(10):
        out.append(f'<rect x="{mx + k * 18}" y="{ky}" width="18" height="10" fill="{_heat((k + 0.5) / 10)}"/>')
    out.append(_text(mx, ky + 24, "0", size=10))
    out.append(_text(mx + 180, ky + 24, decimal_size(largest), anchor="end", size=10))
    out.append(_text(mx + 190, ky + 9, "bytes per cell, linear", size=10, fill="#555555"))
    if n > 1:
        note = (
            f"node numbers: {t.node_names[0]} is 0, {t.node_names[-1]} is {n - 1} (in the order of their first worker)"
        )
    else:
        note = f"node 0 is {t.node_names[0]}"
    out.append(_text(mx, ky + 44, _short(note, 120), size=10, fill="#555555"))

    # per group: bytes out, in, inside, local, on one scale
    px = mx + side + 30
    wpn = t.workers_per_node()
    node_local = t.node_local()
    columns = []
    for g in range(groups):
        nodes = slice(first[g], last[g] + 1)
        sub = t.pair_bytes[nodes, nodes]
        columns.append(
            (
                int(inter[nodes].sum()),
                int(inter[:, nodes].sum()),
                int(np.trace(sub)),
                int(node_local[nodes].sum()),
            )
        )
    scale = max(max(max(c) for c in columns), 1)
    heads = (("out of the nodes", INTER), ("into the nodes", INTER), ("inside a node", INTRA), ("local copies", LOCAL))
    for k, (name, colour) in enumerate(heads):
        out.append(_text(px + k * (PANEL_W + 10), my - 8, name, size=10, fill=colour))
    bar_h = max(3, cell - 4)
    for g, values in enumerate(columns):
        y = my + g * cell + (cell - bar_h) / 2
        nodes = slice(first[g], last[g] + 1)
        out.append(
            "<g "
            + _attrs(
                class_="node-group",
                data_first_node=first[g],
                data_last_node=last[g],
                data_workers=int(wpn[nodes].sum()),
                data_egress_bytes=values[0],
                data_ingress_bytes=values[1],
                data_intra_bytes=values[2],
                data_local_bytes=values[3],
            )
            + ">"
        )
        tip = (
            f"nodes {label(g)} ({int(wpn[nodes].sum())} workers): out {decimal_size(values[0])}, in {decimal_size(values[1])}, "
            f"inside a node {decimal_size(values[2])}, local copies {decimal_size(values[3])}"
        )
        out.append(f"<title>{escape(tip)}</title>")
        for k, ((_, colour), v) in enumerate(zip(heads, values)):
            bx = px + k * (PANEL_W + 10)
            out.append(f'<rect x="{bx}" y="{_f(y)}" width="{PANEL_W}" height="{bar_h}" fill="#f0f0f0"/>')
            if v:
                out.append(
                    f'<rect x="{bx}" y="{_f(y)}" width="{_f(PANEL_W * v / scale)}" height="{bar_h}" fill="{colour}"/>'
                )
        out.append("</g>")
    out.append(
        _text(px, my + side + 18, f"bars on one scale: full width {decimal_size(scale)}", size=10, fill="#555555")
    )
    width = px + 4 * (PANEL_W + 10) + 10
    return out, int(width), int(ky + 60)


def _heat(x: float) -> str:
    x = min(max(x, 0.0), 1.0) * (len(HEAT) - 1)
    k = min(int(x), len(HEAT) - 2)
    f = x - k
    rgb = (round(a + (b - a) * f) for a, b in zip(HEAT[k], HEAT[k + 1]))
    return "#" + "".join(f"{v:02x}" for v in rgb)


# -- SVG text helpers -----------------------------------------------------------------------


def _f(x: float) -> str:
    """A coordinate with at most one decimal (deterministic, short)."""
    return f"{x:.1f}".removesuffix(".0")


def _attrs(**kw: object) -> str:
    """``key="value"`` pairs: ``class_`` is ``class``, other underscores are dashes; values escaped."""
    parts = []
    for key, value in kw.items():
        name = "class" if key == "class_" else key.replace("_", "-")
        text = _f(value) if isinstance(value, float) else str(value)
        parts.append(f'{name}="{escape(text, {chr(34): "&quot;"})}"')
    return " ".join(parts)


def _text(
    x: float,
    y: float,
    text: str,
    *,
    size: int | None = None,
    weight: str | None = None,
    fill: str | None = None,
    anchor: str | None = None,
    halo: bool = False,
    rotate: bool = False,
) -> str:
    kw: dict[str, object] = {"x": float(x), "y": float(y)}
    if size:
        kw["font_size"] = size
    if weight:
        kw["font_weight"] = weight
    if fill:
        kw["fill"] = fill
    if anchor:
        kw["text_anchor"] = anchor
    if halo:
        kw.update(stroke="#ffffff", stroke_width=3, paint_order="stroke")
    if rotate:
        kw["transform"] = f"rotate(-90 {_f(x)} {_f(y)})"
    return f"<text {_attrs(**kw)}>{escape(text)}</text>"


def _text_width(element: str) -> int:
    """About how wide a ``<text>`` element of :func:`_text` draws (12 px DejaVu Sans is about 7 px a
    character; 16 px bold about 10); 0 for other elements."""
    if not element.startswith("<text"):
        return 0
    content = element[element.index(">") + 1 : element.rindex("<")]
    return int(len(content) * (10 if 'font-size="16"' in element else 7)) + 20


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- writing --------------------------------------------------------------------------------


def check_svg_path(path: str, option: str = "--svg") -> Path:
    """``path`` as a :class:`Path` if an SVG can be written there, else ``ValueError`` naming why."""
    if Path(path).suffix.lower() != ".svg":
        raise ValueError(
            f"{option} {path!r}: the file name must end in .svg (for a PNG, render the SVG: see docs/plan_pictures.sh)"
        )
    return check_output_file(path, option)


def write_atomic(path: Path, text: str) -> int:
    """Write ``text`` to ``path`` whole or not at all (:func:`realloc.atomic_files.atomic_write`);
    returns the bytes written."""
    data = text.encode("utf-8")
    atomic_write(path, data)
    return len(data)
