"""fo_tune's modules import each other without a cycle, counting every import that runs: the module
level and the ones inside functions. An import under ``if TYPE_CHECKING:`` never runs (type
checkers alone read it, for annotations), so it cannot close an import cycle and is not counted."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "fo_tune"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its ``__init__.py``)."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: set[str]) -> set[str]:
    """The package's modules one import statement of module ``name`` loads by name. ``from P
    import m`` of a submodule ``m`` counts as importing ``P.m`` only (a submodule's parent package
    is always loaded first, so that edge is no cycle of the code's making)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    subs = {f"{source}.{alias.name}" for alias in node.names} & modules
    names_only = any(f"{source}.{alias.name}" not in modules for alias in node.names)
    return subs | ({source} & modules if names_only else set())


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements inside an ``if TYPE_CHECKING:`` block."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports where the import runs (see the module docstring)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
                deps |= _imported(name, path, node, set(modules))
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a path that ends where it starts, or [] when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_fo_tune_has_no_import_cycle():
    graph = import_graph()
    assert {"fo_tune.launch", "fo_tune.timing", "fo_tune.bench.task", "fo_tune.cli.common"} <= set(graph)
    assert "fo_tune.timing" in graph["fo_tune.measure"]  # the graph sees imports at all
    assert "fo_tune.launch" in graph["fo_tune.search.driver"]  # ... and those inside functions
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
