"""The architecture stays visible: the core imports no plugin, storage backend or CLI;
plugins import no other project package (and only the core's public API: see
test_public_api.py) and register through the entry-point group a third party uses;
no top-level package takes a name that collides with other software."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .pluginkit import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project supports 3.10
    tomllib = pytest.importorskip("tomli")

PACKAGE_FOLDERS = ("core", "plugins", "storage_backends", "cli")


def packages_in(folder: str) -> set[str]:
    """The top-level import packages held by one of the project's package folders."""
    return {p.parent.name for p in (REPO / folder).glob("*/__init__.py")}


def imported_modules(source: str, filename: str = "<test>") -> Iterator[tuple[str, int]]:
    """Every absolute module a source imports (statically, or by importlib.import_module /
    __import__ with a constant name), with its line; ``from m import n`` yields ``m.n`` too."""
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
                if isinstance(first.value, str):
                    yield first.value, node.lineno


def violations(root: Path, forbidden: set[str]) -> list[str]:
    """``file:line: module`` for each import under ``root`` of a package in ``forbidden``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for module, line in imported_modules(path.read_text(), str(path)):
            if module.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(REPO)}:{line}: {module}")
    return found


def outside_packages() -> set[str]:
    """Every import package of the project that is not the core."""
    return packages_in("plugins") | packages_in("storage_backends") | packages_in("cli")


def test_the_package_folders_hold_what_they_should() -> None:
    assert packages_in("core") == {"sexpgpu"}
    assert "sexpgpu_cli" in packages_in("cli")
    assert packages_in("plugins"), "no built-in plugin package found"
    assert {"sexpgpu_local", "sexpgpu_s3", "sexpgpu_gcs"} <= packages_in("storage_backends")


def test_core_imports_no_plugin_backend_or_cli() -> None:
    forbidden = outside_packages()
    assert violations(REPO / "core", forbidden) == []


def test_the_import_scan_catches_every_form() -> None:
    """The scanner above must see each way the core could import a plugin."""
    source = (
        "import sexpgpu_torch\n"
        "import os, sexpgpu_cli.main as m\n"
        "from sexpgpu_s3 import backend\n"
        "def f():\n"
        "    import importlib\n"
        "    importlib.import_module('sexpgpu_local.store')\n"
        "    __import__('sexpgpu_gcs')\n"
        "from . import sibling\n"
        "from sexpgpu import errors\n"
    )
    tops = {m.split(".")[0] for m, _ in imported_modules(source)}
    assert {"sexpgpu_torch", "sexpgpu_cli", "sexpgpu_s3", "sexpgpu_local", "sexpgpu_gcs"} <= tops
    assert "sibling" not in tops


# A plugin that builds on another, as a third party's could depend on it: the
# compiled lowering runs the eager lowering's op table and trainer under a trace.
BUILDS_ON = {"sexpgpu_cuda": {"sexpgpu_torch"}}


@pytest.mark.parametrize("folder", ["plugins", "storage_backends"])
def test_plugins_import_no_other_project_package(folder: str) -> None:
    """A built-in plugin imports the core and itself, never another plugin (but the
    one it builds on, BUILDS_ON), a storage backend or the CLI (which core names it
    may use: test_public_api.py)."""
    problems = []
    for package in sorted(packages_in(folder)):
        allowed = {package, *BUILDS_ON.get(package, ())}
        for path in sorted((REPO / folder / package).rglob("*.py")):
            for module, line in imported_modules(path.read_text(), str(path)):
                top = module.split(".")[0]
                if top in outside_packages() and top not in allowed:
                    problems.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert problems == []


def test_every_plugin_package_registers_through_the_entry_point_group() -> None:
    """Built-in plugins are found exactly as third-party ones: by group ``sexpgpu``."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    entry_points = pyproject["project"]["entry-points"]["sexpgpu"]
    targets = {value.split(":")[0].split(".")[0] for value in entry_points.values()}
    expected = packages_in("plugins") | packages_in("storage_backends")
    assert expected - targets == set(), "plugin packages without an entry point"
    assert targets - expected == set(), "entry points naming no plugin package"


