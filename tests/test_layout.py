"""The folder tree keeps its architecture: the top-level packages depend on each other one way,
no import circles among ``api``, ``workers`` and ``web``, no layer imports one above it, and no
module imports another one's underscore (private) names.

The import graph is read from the source (a walk over every ``import`` statement, including the
ones inside functions and under ``if TYPE_CHECKING:``: a deferred import still ties two modules
together), so nothing is imported to check it. An edge goes to the most specific module named:
``from api.services import pairings`` is an edge to ``api.services.pairings``.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from graphlib import TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("geometry", "api", "cli", "workers", "web")


@dataclass(frozen=True)
class Import:
    """One module naming another: where (file and line) and which module it reaches."""

    target: str
    path: Path
    line: int


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` or its nearest enclosing module among ``modules``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _package_of(name: str, path: Path) -> str:
    """The package a module's relative imports start from (a package's own, for ``__init__``)."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _source(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` statement in ``package`` reads."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def import_graph(modules: Mapping[str, Path]) -> dict[str, list[Import]]:
    """For each module, the imports that reach another module of ``modules``."""
    graph: dict[str, list[Import]] = {}
    for name, path in modules.items():
        package = _package_of(name, path)
        edges: list[Import] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _source(node, package)
                named = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            for target in named:
                known = _known(target, modules)
                if known is not None and known != name:
                    edges.append(Import(known, path, node.lineno))
        graph[name] = edges
    return graph


def _strongly_connected(graph: Mapping[str, list[Import]]) -> list[set[str]]:
    """Tarjan's components with more than one module (each holds at least one circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for edge in graph[module]:
            if edge.target not in index:
                visit(edge.target)
                low[module] = min(low[module], low[edge.target])
            elif edge.target in on_stack:
                low[module] = min(low[module], index[edge.target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _shortest_circle(
    graph: Mapping[str, list[Import]], component: set[str]
) -> list[tuple[str, Import]]:
    """A shortest circle through the component's first module: ``(module, its import)`` steps."""
    start = min(component)
    reached_by: dict[str, tuple[str, Import]] = {}
    queue = deque([start])
    while queue and start not in reached_by:
        module = queue.popleft()
        for edge in graph[module]:
            if edge.target in component and edge.target not in reached_by:
                reached_by[edge.target] = (module, edge)
                queue.append(edge.target)
    steps, module = [], start
    while not steps or module != start:
        module, edge = reached_by[module]
        steps.append((module, edge))
    return steps[::-1]


def import_circles(root: Path, packages: Iterable[str]) -> list[str]:
    """Each circle as ``a -> b -> a`` with the file and line of every import in it."""
    graph = import_graph(module_files(root, packages))
    described = []
    for component in _strongly_connected(graph):
        steps = _shortest_circle(graph, component)
        names = " -> ".join([*(module for module, _ in steps), steps[0][0]])
        where = ", ".join(f"{edge.path.relative_to(root)}:{edge.line}" for _, edge in steps)
        described.append(f"{names}  (imports at {where})")
    return described


def test_no_import_circles_among_api_workers_and_web() -> None:
    modules = module_files(ROOT, PACKAGES)
    assert len(modules) > 60, f"the walk found only {len(modules)} modules under {ROOT}"
    circles = import_circles(ROOT, PACKAGES)
    assert not circles, "import circles (move the shared piece down a layer):\n" + "\n".join(
        circles
    )


#: What each top-level package may import besides itself. As arrows they run one way:
#: geometry ← web ← api ← cli, and geometry ← workers → api (the client, the wire schemas and the
#: logs only: see :data:`LAYERS`). The dashboard's rendering (``web``: templates, charts,
#: diagrams) sits below the server that serves it: ``api.routers.dashboard`` imports ``web``,
#: and ``web`` imports nothing of ``api``.
FOLDERS: dict[str, tuple[str, ...]] = {
    "geometry": (),
    "web": ("geometry",),
    "api": ("geometry", "web"),
    "workers": ("geometry", "api"),
    "cli": ("geometry", "api", "workers"),
}


def folder_imports(root: Path, packages: Iterable[str]) -> list[str]:
    """Each import from one top-level package into another that :data:`FOLDERS` does not allow."""
    graph = import_graph(module_files(root, packages))
    found = []
    for module, edges in sorted(graph.items()):
        folder = module.partition(".")[0]
        for edge in edges:
            target = edge.target.partition(".")[0]
            if target != folder and target not in FOLDERS.get(folder, ()):
                where = f"{edge.path.relative_to(root)}:{edge.line}"
                found.append(f"{module} -> {edge.target} ({where})")
    return list(dict.fromkeys(found))  # one line per import statement


def test_top_level_packages_depend_on_each_other_one_way() -> None:
    assert set(FOLDERS) == set(PACKAGES), "every top-level package has its place in FOLDERS"
    TopologicalSorter(FOLDERS).prepare()  # CycleError where FOLDERS itself lets two go both ways
    wrong = folder_imports(ROOT, PACKAGES)
    message = "imports between top-level packages that FOLDERS does not allow:"
    assert not wrong, "\n".join([message, *wrong])


