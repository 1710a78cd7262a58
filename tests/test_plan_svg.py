"""``realloc plan --svg``: the picture of a plan (realloc_tools/offline/svg.py), parsed back with
xml.etree and checked against the plan's own routes and statistics."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import realloc_tools.offline.svg as plan_svg_module
from realloc.layout import Topology
from realloc.plan import Placement, plan_reallocation
from realloc.spec import ModelSpec
from realloc_tools.offline.plan import main
from realloc_tools.offline.simulate import plan_move
from realloc_tools.offline.svg import MATRIX_MAX_GROUPS, WORKERS_VIEW_MAX_NODES, plan_svg, write_atomic

NS = "{http://www.w3.org/2000/svg}"
TINY = ModelSpec.preset("tiny")
CLI = ["plan", "--model", "tiny", "--src", "dp=2,tp=2,pp=2", "--dst", "dp=4,tp=2", "--gpus-per-node", "4"]


def plan_of(src: str, dst: str, placement: Placement):
    return plan_reallocation(TINY, Topology.parse(src), Topology.parse(dst), placement)


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def elements(root: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in root.iter(NS + tag) if e.get("class") == cls]


def ints(items: list[ET.Element], key: str) -> int:
    return sum(int(e.get(key)) for e in items)


def route_bytes(plan) -> Counter:
    """Bytes of every (sender node, receiver node) pair, summed over the plan's routes by the
    plan's own segment sizes (independent of the simulator's arrays the picture reads)."""
    out: Counter = Counter()
    for _, s, d, j in plan.routes():
        out[plan.nodes[s], plan.nodes[d]] += plan.list_bytes(j)
    return out


def local_bytes(plan) -> Counter:
    out: Counter = Counter()
    for w, j in plan.local_copies:
        out[w] += plan.list_bytes(j)
    return out


def check_workers_view(plan) -> ET.Element:
    root = parse(plan_svg(plan))
    assert root.get("data-view") == "workers"
    pairs = route_bytes(plan)
    locals_ = local_bytes(plan)
    nodes = elements(root, "g", "node")
    # one group per node, in the order of their first worker, with its workers inside
    assert [g.get("data-node") for g in nodes] == list(dict.fromkeys(plan.nodes))
    seen = []
    for g in nodes:
        workers = elements(g, "g", "worker")
        assert [int(w.get("data-worker")) for w in workers] == [
            i for i, n in enumerate(plan.nodes) if n == g.get("data-node")
        ]
        assert int(g.get("data-workers")) == len(workers)
        seen += [int(w.get("data-worker")) for w in workers]
        name = g.get("data-node")
        assert int(g.get("data-intra-bytes")) == pairs[name, name]
        assert int(g.get("data-egress-bytes")) == sum(b for (a, c), b in pairs.items() if a == name != c)
        assert int(g.get("data-ingress-bytes")) == sum(b for (a, c), b in pairs.items() if c == name != a)
        assert int(g.get("data-local-bytes")) == sum(b for w, b in locals_.items() if plan.nodes[w] == name)
    assert sorted(seen) == list(range(len(plan.nodes)))
    # one arrow per node pair that exchanges bytes, with exactly those bytes
    drawn = {
        (p.get("data-src-node"), p.get("data-dst-node")): int(p.get("data-bytes")) for p in elements(root, "g", "pair")
    }
    assert drawn == {k: v for k, v in pairs.items() if k[0] != k[1] and v}
    # and every worker's bars say what the plan's statistics say
    workers = elements(root, "g", "worker")
    sends = {
        int(w.get("data-worker")): int(w.get("data-send-inter-bytes")) + int(w.get("data-send-intra-bytes"))
        for w in workers
    }
    recvs = {
        int(w.get("data-worker")): int(w.get("data-recv-inter-bytes")) + int(w.get("data-recv-intra-bytes"))
        for w in workers
    }
    assert {str(w): b for w, b in sends.items() if b} == plan.stats["rank_send_bytes"]
    assert {str(w): b for w, b in recvs.items() if b} == plan.stats["rank_recv_bytes"]
    assert {
        w: int(e.get("data-local-bytes")) for w, e in zip(sends, workers) if int(e.get("data-local-bytes"))
    } == dict(locals_)
    return root


def check_totals(root: ET.Element, plan) -> None:
    """The totals on the root and the sums of the node-pair and per-node elements are the plan's."""
    stats = plan.stats
    assert int(root.get("data-inter-node-bytes")) == stats["bytes_inter_node"]
    assert int(root.get("data-intra-node-bytes")) == stats["bytes_intra_node"]
    assert int(root.get("data-local-bytes")) == stats["bytes_local_copy"]
    pair_tag = "g" if root.get("data-view") == "workers" else "rect"
    assert ints(elements(root, pair_tag, "pair"), "data-bytes") == stats["bytes_inter_node"]
    per_node = elements(root, "g", "node") or elements(root, "g", "node-group")
    assert ints(per_node, "data-egress-bytes") == stats["bytes_inter_node"]
    assert ints(per_node, "data-ingress-bytes") == stats["bytes_inter_node"]
    assert ints(per_node, "data-intra-bytes") == stats["bytes_intra_node"]
    assert ints(per_node, "data-local-bytes") == stats["bytes_local_copy"]
    assert ints(per_node, "data-workers") == len(plan.nodes)


