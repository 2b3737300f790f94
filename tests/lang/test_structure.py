"""The compiler stays split by concern: no file over 700 lines, no function over
80, and no import cycle among the modules of ``sexpgpu.lang``."""

from __future__ import annotations

import ast

from lang_helpers import ROOT

LANG = ROOT / "core" / "sexpgpu" / "lang"
MAX_FILE = 700
MAX_FUNCTION = 80


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(LANG.rglob("*.py")):
        rel = path.relative_to(LANG.parent.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def test_no_file_is_too_long():
    long = {
        str(p.relative_to(ROOT)): n
        for p in LANG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_FILE
    }
    assert long == {}


def test_no_function_is_too_long():
    long = {
        f"{name}.{node.name}": node.end_lineno - node.lineno + 1
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION
    }
    assert long == {}


def _imports(name: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The sexpgpu.lang modules ``name`` imports when it is imported (not inside
    functions or under TYPE_CHECKING); ``from pkg import mod`` counts as ``pkg.mod``."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in modules and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    assert graph["sexpgpu.lang.ops.spec"] <= {"sexpgpu.lang.text", "sexpgpu.lang.ir"}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        for dep in sorted(graph[name]):
            assert dep not in path, f"import cycle: {' -> '.join((*path, dep))}"
            if dep not in done:
                visit(dep, (*path, dep))
        done.add(name)

    for name in sorted(graph):
        visit(name, (name,))


# the compiler's passes in the order they run (sexpgpu.lang.pipeline)
PASSES = ("collect", "knobs", "defrun", "elaborate", "plan", "graphs", "pipeline")


def test_a_pass_imports_no_pass_after_it():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}

    def reached(name: str, seen: set[str]) -> set[str]:
        for dep in graph[name] - seen:
            seen.add(dep)
            reached(dep, seen)
        return seen

    for i, name in enumerate(PASSES):
        later = {f"sexpgpu.lang.{p}" for p in PASSES[i + 1 :]}
        assert reached(f"sexpgpu.lang.{name}", set()) & later == set(), name
