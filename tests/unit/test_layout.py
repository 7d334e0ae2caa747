"""The package's shape: no import cycle, and the swarm layer never reaches up into the node.

Imports are read from the source (module level and inside functions alike: a lazy import is
still a dependency), so a cycle is caught before it ever bites at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import diloco_p2p

PACKAGE = Path(diloco_p2p.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in modules else base)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "diloco_p2p.node" in graph["diloco_p2p.commands.train"]  # the walk sees lazy imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_swarm_layer_never_imports_the_node():
    graph = import_graph()
    swarm = [m for m in graph if m.startswith("diloco_p2p.swarm")]
    assert "diloco_p2p.swarm.sync" in swarm
    offenders = {m: sorted(graph[m] & {"diloco_p2p.node", "diloco_p2p.cli", "diloco_p2p.commands"}) for m in swarm}
    assert not {m: d for m, d in offenders.items() if d}


def test_modules_and_functions_stay_readable():
    """No module over ~500 lines unless its docstring says why; no function over ~80 lines."""
    long_functions = []
    for name, path in _modules().items():
        source = path.read_text()
        tree = ast.parse(source)
        if len(source.splitlines()) > 520:
            doc = ast.get_docstring(tree) or ""
            assert "long" in doc.lower(), f"{name} has {len(source.splitlines())} lines and no reason in its docstring"
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long_functions
