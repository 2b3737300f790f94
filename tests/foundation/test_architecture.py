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
