"""The import structure of the project's own packages, read from the source with ``ast``.

- No import circles among the modules of ``realloc/``, ``actors/`` and ``realloc_tools/``. Every import
  counts, function-local ones included (a lazy import that only dodges a circle is still a
  circle); only ``if TYPE_CHECKING:`` blocks are left out, since they never run.
- No private name (leading ``_``) imported from another module: the underscore means "this file
  only". A module whose own name starts with ``_`` (``realloc/spec/_hf_fields.py``) is private
  to its package and its names are public inside it.
- ``actors/`` says which process runs the code (issue 36): ``driver/`` (the driver process),
  ``worker/`` (each worker actor), ``wire/`` (the data plane both ends of a route run), and at the
  top the records that cross the Ray boundary and the helpers both sides share (:data:`ACTORS_TOP`).
  The top imports none of the three folders; ``wire/`` imports neither ``worker/`` nor
  ``driver/`` (so any process can run it: tests/test_wire_plain_process.py); ``worker/`` imports
  nothing of ``driver/``; and ``driver/`` reaches the worker only through the package face
  ``actors.worker`` (the actor class it starts and ``RESERVED_METHODS``), never a module inside it.
- No private *attribute* of another module's class: ``x._name`` (``x`` not ``self``/``cls``) in a
  module of ``actors/`` only for a private member of a class of that module (another instance
  of its own class, as the ledger's ``exclusive`` takes several groups' locks). The modules a
  group's state passes through (:data:`NO_PRIVATE_ATTRIBUTES`: staged updates, fleets,
  checkpoints) use none at all; :data:`PRIVATE_ATTRIBUTES_ALLOWED` names the exceptions and why.

Run as a script for the numbers quoted in docs/architecture.md::

    python tests/test_structure_layers.py

prints the number of import circles (and their members) and the installed top-level names.
(That importing ``realloc.spec``/``layout``/``plan`` pulls in no torch, and that ``realloc``
never imports Ray, is checked by ``tests/test_cli.py``.)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
#: The project's top-level packages whose modules make the graph.
PACKAGES = ("realloc", "actors", "realloc_tools")


class Import(NamedTuple):
    """One import statement's target, as found in ``path`` at ``line``."""

    path: Path
    line: int
    module: str  # the importing module's target: a module of the graph
    names: tuple[str, ...]  # for ``from module import a, b``: ("a", "b"); empty for ``import module``


def module_name(path: Path) -> str:
    """``realloc/spec/model.py`` -> ``realloc.spec.model``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of :data:`PACKAGES`, by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, functions included, ``if TYPE_CHECKING:`` bodies not."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children = node.orelse  # the TYPE_CHECKING body never runs
        stack.extend(children)


def imports(path: Path, modules: dict[str, Path]) -> list[Import]:
    """The imports of project modules in the file at ``path``. ``from pkg import sub`` names the
    submodule when ``pkg.sub`` is a module, else ``pkg`` itself (a name its ``__init__`` holds)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.append(Import(path, node.lineno, alias.name, ()))
            continue
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        if base not in modules:
            continue
        plain = []
        for alias in node.names:
            if f"{base}.{alias.name}" in modules:
                found.append(Import(path, node.lineno, f"{base}.{alias.name}", ()))
            else:
                plain.append(alias.name)
        if plain:
            found.append(Import(path, node.lineno, base, tuple(plain)))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (self-imports left out)."""
    modules = project_modules()
    return {name: {i.module for i in imports(path, modules)} - {name} for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The circles of the import graph: its strongly connected components of two or more
    modules (Tarjan's algorithm, iterative), each sorted, the list sorted."""
    graph = import_graph() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return sorted(circles)


def private_imports() -> list[str]:
    """``path:line: from module import _name`` for every private name imported from another
    module of the project (a name defined in a ``_``-prefixed module is that package's own)."""
    modules = project_modules()
    offenders = []
    for path in modules.values():
        for imp in imports(path, modules):
            if imp.module.rpartition(".")[2].startswith("_"):
                continue  # a private module's names are its package's
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    offenders.append(f"{path.relative_to(ROOT)}:{imp.line}: from {imp.module} import {name}")
    return sorted(offenders)


#: The folders of ``actors/``, by the process that runs them (``vllm``: inside vLLM's processes;
#: ``trainer``: inside the user's trainer processes, whose rank 0 drives the update).
ACTORS_PARTS = ("driver", "worker", "wire", "vllm", "trainer")
#: The modules at the top of ``actors/``: records and helpers both sides use (the face, ``actors``
#: itself, hands names on and may import anything).
ACTORS_TOP = (
    "actors.config",
    "actors.errors",
    "actors.lanes",
    "actors.metrics",
    "actors.records",
    "actors.remote",
    "actors.trace",
)
#: What each part of ``actors/`` may import from ``actors/`` (besides itself); ``"<part> face"``
#: is a package's ``__init__`` alone (``actors.worker``: the worker's names; ``actors.vllm``: the
#: messages both ends of the vLLM backend read, with no vLLM import), not a module inside it.
ACTORS_MAY_IMPORT = {
    "top": ("top",),
    "wire": ("top",),
    "worker": ("top", "wire"),
    "vllm": ("top", "wire"),
    "driver": ("top", "wire", "worker face", "vllm face"),
    "trainer": ("top", "wire", "driver", "vllm face"),
}


