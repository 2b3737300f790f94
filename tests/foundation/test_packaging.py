"""Packaging: the wheel holds every import package, the `.sx` prelude and the entry
points, and works once installed; the editable install resolves to this repository."""

from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .pluginkit import REPO, run_python

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project supports 3.10
    tomllib = pytest.importorskip("tomli")

FOLDERS = ("core", "plugins", "storage_backends", "cli")
PRELUDE = Path("core/sexpgpu/lang/core.sx")
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    ".device",
    "sexpgpu-runs",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "tests",
    "benchmarks",
)


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def packages(root: Path = REPO) -> dict[str, Path]:
    """Every import package (sub-packages too, dotted) -> its folder, relative to its root folder."""
    found = {}
    for folder in FOLDERS:
        for init in sorted((root / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(root / folder)
            found[".".join(relative.parts)] = init.parent.relative_to(root)
    return found


def top_packages() -> dict[str, Path]:
    return {name: path for name, path in packages().items() if "." not in name}


def test_editable_install_resolves_to_this_repo(tmp_path: Path) -> None:
    code = """
        import importlib.metadata as md, importlib.util, json, sys
        names = json.loads(sys.argv[1])
        dist = md.distribution("sexpgpu")
        print(json.dumps({
            "origins": {n: importlib.util.find_spec(n).origin for n in names},
            "version": dist.version,
            "entry_points": {ep.name: ep.value for ep in dist.entry_points if ep.group == "sexpgpu"},
            "scripts": {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"},
        }))
    """
    names = sorted(top_packages())
    result = subprocess.run(
        [sys.executable, "-c", __import__("textwrap").dedent(code), json.dumps(names)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for name, folder in top_packages().items():
        assert Path(found["origins"][name]) == REPO / folder / "__init__.py", name
    project = pyproject()["project"]
    assert found["version"] == project["version"]
    # a stale editable install (entry points added since `pip install -e .`) shows here
    assert found["entry_points"] == project["entry-points"]["sexpgpu"]
    assert found["scripts"] == project["scripts"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the sources (so the build leaves the repo alone)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    out = base / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        cwd=base,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (built,) = out.glob("sexpgpu-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_every_package_and_the_prelude(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package, folder in packages().items():
        inside = "/".join(folder.parts[1:])
        assert f"{inside}/__init__.py" in names, package
        for module in (REPO / folder).glob("*.py"):
            assert f"{inside}/{module.name}" in names
    for sx in [PRELUDE, *(p.relative_to(REPO) for f in FOLDERS for p in (REPO / f).rglob("*.sx"))]:
        assert "/".join(sx.parts[1:]) in names, f"{sx} is not in the wheel"
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == set(top_packages()), "the wheel has top-level entries it should not"


@pytest.mark.slow
def test_wheel_declares_the_entry_points(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # entry-point names are case-sensitive
    parser.read_string(archive.read(entry_points).decode())
    project = pyproject()["project"]
    assert dict(parser["sexpgpu"]) == project["entry-points"]["sexpgpu"]
    assert dict(parser["console_scripts"]) == project["scripts"]


@pytest.mark.slow
def test_installed_wheel_works(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    code = """
        import json, sys
        from importlib.resources import files
        import sexpgpu, sexpgpu_cli.main
        from sexpgpu.catalog import Catalog
        print(json.dumps({
            "core": sexpgpu.__file__,
            "prelude": files("sexpgpu.lang").joinpath("core.sx").is_file(),
            "plugins": {r.name: r.plugin.__file__ for r in Catalog.load().records if r.plugin},
        }))
    """
    result = run_python(code, cwd=tmp_path, pythonpath=[target])
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert Path(found["core"]).is_relative_to(target)
    assert found["prelude"] is True
    expected = set(pyproject()["project"]["entry-points"]["sexpgpu"])
    assert expected <= set(found["plugins"])
    for name, path in found["plugins"].items():
        assert Path(path).is_relative_to(target), f"{name} loaded from {path}"