def test_no_top_level_package_collides_with_common_names() -> None:
    """``core``, ``cli``, ``plugins``... are folders, never import packages."""
    tops = set().union(*(packages_in(folder) for folder in PACKAGE_FOLDERS))
    assert tops & {"core", "cli", "plugins", "storage_backends", "tests", "lang"} == set()
    assert all(name == "sexpgpu" or name.startswith("sexpgpu_") for name in tops), tops
    for folder in PACKAGE_FOLDERS:
        assert not (REPO / folder / "__init__.py").exists(), f"{folder}/ must not be a package"


# ---------------------------------------------------------------- the import graph


def _module_name(path: Path, folder: str) -> str:
    parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the product (core, plugins, storage backends, CLI), by name."""
    return {
        _module_name(path, folder): path
        for folder in PACKAGE_FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
    }


def _runtime_imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The absolute names a module imports when it runs: top-level and inside functions
    (lazy), but not under ``if TYPE_CHECKING:``. ``from pkg import name`` gives
    ``pkg.name`` (a submodule, when it is one) and ``pkg:`` after it (``pkg`` itself,
    when ``name`` is not a submodule)."""
    package = module if is_package else module.rpartition(".")[0]

    def walk(node: ast.AST) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (m for stmt in child.orelse for m in walk_one(stmt))
                continue
            yield from walk_one(child)

    def walk_one(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}"
                yield f"{base}:"
        yield from walk(node)

    yield from walk(tree)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports at run time (explicit imports only:
    a module's own packages, which Python imports first, are not edges)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = list(_runtime_imports(tree, name, path.name == "__init__.py"))
        edges: set[str] = set()
        for target, after in zip(targets, [*targets[1:], ""], strict=False):
            if target.endswith(":"):
                continue
            if target in modules:
                edges.add(target)
            elif after.endswith(":") and after[:-1] in modules:
                # ``from pkg import name``, where name lives in pkg's __init__
                edges.add(after[:-1])
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_there_is_no_import_cycle_lazy_imports_included() -> None:
    graph = import_graph()
    assert "sexpgpu.catalog" in graph["sexpgpu_cli.group"]  # the scan sees real edges
    assert cycles(graph) == []


def test_the_cycle_finder_can_fail() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import sexpgpu.train\n"
        "def f():\n    from sexpgpu import session\n    from . import sibling\n"
    )
    found = set(_runtime_imports(tree, "sexpgpu.lang.x", False))
    assert "sexpgpu.train" not in found
    assert {"sexpgpu.session", "sexpgpu.lang.sibling"} <= found


def test_only_the_catalog_builds_pluggys_manager() -> None:
    """pluggy is the catalog's: hookspecs takes only its markers from it."""
    users = {}
    for name, path in project_modules().items():
        source = path.read_text()
        tops = {m.split(".")[0] for m, _ in imported_modules(source, str(path))}
        if "pluggy" in tops:
            users[name] = "PluginManager" in source
    assert users == {"sexpgpu.catalog": True, "sexpgpu.hookspecs": False}


# ---------------------------------------------------------------- a core read in one sitting


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


CORE = REPO / "core" / "sexpgpu"
LIBRARIES = ("lang", "checkpoint")
"""The core's torch-free libraries, each a package with its own tests."""


def test_the_step_loop_reads_in_one_sitting() -> None:
    assert _lines(CORE / "train.py") <= 400


def test_the_core_outside_its_libraries_is_small() -> None:
    outside = [p for p in CORE.rglob("*.py") if p.relative_to(CORE).parts[0] not in LIBRARIES]
    assert sum(map(_lines, outside)) <= 4000


def test_no_module_of_the_core_is_a_book() -> None:
    long = {str(p.relative_to(REPO)): _lines(p) for p in CORE.rglob("*.py") if _lines(p) > 700}
    assert long == {}


def _plugin_names() -> set[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(pyproject["project"]["entry-points"]["sexpgpu"])


def test_the_core_names_no_plugin() -> None:
    """No string in the core outside its language (whose forms are its own words, such
    as ``eval``) is a built-in plugin's name or one of their files."""
    names = _plugin_names() | {"events.jsonl"}
    named = []
    for path in sorted(CORE.rglob("*.py")):
        if path.relative_to(CORE).parts[0] == "lang":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names:
                named.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert named == []