@dataclass(frozen=True)
class Layer:
    """A boundary: modules under ``importers`` (but not under ``exempt``) import nothing under
    ``forbidden`` except what is under ``allowed``; a name covers a module and all below it."""

    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()


LAYERS = [
    Layer(
        ("api", "workers", "web"),
        ("cli",),
        "the command line sits above the server and the workers; nothing below imports it",
        exempt=("cli",),
    ),
    Layer(
        ("workers",),
        ("workers.testing",),
        "the data path never imports its test and bench equipment",
        exempt=("workers.testing",),
    ),
    Layer(
        ("workers",),
        ("api",),
        "workers reach the control plane only through its client (api.client re-exports the "
        "wire models a worker reads)",
        allowed=("api.client",),
        exempt=("workers.testing",),
    ),
    Layer(
        ("workers.testing",),
        ("api",),
        "the test and bench equipment drives the control plane through its client and shares "
        "its log settings",
        allowed=("api.client", "api.logs"),
    ),
    Layer(
        ("geometry",),
        ("api", "cli", "workers", "web"),
        "the planning core imports nothing else of kvplane",
        allowed=("geometry",),
    ),
]


def _under(module: str, names: Iterable[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def upward_imports(root: Path, packages: Iterable[str]) -> list[str]:
    """Each import that crosses a boundary of :data:`LAYERS` the wrong way, with its reason."""
    graph = import_graph(module_files(root, packages))
    found = []
    for module, edges in sorted(graph.items()):
        for layer in LAYERS:
            if not _under(module, layer.importers) or _under(module, layer.exempt):
                continue
            for edge in edges:
                if _under(edge.target, layer.forbidden) and not _under(edge.target, layer.allowed):
                    where = f"{edge.path.relative_to(root)}:{edge.line}"
                    found.append(f"{module} -> {edge.target} ({where}): {layer.why}")
    return found


def test_no_layer_imports_one_above_it() -> None:
    upward = upward_imports(ROOT, PACKAGES)
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_a_circle_is_named_with_its_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "sub" / "c.py").write_text("import pkg.a\n\ndef g(): ...\n")
    (package / "d.py").write_text("from pkg import a\n")  # into the circle, not part of it
    circles = import_circles(tmp_path, ["pkg"])
    assert circles == [
        "pkg.a -> pkg.sub.b -> pkg.sub.c -> pkg.a  "
        "(imports at pkg/a.py:1, pkg/sub/b.py:2, pkg/sub/c.py:1)"
    ]


def _is_private(name: str) -> bool:
    """A leading underscore; a dunder such as ``__version__`` is public."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a name or a chain of attributes on one, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def private_imports(root: Path, packages: Iterable[str]) -> list[str]:
    """Each use of another module's private name: ``from module import _name``, or
    ``module._name`` on a module bound by an import. A shared helper is public (or moves)."""
    modules = module_files(root, packages)
    found = []
    for name, path in modules.items():
        package = _package_of(name, path)
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: dict[str, str] = {}  # a local name -> the module it was imported as
        used: list[tuple[int, str, str]] = []  # (line, module, private name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.partition(".")[0]
                    bound[local] = alias.name if alias.asname else local
            elif isinstance(node, ast.ImportFrom):
                source = _source(node, package)
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                    if _is_private(alias.name) and _known(source, modules) is not None:
                        used.append((node.lineno, source, alias.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                head, _, rest = (_dotted(node.value) or "").partition(".")
                source = ".".join(filter(None, (bound.get(head), rest)))
                if head in bound and source in modules:
                    used.append((node.lineno, source, node.attr))
        found += [
            f"{path.relative_to(root)}:{line}: {name} uses {source}.{private}"
            for line, source, private in sorted(used)
            if source != name
        ]
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    used = private_imports(ROOT, PACKAGES)
    message = "private names used outside their module (make them public, or move them):"
    assert not used, "\n".join([message, *used])


def test_a_private_import_is_named_with_its_line(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "1"\n')
    (package / "a.py").write_text("def _helper(): ...\n\ndef public(): ...\n\nx = _helper\n")
    (package / "b.py").write_text(
        "from __future__ import annotations\n"
        "\n"
        "import pkg.a\n"
        "from os import _exit\n"  # not ours
        "from pkg import __version__, a\n"  # a dunder is public
        "from pkg.a import public\n"
        "\n"
        "def f():\n"
        "    from .a import _helper as helper\n"
        "    return helper, pkg.a._helper, a._helper, a.public, public, _exit, __version__\n"
    )
    assert private_imports(tmp_path, ["pkg"]) == [
        "pkg/b.py:9: pkg.b uses pkg.a._helper",
        "pkg/b.py:10: pkg.b uses pkg.a._helper",
        "pkg/b.py:10: pkg.b uses pkg.a._helper",
    ]
