"""The product's import graph, read statically (every ``import`` in every product module, those
inside functions and ``TYPE_CHECKING`` blocks included), against docs/architecture.md's layers:
a package imports only packages listed above it, and no two modules of one package import each
other, directly or round a circle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# docs/architecture.md, The layers: a package may import only the packages before it here.
LAYERS = ("configs", "engine", "actors", "cluster", "serving", "kvfleet")
NEVER_IMPORTED = ("tests", "benchmarks", "kvfleet_testing")


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is written."""

    source: str  # the importing module, dotted
    path: Path
    line: int
    target: str  # the imported module, dotted (``from a.b import c`` gives ``a.b``, or ``a.b.c`` if a module)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            for alias in node.names:
                submodule = f"{prefix}.{alias.name}"
                yield Import(name, path, node.lineno, submodule if submodule in modules else prefix)


def all_imports() -> list[Import]:
    modules = product_modules()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def where(imp: Import) -> str:
    return f"{imp.path.relative_to(ROOT)}:{imp.line} imports {imp.target}"


def test_the_graph_is_read_from_every_product_package() -> None:
    modules = product_modules()
    assert {name.split(".")[0] for name in modules} == set(LAYERS)
    targets = {imp.target for imp in all_imports()}
    assert "configs.schema" in targets and "engine.kv_cache.coordinator" in targets


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for imp in all_imports():
        mine, theirs = imp.source.split(".")[0], imp.target.split(".")[0]
        if theirs in NEVER_IMPORTED:
            wrong.append(f"{where(imp)}: product code never imports {theirs}")
        elif theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine):
            wrong.append(f"{where(imp)}: {mine} sits below {theirs} (docs/architecture.md, The layers)")
    assert not wrong, "\n".join(wrong)


def test_engine_never_imports_ray() -> None:
    wrong = [
        where(imp) for imp in all_imports() if imp.source.startswith("engine") and imp.target.split(".")[0] == "ray"
    ]
    assert not wrong, "\n".join(wrong)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_circles_inside_a_package(layer: str) -> None:
    modules = product_modules()
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], str] = {}
    for imp in all_imports():
        if imp.source.split(".")[0] != layer or imp.target not in modules or imp.target == imp.source:
            continue
        # a package's __init__ re-exporting its modules is not a circle of theirs
        if modules[imp.source].name == "__init__.py" or modules[imp.target].name == "__init__.py":
            continue
        edges.setdefault(imp.source, set()).add(imp.target)
        lines.setdefault((imp.source, imp.target), where(imp))
    found = circles(edges)
    described = []
    for component in found:
        inside = set(component)
        described.append(
            " <-> ".join(component)
            + ":\n  "
            + "\n  ".join(lines[(a, b)] for a in component for b in sorted(edges[a] & inside))
        )
    assert not found, "import circles:\n" + "\n".join(described)
