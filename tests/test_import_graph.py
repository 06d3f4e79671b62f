"""The package's import graph points downward: no cycles, and no strategy imports a model.

The graph is read from the source with `ast` (nothing is imported): an edge for every import of an
ndtrain module, at module level or deferred inside a function (a deferred import that closes a loop
is still a loop, only postponed to run time); imports under `if TYPE_CHECKING:` are not edges (they
never run). `from ndtrain.x import y` is an edge to `ndtrain.x.y` when that is a module, else to
`ndtrain.x`; a package's `__init__` is the module named after the package."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ndtrain"
STRATEGIES, MODELS = "ndtrain.parallel", "ndtrain.models"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `nodes`, at any depth, except in the body of an `if TYPE_CHECKING:`."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node))


def imported_modules(name: str, source: str, modules: Mapping[str, Path]) -> set[str]:
    """The ndtrain modules that module `name` (whose text is `source`) imports, itself excluded."""
    is_package = name in modules and modules[name].name == "__init__.py"
    found = set()
    for node in _import_nodes([ast.parse(source)]):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = name.split(".") if is_package else name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        for alias in node.names:
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in found if target in modules and target != name}


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    return {name: imported_modules(name, path.read_text(), modules) for name, path in modules.items()}


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm): each holds at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def one_cycle(graph: Mapping[str, set[str]], component: list[str]) -> list[str]:
    """A shortest loop from the component's first module back to it, staying inside the component."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph[node] & inside):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_the_walker_sees_deferred_imports_and_skips_type_checking() -> None:
    modules = {name: Path(f"{name}.py") for name in ("ndtrain.a", "ndtrain.b", "ndtrain.c", "ndtrain.d", "ndtrain.p")}
    modules["ndtrain.p"] = Path("ndtrain/p/__init__.py")
    modules["ndtrain.p.q"] = Path("ndtrain/p/q.py")
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from ndtrain.p import q, helper\n"
        "if TYPE_CHECKING:\n    from ndtrain.c import C\nelse:\n    import ndtrain.d\n"
        "def f():\n    from ndtrain.b import B\n"
    )
    assert imported_modules("ndtrain.a", source, modules) == {"ndtrain.b", "ndtrain.d", "ndtrain.p", "ndtrain.p.q"}
    assert imported_modules("ndtrain.p", "from . import q\nfrom .q import x\n", modules) == {"ndtrain.p.q"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]] and one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycles() -> None:
    modules = module_files()
    graph = import_graph(modules)
    assert graph["ndtrain.engine"], "the walker found no import in engine.py"
    components = strongly_connected(graph)
    report = [f"{' → '.join(one_cycle(graph, c))}  (in the cycle: {', '.join(c)})" for c in components]
    assert not components, f"{len(components)} import cycle(s):\n" + "\n".join(report)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_parallel_imports_no_model() -> None:
    """Models depend on strategies, never the reverse: nothing under ndtrain.parallel imports ndtrain.models."""
    graph = import_graph(module_files())
    offending = sorted(f"{source} → {target}" for source, targets in graph.items() if within(source, STRATEGIES)
                       for target in targets if within(target, MODELS))
    assert not offending, "parallel/ imports models/:\n" + "\n".join(offending)
