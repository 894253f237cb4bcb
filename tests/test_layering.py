"""The package stack reads one way and has no import cycle, checked on the source (AST), not at runtime.

Every ``import`` counts, wherever it stands: at module level, inside a function, or under
``if TYPE_CHECKING``. A lazy or type-only import that closes a cycle is still a cycle (two
halves of one concept calling each other), and one that reaches up the stack is still an
upward import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Bottom to top: a package may import its own modules and those of packages below it.
LAYERS = ("configkit", "graphs", "worker", "cluster", "fleet", "deploy")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the top-level ``packages`` of ``root``."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imported_names(module: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    # ``from pkg import mod`` imports the module ``pkg.mod`` when there is one, else a name of ``pkg``.
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (the nearest existing module of each name)."""
    mods = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(module, path, node, mods):
                while name not in mods and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in mods and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """``"a.b -> c.d"`` for every import of a package above the importer's own."""
    rank = {pkg: i for i, pkg in enumerate(layers)}
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if rank[target.split(".")[0]] > rank[module.split(".")[0]]:
                found.append(f"{module} -> {target}")
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a cycle or several)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; recursion depth is bounded by the module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_package_imports_one_above_it():
    found = upward_imports(import_graph(ROOT, LAYERS), LAYERS)
    assert not found, "imports up the stack (" + " -> ".join(LAYERS[::-1]) + "):\n" + "\n".join(found)


def test_no_import_cycles():
    cycles = import_cycles(import_graph(ROOT, LAYERS))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_configkit_imports_no_graphfleet_layer():
    graph = import_graph(ROOT, LAYERS)
    found = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("configkit")
                   for t in ts if not t.startswith("configkit"))
    assert not found, found


def test_the_checks_find_cycles_and_upward_imports(tmp_path):
    """The walker on a tree made to break both rules: lazy, type-only and relative imports count."""
    files = {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from low import b\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
        "low/c.py": "import high.x\n",
        "high/__init__.py": "",
        "high/x.py": "from low.c import *\nfrom . import y\n",
        "high/y.py": "import os\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("low", "high"))
    assert graph["high.x"] == {"low.c", "high.y"}
    assert upward_imports(graph, ("low", "high")) == ["low.c -> high.x"]
    assert sorted(import_cycles(graph)) == [["high.x", "low.c"], ["low.a", "low.b"]]