def actors_part(module: str) -> str | None:
    """Where ``module`` sits in ``actors/``: ``"face"`` (``actors``), ``"top"``, a part's face
    (``actors.worker``: ``"worker face"``), a folder of :data:`ACTORS_PARTS`, or ``"unplaced"``
    (a module of ``actors/`` in none of them); None outside ``actors/``."""
    if module == "actors":
        return "face"
    if not module.startswith("actors."):
        return None
    if module in ACTORS_TOP:
        return "top"
    folder = module.split(".")[1]
    if module == f"actors.{folder}" and folder in ACTORS_PARTS and folder != "wire" and folder != "driver":
        return f"{folder} face"
    return folder if folder in ACTORS_PARTS else "unplaced"


def actors_layer_violations(graph: dict[str, set[str]] | None = None) -> list[str]:
    """``importer -> imported (why)`` for every import inside ``actors/`` that the floors above
    forbid, and every module of ``actors/`` outside the tree."""
    graph = import_graph() if graph is None else graph
    found = []
    for module in sorted(graph):
        part = actors_part(module)
        if part is None or part == "face":
            continue
        if part == "unplaced":
            found.append(f"{module}: not in {', '.join(ACTORS_PARTS)}/ nor at the top ({', '.join(ACTORS_TOP)})")
            continue
        own = part.removesuffix(" face")
        allowed = {own, f"{own} face", *ACTORS_MAY_IMPORT.get(own, ())}
        for target in sorted(graph[module]):
            where = actors_part(target)
            if where is None or where in allowed:
                continue
            found.append(
                f"{module} -> {target} ({own} may import {', '.join(sorted(allowed - {own, own + ' face'}))} only)"
            )
    return found


#: The modules of ``actors/`` a group's state passes through but does not own (its one writer is
#: actors/driver/ledger.py): they touch no private attribute of anything but ``self``/``cls``,
#: their own module's classes' included.
NO_PRIVATE_ATTRIBUTES = ("actors.driver.staged", "actors.driver.fleet", "actors.driver.checkpoint")
#: Private attributes other modules may still use, and why.
#: (None now: world formation, the last one, is the public ``ModelGroup.world_for(lane, ...)``.)
PRIVATE_ATTRIBUTES_ALLOWED: dict[str, str] = {}


def class_privates(tree: ast.AST) -> set[str]:
    """The private members (one leading ``_``, not dunder) of the classes defined in ``tree``:
    methods and class attributes defined in their bodies, and attributes their methods assign
    on ``self``/``cls``."""
    names = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(stmt.name)
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {n for n in names if _is_private(n)}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_attribute_uses(sources: dict[str, str] | None = None) -> list[str]:
    """``module:line: expr`` for every read or write of a private attribute (``x._name``, ``x``
    not ``self``/``cls``) in ``actors/`` that is a member of a class of another module of
    ``actors/`` (and of none of the module's own), or, in :data:`NO_PRIVATE_ATTRIBUTES`, of
    anything; :data:`PRIVATE_ATTRIBUTES_ALLOWED` left out. ``sources``: module -> its source text
    (default: the files of ``actors/``)."""
    if sources is None:
        sources = {m: p.read_text() for m, p in project_modules().items() if m == "actors" or m.startswith("actors.")}
    trees = {m: ast.parse(text) for m, text in sources.items()}
    privates = {m: class_privates(tree) for m, tree in trees.items()}
    found = []
    for module, tree in sorted(trees.items()):
        elsewhere = set().union(*(names for m, names in privates.items() if m != module))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in PRIVATE_ATTRIBUTES_ALLOWED:
                continue
            foreign = node.attr in elsewhere and node.attr not in privates[module]
            if foreign or module in NO_PRIVATE_ATTRIBUTES:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def installed_top_level_names() -> list[str]:
    """The top-level packages ``pip install`` of this checkout installs: setuptools' own package
    finder run with ``pyproject.toml``'s ``packages.find`` include list."""
    from setuptools import find_packages

    text = (ROOT / "pyproject.toml").read_text()
    line = next(line for line in text.splitlines() if line.strip().startswith("include") and "[" in line)
    include = [name.strip(' "') for name in line.split("[", 1)[1].rstrip("]").split(",")]
    return sorted({name.split(".")[0] for name in find_packages(str(ROOT), include=include)})


def test_one_namespace_besides_actors_is_installed():
    assert installed_top_level_names() == ["actors", "realloc", "realloc_tools"]


def test_no_import_circles():
    circles = import_cycles()
    assert not circles, f"{len(circles)} import circle(s): " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_private_names_imported_across_modules():
    offenders = private_imports()
    assert not offenders, "private names imported from another module:\n" + "\n".join(offenders)


