"""The folder tree keeps its architecture: no import circles among ``api``, ``workers`` and ``web``,
and no layer imports one above it.

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


def import_graph(modules: Mapping[str, Path]) -> dict[str, list[Import]]:
    """For each module, the imports that reach another module of ``modules``."""
    graph: dict[str, list[Import]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: list[Import] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
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
        "workers reach the control plane only through the client, the wire schemas, the logs "
        "and the planning core",
        allowed=("api.client", "api.schemas", "api.schemas_exec", "api.logs", "geometry"),
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