def test_workers_view_of_a_two_node_move():
    plan = plan_of("dp=2,tp=2,pp=2", "dp=4,tp=2", Placement.blocks(8, 4))
    assert plan.stats["bytes_inter_node"] and plan.stats["bytes_intra_node"] and plan.stats["bytes_local_copy"]
    root = check_workers_view(plan)
    check_totals(root, plan)
    assert len(elements(root, "g", "node")) == 2 and len(elements(root, "g", "worker")) == 8


def test_matrix_view_groups_many_nodes_and_keeps_every_byte():
    n = 2 * MATRIX_MAX_GROUPS + 3  # 67 one-worker nodes: groups of 3
    plan = plan_of(f"dp={n}", f"fsdp={n}", Placement.blocks(n, 1))
    root = parse(plan_svg(plan))
    assert root.get("data-view") == "matrix"
    check_totals(root, plan)
    groups = elements(root, "g", "node-group")
    spans = [(int(g.get("data-first-node")), int(g.get("data-last-node"))) for g in groups]
    assert spans[0][0] == 0 and spans[-1][1] == n - 1 and len(groups) <= MATRIX_MAX_GROUPS
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))  # consecutive, each node once
    # every cell holds the bytes from its row's nodes to its column's nodes
    index = {name: i for i, name in enumerate(dict.fromkeys(plan.nodes))}
    expected: Counter = Counter()
    group_of = {i: g for g, (a, b) in enumerate(spans) for i in range(a, b + 1)}
    for (a, b), nbytes in route_bytes(plan).items():
        if a != b:
            expected[group_of[index[a]], group_of[index[b]]] += nbytes
    cells = elements(root, "rect", "pair")
    assert len(cells) <= MATRIX_MAX_GROUPS**2
    got = {}
    for c in cells:
        r, k = (spans.index(tuple(map(int, c.get(key).split("-")))) for key in ("data-src-nodes", "data-dst-nodes"))
        got[r, k] = int(c.get("data-bytes"))
    assert got == {k: v for k, v in expected.items() if v}


def test_copy_into_other_workers():
    """A copy into other workers (``copy_to``, ``realloc simulate --dst-workers``): the source
    workers only send, every destination worker receives (and may forward inside its node), and
    every byte is drawn."""
    plan, _ = plan_move(TINY, "tp=2,pp=2", "dp=2,tp=2", 4, dst_workers=4)
    root = check_workers_view(plan)
    check_totals(root, plan)
    for w in elements(root, "g", "worker"):
        sent = int(w.get("data-send-inter-bytes")) + int(w.get("data-send-intra-bytes"))
        got = int(w.get("data-recv-inter-bytes")) + int(w.get("data-recv-intra-bytes")) + int(w.get("data-local-bytes"))
        if int(w.get("data-worker")) < 4:
            assert got == 0
        else:
            assert got > 0
        assert sent or got


def test_the_same_plan_draws_the_same_bytes():
    placement = Placement.blocks(8, 4)
    a = plan_svg(plan_of("dp=2,tp=2,pp=2", "dp=4,tp=2", placement), title="t")
    b = plan_svg(plan_of("dp=2,tp=2,pp=2", "dp=4,tp=2", placement), title="t")
    assert a == b
    assert a != plan_svg(plan_of("dp=2,tp=2,pp=2", "tp=4,pp=2", placement), title="t")


def test_views_and_their_limits():
    small = plan_of("dp=2,tp=2,pp=2", "dp=4,tp=2", Placement.blocks(8, 4))
    assert parse(plan_svg(small, view="matrix")).get("data-view") == "matrix"
    check_totals(parse(plan_svg(small, view="matrix")), small)
    n = WORKERS_VIEW_MAX_NODES + 1
    wide = plan_of(f"dp={n}", f"fsdp={n}", Placement.blocks(n, 1))
    assert parse(plan_svg(wide)).get("data-view") == "matrix"
    with pytest.raises(ValueError, match=f"at most {WORKERS_VIEW_MAX_NODES} nodes.*has {n} nodes"):
        plan_svg(wide, view="workers")
    with pytest.raises(ValueError, match="view must be one of 'auto', 'workers', 'matrix', got 'pie'"):
        plan_svg(small, view="pie")


