"""Plugins use the core through its public API only (``sexpgpu.extension.PUBLIC_API``).

Every plugin package is scanned: the built-in ones under plugins/ and
storage_backends/, and the throwaway third-party ones the tests make (the module
sources the tests write, and the plugin folders they keep). Each may import its own
package and anything outside the core, but from the core only the modules and names
the public API lists; the docs list the same modules.
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

from sexpgpu.extension import PUBLIC_API

from .pluginkit import REPO, make_plugin, run_sexpgpu

CORE = "sexpgpu"


def _module_names(node: ast.AST) -> Iterator[tuple[str, tuple[str, ...] | None, int]]:
    """(module, names taken from it or ``None`` for the module itself, line) per import."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, None, node.lineno
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        yield node.module, tuple(alias.name for alias in node.names), node.lineno
    elif isinstance(node, ast.Call) and node.args:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0]
        if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
            if isinstance(first.value, str):
                yield first.value, None, node.lineno


def _allowed(module: str, name: str | None) -> bool:
    """Whether ``import module`` (``name`` None) or ``from module import name`` is public."""
    if name is None:
        return module == CORE or module in PUBLIC_API
    if f"{module}.{name}" in PUBLIC_API:  # from sexpgpu import errors
        return True
    if module not in PUBLIC_API:
        return False
    names = PUBLIC_API[module]
    return not name.startswith("_") if names is None else name in names


