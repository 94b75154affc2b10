"""The layers of sqllocker hold, and no module imports itself back through others.

The layers, highest first (``[tool.importlinter]`` in pyproject.toml, drawn in
docs/development.md): the command line and the integrations; the front ends; what they share;
the lock operations; the statements and the backends; the table; and what everything uses.
import-linter checks that no module imports one of a layer above its own, counting imports
under ``TYPE_CHECKING`` and inside functions. The second test finds any cycle among the modules,
which layers whose modules may import each other would not: a module that needs another's
type, or its function, takes it through a protocol in a lower module or as an argument.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sqllocker"


def test_the_layers_hold(monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    exit_code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    assert exit_code == 0, capsys.readouterr().out


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by its dotted name: its file, and whether it is a package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imported(name: str, is_package: bool, node: ast.AST, known: set[str]) -> Iterator[str]:
    """The package's modules that the import statement ``node`` of module ``name`` imports."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = name.split(".")[: None if is_package else -1]
            base = base[: len(base) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        targets = [
            f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
            for alias in node.names
        ]
    else:
        return
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            yield target


def import_graph() -> dict[str, set[str]]:
    """Which of the package's modules each imports, wherever the import is written (at the
    top, under ``TYPE_CHECKING``, or inside a function)."""
    found = modules()
    known = set(found)
    return {
        name: {
            target
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            for target in imported(name, is_package, node, known)
        }
        for name, (path, is_package) in found.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion): each is a set of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    return "\n".join(
        f"  {module} -> {', '.join(sorted(graph[module] & members))}" for module in component
    )


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among sqllocker's modules:\n" + "\n".join(
        describe(graph, component) for component in found
    )


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
