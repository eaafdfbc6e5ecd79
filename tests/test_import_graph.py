"""No import circle at run time: the package's modules, and the imports each makes when it runs (at the top or
inside a function; imports under ``if TYPE_CHECKING`` are for type checkers only), form no cycle. A circle works only
by the order modules happen to load, and a function-level import that closes one hides it from the reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = {"alspec_eval": ROOT / "alspec_eval", "alspec_eval.kernels": ROOT / "kernels"}  # setup.cfg's package_dir


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module by its import name: (file, whether it is a package's __init__)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = (path, path.name == "__init__.py")
    return found


def runtime_imports(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports when it runs."""
    found: set[str] = set()

    class Imports(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - (node.level - (1 if is_package else 0))]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)

    Imports().visit(ast.parse(path.read_text(encoding="utf-8")))
    return {target for target in found if target in known and target != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while component[-1:] != [node]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back_at_run_time() -> None:
    known = modules()
    graph = {name: runtime_imports(name, path, is_package, set(known)) for name, (path, is_package) in known.items()}
    assert len(graph) > 80 and sum(map(len, graph.values())) > 150  # the graph is the package's
    assert cycles(graph) == []


def test_a_circle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