def core_violations(source: str, where: str) -> list[str]:
    """``where:line: what`` for each import of the core outside the public API."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        for module, names, line in _module_names(node):
            if module.split(".")[0] != CORE:
                continue
            for name in names or (None,):
                if not _allowed(module, name):
                    what = module if name is None else f"{module}.{name}"
                    found.append(f"{where}:{line}: {what}")
    return found


def _is_plugin_source(tree: ast.Module) -> bool:
    """A module that registers hooks: it imports ``sexpgpu.hookspecs``."""
    return any(
        module == "sexpgpu.hookspecs"
        for node in ast.walk(tree)
        for module, _, _ in _module_names(node)
    )


def builtin_plugin_files() -> Iterator[Path]:
    """Every module of every built-in plugin package."""
    for folder in ("plugins", "storage_backends"):
        for init in sorted((REPO / folder).glob("*/__init__.py")):
            yield from sorted(init.parent.rglob("*.py"))


def made_plugin_sources() -> Iterator[tuple[str, str]]:
    """(where, source) of every third-party plugin the tests make: the module sources
    written as string constants, and the plugin modules kept in folders next to a
    ``*.dist-info/entry_points.txt``."""
    for path in sorted((REPO / "tests").rglob("*.py")):
        where = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text(), where)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            source = textwrap.dedent(node.value)
            try:
                with warnings.catch_warnings():  # most strings are not code at all
                    warnings.simplefilter("ignore")
                    sub = ast.parse(source)
            except SyntaxError:
                continue
            if _is_plugin_source(sub):
                yield f"{where}:{node.lineno} (a plugin source)", source
    for entry_points in sorted((REPO / "tests").rglob("*.dist-info/entry_points.txt")):
        site_dir = entry_points.parent.parent
        for line in entry_points.read_text().splitlines():
            if "=" not in line:
                continue
            module = line.split("=", 1)[1].split(":")[0].strip()
            base = site_dir.joinpath(*module.split("."))
            for path in [base.with_suffix(".py"), *sorted(base.rglob("*.py"))]:
                if path.is_file():
                    yield str(path.relative_to(REPO)), path.read_text()


def test_the_built_in_plugins_import_only_the_public_api() -> None:
    files = list(builtin_plugin_files())
    assert any(p.parent.name == "sexpgpu_torch" for p in files)
    problems = []
    for path in files:
        problems += core_violations(path.read_text(), str(path.relative_to(REPO)))
    assert problems == []


def test_the_plugins_the_tests_make_import_only_the_public_api() -> None:
    sources = list(made_plugin_sources())
    places = {where.split(":")[0] for where, _ in sources}
    # the scan sees the kinds of plugins the tests make (not an empty pass)
    assert "tests/foundation/pluginkit.py" in places
    assert "tests/torch/test_torch_choices.py" in places
    assert "tests/lang/fakeplugin/sexpgpu_lang_fake.py" in places
    problems = []
    for where, source in sources:
        problems += core_violations(source, where)
    assert problems == []


def test_the_scan_catches_every_way_out_of_the_public_api() -> None:
    source = (
        "import sexpgpu.checkpointer\n"
        "from sexpgpu.plugins import module_missing\n"
        "from sexpgpu import plugins\n"
        "from sexpgpu import __version__, checkpointer\n"
        "from sexpgpu.checkpoint import layout_tensors, read_checkpoint\n"
        "from sexpgpu.extension import _private\n"
        "from sexpgpu.lang.compiler import Compiler\n"
        "def f():\n"
        "    import importlib\n"
        "    importlib.import_module('sexpgpu.status')\n"
        "import sexpgpu, sexpgpu.extension, sexpgpu_torch.lowering\n"
        "from sexpgpu import errors, hookspecs\n"
        "from sexpgpu.lang import ops\n"
        "from sexpgpu.kernels import choose_kernels\n"
        "from sexpgpu.extension import KernelInfo, module_missing\n"
    )
    assert core_violations(source, "p.py") == [
        "p.py:1: sexpgpu.checkpointer",
        "p.py:2: sexpgpu.plugins.module_missing",
        "p.py:3: sexpgpu.plugins",
        "p.py:4: sexpgpu.checkpointer",
        "p.py:5: sexpgpu.checkpoint.read_checkpoint",
        "p.py:6: sexpgpu.extension._private",
        "p.py:7: sexpgpu.lang.compiler.Compiler",
        "p.py:10: sexpgpu.status",
    ]


def test_every_public_module_and_name_exists() -> None:
    for module, names in PUBLIC_API.items():
        loaded = importlib.import_module(module)
        for name in names or ():
            assert hasattr(loaded, name), f"{module}.{name}"


def test_the_docs_list_the_public_modules() -> None:
    text = (REPO / "docs" / "plugins.md").read_text()
    section = text.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `(sexpgpu(?:\.[a-z_]+)*)[`.]", section, re.MULTILINE))
    assert listed == set(PUBLIC_API)


PUBLIC_PLUGIN = '''
"""A third-party kernel plugin that uses every public module it needs, and only those."""

from sexpgpu import __version__
from sexpgpu.checkpoint import layout_tensors
from sexpgpu.extension import KernelInfo, module_missing
from sexpgpu.hookspecs import hookimpl
from sexpgpu.kernels import choose_kernels

USED = (__version__, layout_tensors, choose_kernels)


@hookimpl
def sexpgpu_unavailable():
    return module_missing("json", "pip install json")


@hookimpl
def sexpgpu_kernels():
    return [
        KernelInfo(
            kind="attention",
            name="public-only",
            lowering="elsewhere",
            devices=("tpu",),
            deterministic=True,
            factory=lambda: None,
            doc="a kernel for a lowering nobody has",
        )
    ]
'''


def test_a_plugin_built_on_the_public_api_alone_loads(tmp_path: Path) -> None:
    """What the docs promise a plugin author is enough to write a working plugin,
    and the scan accepts it."""
    site_dir = make_plugin(
        tmp_path / "site", "public-only", {"public_only": PUBLIC_PLUGIN}, {"public": "public_only"}
    )
    assert core_violations((site_dir / "public_only.py").read_text(), "public_only.py") == []
    result = run_sexpgpu(["plugins"], cwd=tmp_path, pythonpath=[site_dir])
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.split(" ", 1)[0] == "public")
    assert "unavailable" not in line and "broken" not in line, result.stdout