def test_names_and_title_are_escaped():
    odd = ('a<b&"c', "d'e>f")
    plan = plan_of("tp=2", "dp=2", Placement(odd))
    root = parse(plan_svg(plan, title='<script>&"'))
    assert [g.get("data-node") for g in elements(root, "g", "node")] == list(odd)
    assert any(t.text == '<script>&"' for t in root.iter(NS + "text"))


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(["tp=4", "dp=2,tp=2", "tp=2,pp=2", "fsdp=4", "dp=4", "pp=4", "dp=2,pp=2"]),
    st.sampled_from(["tp=4", "dp=2,tp=2", "tp=2,pp=2", "fsdp=4", "dp=4", "pp=4", "dp=2,pp=2"]),
    st.sampled_from([1, 2, 3, 4]),
)
def test_any_small_layout_draws_every_byte(src, dst, per_node):
    plan = plan_of(src, dst, Placement.blocks(4, per_node))
    check_totals(check_workers_view(plan), plan)


# -- the command line -------------------------------------------------------------------------


def test_cli_writes_the_picture(capsys, tmp_path):
    path = tmp_path / "plan.svg"
    assert main(CLI + ["--svg", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    text = path.read_text()
    assert report["svg"]["path"] == str(path) and report["svg"]["bytes"] == len(text.encode())
    root = parse(text)
    assert int(root.get("data-inter-node-bytes")) == report["bytes_inter_node"]
    assert int(root.get("data-intra-node-bytes")) == report["bytes_intra_node"]
    assert int(root.get("data-local-bytes")) == report["bytes_local_copy"]
    assert len(elements(root, "g", "worker")) == report["world_size"]
    umask = os.umask(0)
    os.umask(umask)
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.svg"]  # no temporary file left
    assert main(CLI + ["--svg", str(path), "--svg-view", "matrix"]) == 0
    assert "picture" in capsys.readouterr().out
    assert parse(path.read_text()).get("data-view") == "matrix"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--svg", "{tmp}/plan.png"], "must end in .svg"),
        (["--svg", "{tmp}/missing/plan.svg"], "does not exist"),
        (["--svg", "{tmp}/dir.svg"], "is a directory"),
        (["--svg", "{tmp}/plan.svg", "--svg-view", "pie"], "--svg-view must be one of 'auto', 'workers', 'matrix'"),
        (["--svg-view", "matrix"], "--svg-view matrix needs --svg FILE"),
    ],
)
def test_cli_refuses_bad_paths_and_options(capsys, tmp_path, extra, message):
    (tmp_path / "dir.svg").mkdir()
    assert main(CLI + [a.replace("{tmp}", str(tmp_path)) for a in extra]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.startswith("realloc: error: ") and not captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.svg"]


def test_cli_workers_view_of_a_large_plan_is_refused(capsys, tmp_path):
    argv = ["plan", "--model", "tiny", "--src", "dp=8", "--dst", "fsdp=8", "--gpus-per-node", "1"]
    assert main(argv + ["--svg", str(tmp_path / "p.svg"), "--svg-view", "workers"]) == 2
    assert "use the matrix view" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch, capsys):
    path = tmp_path / "plan.svg"
    path.write_text("old picture")

    def broken(*_):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "<svg/>")
    assert path.read_text() == "old picture" and [p.name for p in tmp_path.iterdir()] == ["plan.svg"]

    def no_picture(*_, **__):
        raise ValueError("cannot draw")

    monkeypatch.setattr(plan_svg_module, "plan_svg", no_picture)
    assert main(CLI + ["--svg", str(path)]) == 2
    assert "cannot draw" in capsys.readouterr().err
    assert path.read_text() == "old picture" and [p.name for p in tmp_path.iterdir()] == ["plan.svg"]


def test_docs_pictures_are_made_by_the_command_beside_them():
    """Every picture in docs/img named in the README is there, with its command beside it."""
    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    section = readme[readme.index("### realloc plan --svg") :]
    section = section[: section.index("\n## ")]
    pictures = [line.split("(")[1].split(")")[0] for line in section.splitlines() if line.startswith("![")]
    assert pictures
    for picture in pictures:
        assert (root / picture).is_file(), picture
        assert f"--svg {picture.removesuffix('.png')}.svg" in section or f"--svg {picture}" in section
