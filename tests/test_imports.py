"""The shape of both packages: their modules import each other without a cycle, no module is over
500 lines, and fo_tune keeps its stages in packages.

Imports are counted where they run: the module level and inside functions. An import under ``if
TYPE_CHECKING:`` never runs (type checkers alone read it, for annotations), so it cannot close an
import cycle and is not counted. A plug-in loaded by name (``importlib`` through a registry) is no
import statement: registries point down to their plug-ins without an edge back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package name -> its source folder (the runtime's source lives in kernels/)
PACKAGES = {"fo_kernels": "kernels", "fo_tune": "fo_tune"}
# The longest module either package keeps (issue: "no module over 500 lines").
MAX_MODULE_LINES = 500
# fo_tune's top level: __init__ and at most two modules every stage shares.
MAX_TOP_LEVEL_MODULES = 3
FO_TUNE_STAGES = ("calibrate", "model", "search", "tables", "bench", "cli", "engines", "ranks")
# A string that names a tuner module the way importlib and the registries take one ("module[:attribute]").
TUNER_MODULE_STRING = re.compile(r"fo_tune(\.\w+)*(:\w+)?")


def _modules(package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its ``__init__.py``)."""
    found = {}
    folder = ROOT / PACKAGES[package]
    for path in sorted(folder.rglob("*.py")):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
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


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports where the import runs (see the module docstring)."""
    modules = _modules(package)
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
    graph = import_graph("fo_tune")
    assert {
        "fo_tune.ranks.launch",
        "fo_tune.ranks.timing",
        "fo_tune.bench.task",
        "fo_tune.cli.common",
    } <= set(graph)
    assert "fo_tune.ranks.timing" in graph["fo_tune.ranks.trials"]  # the graph sees imports at all
    assert "fo_tune.ranks.launch" in graph["fo_tune.search.driver"]  # ... and those inside functions
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def test_fo_kernels_has_no_import_cycle():
    graph = import_graph("fo_kernels")
    assert {"fo_kernels.execute", "fo_kernels.gemm.waves", "fo_kernels.engines.copy_engine.peers"} <= set(
        graph
    )
    assert "fo_kernels.execute" in graph["fo_kernels.overlap"]
    assert "fo_kernels.engines.triton.executor" in graph["fo_kernels.engines.triton"]  # inside run()
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_is_over_500_lines(package):
    modules = _modules(package)
    assert len(modules) > 20
    long = {
        name: n
        for name, path in modules.items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_fo_tune_keeps_its_stages_in_packages():
    top = sorted(p.name for p in (ROOT / "fo_tune").glob("*.py"))
    assert "__init__.py" in top and len(top) <= MAX_TOP_LEVEL_MODULES, top
    for stage in FO_TUNE_STAGES:
        assert (ROOT / "fo_tune" / stage / "__init__.py").is_file(), stage


def tuner_references(source: str) -> list[int]:
    """The lines of ``source`` that import the tuner: an import statement of ``fo_tune`` at any level
    (under ``if TYPE_CHECKING:`` too, since type checkers then need the tuner installed), or a
    ``fo_tune`` module string handed to importlib or a registry (a plug-in loaded by name)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if TUNER_MODULE_STRING.fullmatch(node.value) else []
        else:
            continue
        if any(name.split(".")[0] == "fo_tune" for name in names):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_runtime_never_imports_the_tuner():
    modules = _modules("fo_kernels")
    assert len(modules) > 20
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in modules.values()
        for line in tuner_references(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"the runtime must not import the tuner: {offenders}"


def test_the_tuner_reference_finder_finds_each_form():
    source = (
        "import os, fo_tune.search\n"
        "from fo_tune import bench\n"
        "def f():\n"
        "    import importlib\n"
        "    return importlib.import_module('fo_tune.engines')\n"
        "PLUGINS = {'x': 'fo_tune.engines.triton:Engine'}\n"
        "if TYPE_CHECKING:\n"
        "    from fo_tune.ranks import launch\n"
    )
    assert tuner_references(source) == [1, 2, 5, 6, 8]
    prose = '"""The runtime never imports fo_tune; see fo_tune.search."""\nfrom . import fo_tune_like\n'
    assert tuner_references(prose) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_distribution_lists_every_package():
    """pyproject's explicit ``packages`` takes no subpackage along: a folder it misses is missing
    from a built wheel though an editable install still finds it."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / where for name, where in setuptools["package-dir"].items()}
    found = {
        ".".join((name, *init.parent.relative_to(folder).parts))
        for name, folder in folders.items()
        for init in folder.rglob("__init__.py")
        if not any(part.startswith((".", "__pycache__")) for part in init.parent.relative_to(folder).parts)
    }
    assert {"fo_tune.moe", "fo_kernels.gemm", "fo_results"} <= found
    listed = set(setuptools["packages"])
    assert sorted(found - listed) == []
    # the rest are data folders (YAML, no module), listed so that setuptools packages them quietly
    for name in listed - found:
        top, *parts = name.split(".")
        folder = folders[top].joinpath(*parts)
        assert folder.is_dir() and not any(folder.rglob("*.py")), name


def test_the_dev_extra_asks_for_the_transformers_the_tests_use():
    """The MoE tests and examples shard transformers 5's fused experts blocks: a dev install into an
    environment that holds a 4.x release must upgrade it, not keep it."""
    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = [Requirement(r).specifier for r in extras["dev"] if Requirement(r).name == "transformers"]
    assert not spec.contains("4.57.0") and spec.contains("5.0.0"), spec
