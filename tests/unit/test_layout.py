"""The package's shape: no import cycle; each package imports only from the layers below it
(`PACKAGE_LAYERS`: the seams, then the model and a node's ranks, data, the swarm, the loop, the
planner and operations, the commands); inside the swarm each sub-package imports only from the
layers below it (`SWARM_LAYERS`).

Imports are read from the source (module level and inside functions alike: a lazy import is
still a dependency), so a cycle is caught before it ever bites at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import diloco_p2p

PACKAGE = Path(diloco_p2p.__file__).parent

# The swarm's layers, bottom up. A module imports only from its own unit and from lower layers;
# units side by side in one layer import nothing of each other. A unit is a sub-package of
# `diloco_p2p.swarm`, or "facade" for the modules at its top (`sync`, `multirank`, `vouching`, `datashare`), the node's way in.
SWARM_LAYERS: list[set[str]] = [
    {"trust"},  # signing, validators, admission, guard
    {"transport"},  # the DHT (it signs with `trust`), event loop, reachability, stream framing
    {"collective", "membership", "state"},  # all-reduce; groups, records, resync; state and data sharing
    {"facade"},
]
# Above the swarm: data flows loop -> contract -> swarm, so nothing in the swarm imports these.
ABOVE_SWARM = ("diloco_p2p.loop", "diloco_p2p.planner", "diloco_p2p.ops", "diloco_p2p.cli", "diloco_p2p.commands")
# The package's layers, bottom up, by first name under `diloco_p2p`. The seams (root modules and
# the config) are what every layer shares; a unit imports only its own and lower layers.
SEAMS = {"errors", "faults", "hashing", "logs", "contract", "config"}
PACKAGE_LAYERS: list[set[str]] = [
    SEAMS,
    {"model", "local"},  # the model and its tokenizer; the ranks of one node
    {"data"},  # documents, shards, the training order
    {"swarm"},  # everything that talks to peers
    {"loop"},  # one node's rounds
    {"planner", "ops"},  # planning and simulating a run; the seed, status, transfer, the demo
    {"commands"},  # one module per subcommand
    {"cli"},
    {"__main__"},
]
ROOT_MODULES_AT_MOST = 8
# Fault injection is the tests' (`tests.faults.injection`, installed by `python -m tests.faults.node`):
# the product names none of the variables that plan it.
TEST_ONLY_VARIABLES = ("DILOCO_P2P_FAULTS", "DILOCO_P2P_START_GATE", "DILOCO_P2P_CORRUPT_SHARDS")


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


def swarm_unit(module: str) -> str | None:
    """The layer unit of `module`: a swarm sub-package, "facade", "above" (`ABOVE_SWARM`), or
    None for the rest of the package (config, contract, errors...: free to import)."""
    parts = module.split(".")
    if any(module == a or module.startswith(a + ".") for a in ABOVE_SWARM):
        return "above"
    if parts[:2] != ["diloco_p2p", "swarm"]:
        return None
    is_package = (PACKAGE / "swarm" / parts[2]).is_dir() if len(parts) > 2 else False
    return parts[2] if is_package else "facade"


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]], unit=swarm_unit) -> list[str]:
    """Each import of a swarm module that goes up a layer, sideways within one, or above the swarm."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer} | {"above": len(layers)}
    found = []
    for module, deps in sorted(graph.items()):
        mine = unit(module)
        if mine is None or mine == "above":
            continue
        for dep in sorted(deps):
            theirs = unit(dep)
            if theirs is not None and theirs != mine and rank[theirs] >= rank[mine]:
                found.append(f"{module} -> {dep}")
    return found


def borrowed_from_tests(source: str) -> list[str]:
    """What in `source` belongs to the tests: an import from `tests`, a name of `TEST_ONLY_VARIABLES`."""
    found = [v for v in TEST_ONLY_VARIABLES if v in source]
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [f"import {n}" for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "diloco_p2p.loop.node" in graph["diloco_p2p.commands.train"]  # the walk sees lazy imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_swarm_layer_never_imports_the_loop():
    graph = import_graph()
    swarm = [m for m in graph if m.startswith("diloco_p2p.swarm")]
    assert "diloco_p2p.swarm.sync" in swarm
    offenders = {m: sorted(d for d in graph[m] if swarm_unit(d) == "above") for m in swarm}
    assert not {m: d for m, d in offenders.items() if d}


def package_unit(module: str) -> str | None:
    """The layer unit of a package module: its first name under `diloco_p2p` (None for the
    package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_each_package_imports_only_the_layers_below_it():
    graph = import_graph()
    units = {package_unit(m) for m in graph} - {None}
    assert units == set().union(*PACKAGE_LAYERS), "place each package and root module in PACKAGE_LAYERS"
    found = [edge for edge in upward_imports(graph, PACKAGE_LAYERS, package_unit)
             if edge.split(" -> ")[0].split(".")[1] not in SEAMS or edge.split(" -> ")[1].split(".")[1] not in SEAMS]
    assert not found


def test_the_package_root_stays_small():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


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


def test_the_layer_checker_flags_an_import_up_or_sideways():
    def unit(module: str) -> str | None:
        return {"t": "trust", "x": "transport", "c": "collective", "m": "membership", "n": "above"}.get(module)

    graph = {"t": {"x"}, "x": {"t", "elsewhere"}, "c": {"m", "x", "t"}, "m": {"t", "n"}, "elsewhere": {"c"}}
    assert upward_imports(graph, SWARM_LAYERS, unit) == ["c -> m", "m -> n", "t -> x"]
    assert upward_imports({"x": {"t"}, "c": {"x"}, "m": {"t"}}, SWARM_LAYERS, unit) == []


def test_each_swarm_sub_package_imports_only_the_layers_below_it():
    graph = import_graph()
    units = {swarm_unit(m) for m in graph} - {None, "above"}
    assert units == set().union(*SWARM_LAYERS), "place each swarm sub-package in SWARM_LAYERS"
    assert swarm_unit("diloco_p2p.swarm.transport.dht") == "transport"
    assert swarm_unit("diloco_p2p.swarm.sync") == "facade" and swarm_unit("diloco_p2p.commands.train") == "above"
    assert not upward_imports(graph, SWARM_LAYERS)


def test_the_borrowing_finder_finds_imports_and_variables():
    source = 'import tests.faults.node\nfrom tests import x\nimport testsuite\nos.environ["DILOCO_P2P_FAULTS"]'
    assert borrowed_from_tests(source) == ["DILOCO_P2P_FAULTS", "import tests.faults.node", "import tests"]
    assert borrowed_from_tests("from . import tests\nimport torch.testing") == []


def test_test_behaviour_stays_out_of_the_product():
    """No module of the package imports from the tests or reads a variable that plans a fault: the
    product keeps only the hook points (`diloco_p2p.faults`); the faults are installed by a test entry."""
    found = {name: borrowed_from_tests(path.read_text()) for name, path in _modules().items()}
    assert "diloco_p2p.faults" in found
    assert not {name: what for name, what in found.items() if what}


def test_a_node_of_one_rank_imports_no_fsdp():
    """FSDP and DTensor cost a node about a third of its imports (a restart waits on them); only
    `fsdp.shard_model` imports them, for a node of several ranks."""
    import subprocess
    import sys

    code = ("import sys, diloco_p2p.commands.train, diloco_p2p.loop.node, diloco_p2p.swarm.sync, diloco_p2p.loop.inner; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.fsdp', 'torch.distributed.tensor'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