def test_actors_says_which_process_runs_the_code():
    for part in ACTORS_PARTS:
        assert (ROOT / "actors" / part / "__init__.py").is_file(), f"actors/{part}/ is not a package"
    violations = actors_layer_violations()
    assert not violations, "imports across the floors of actors/:\n" + "\n".join(violations)


def test_the_floor_rule_refuses_what_it_should():
    graph = {
        "actors": {"actors.driver.group", "actors.worker.actor"},
        "actors.records": set(),
        "actors.wire.executor": {"actors.records", "actors.worker.actor"},  # wire -> worker: refused
        "actors.worker": {"actors.worker.actor"},
        "actors.worker.actor": {"actors.wire.executor", "actors.driver.group"},  # worker -> driver: refused
        "actors.driver.group": {"actors.worker", "actors.wire.executor", "actors.worker.kept"},  # a worker module
        "actors.driver.vllm": {"actors.vllm", "actors.vllm.engine"},  # the vLLM face: yes; its engine: no
        "actors.vllm": {"actors.vllm.messages"},
        "actors.vllm.engine": {"actors.wire.executor", "actors.worker.actor"},  # vLLM's process runs no ShardWorker
        "actors.stray": set(),  # outside the tree
    }
    assert actors_layer_violations(graph) == [
        "actors.driver.group -> actors.worker.kept (driver may import top, vllm face, wire, worker face only)",
        "actors.driver.vllm -> actors.vllm.engine (driver may import top, vllm face, wire, worker face only)",
        "actors.stray: not in " + ", ".join(ACTORS_PARTS) + "/ nor at the top (" + ", ".join(ACTORS_TOP) + ")",
        "actors.vllm.engine -> actors.worker.actor (vllm may import top, wire only)",
        "actors.wire.executor -> actors.worker.actor (wire may import top only)",
        "actors.worker.actor -> actors.driver.group (worker may import top, wire only)",
    ]


def test_no_private_attributes_of_another_modules_class():
    offenders = private_attribute_uses()
    assert not offenders, (
        "private attributes used outside their class's module (or in a module that owns no state):\n"
        + "\n".join(offenders)
    )


def test_the_private_attribute_rule_refuses_what_it_should(monkeypatch):
    monkeypatch.setitem(PRIVATE_ATTRIBUTES_ALLOWED, "_ensure_world", "an exception, as the rule allows one")
    sources = {
        "actors.driver.group": (
            "class ModelGroup:\n"
            "    _kind = 'g'\n"
            "    def __init__(self):\n        self._lock, self.ledger = None, None\n        self.__slot = 0\n"
            "    def _announce(self, other):\n        other._lock = 1\n        return self._lock\n"
            "    def _ensure_world(self):\n        pass\n"
        ),
        "actors.driver.staged": (
            "def commit(dest, handle):\n"
            "    dest._announce(dest)\n"  # another module's class: refused
            "    dest._ensure_world()\n"  # allowed (PRIVATE_ATTRIBUTES_ALLOWED)
            "    handle._refs\n"  # a strict module: refused even if nobody in actors/ defines it
            "    dest.__class__\n"  # dunder: not private
        ),
        "actors.driver.world": (
            "class World:\n    def __init__(self):\n        self._rank = {}\n"
            "    def covers(self, other, actor):\n        return other._rank, actor._actor_id, other._lock\n"
        ),
    }
    assert class_privates(ast.parse(sources["actors.driver.group"])) == {"_kind", "_lock", "_announce", "_ensure_world"}
    # group.py's other._lock is its own class's (another instance): allowed; world.py's
    # other._rank is its own, actor._actor_id nobody's in actors/ (Ray's handle), other._lock ModelGroup's
    assert private_attribute_uses(sources) == [
        "actors.driver.staged:2: dest._announce",
        "actors.driver.staged:4: handle._refs",
        "actors.driver.world:5: other._lock",
    ]


def test_the_reader_sees_what_it_should():
    # Function-local imports count, TYPE_CHECKING-only ones do not; a known import is an edge.
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
        "def f():\n    import c\n"
    )
    assert sorted(alias.name for node in _import_nodes(tree) for alias in node.names) == ["TYPE_CHECKING", "b", "c"]
    assert "realloc.boxes" in import_graph()["realloc_tools.offline.plan"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def main() -> int:
    circles = import_cycles()
    print(f"import circles among {', '.join(p + '/' for p in PACKAGES)}: {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    private = private_imports()
    print(f"private names imported across modules: {len(private)}")
    for line in private:
        print("  " + line)
    layers = actors_layer_violations()
    print(f"imports across the floors of actors/ (driver/, worker/, wire/, top): {len(layers)}")
    for line in layers:
        print("  " + line)
    attributes = private_attribute_uses()
    print(f"private attributes of another module's class used in actors/: {len(attributes)}")
    for line in attributes:
        print("  " + line)
    print("installed top-level names: " + ", ".join(installed_top_level_names()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
