"""Helpers for the foundation tests: third-party plugins built in a temp folder, and
``sexpgpu`` / ``python`` run as a user runs them (a subprocess, a clean environment).

A plugin here is what pip would leave behind: a ``<name>-<version>.dist-info`` folder
with METADATA and an ``entry_points.txt`` naming modules in group ``[sexpgpu]``, next
to the modules themselves. Putting the folder on ``PYTHONPATH`` installs it for that
process only, so nothing in the project changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

from tests.profiles import suite_env

REPO = Path(__file__).resolve().parents[2]

# A third-party plugin that opens mem:// locations (objects kept as files under
# $MEM_PLUGIN_ROOT, so a put in one process can be read back by the next) and adds
# a `mem` command group to the CLI.
MEM_PLUGIN = '''
"""A third-party sexpgpu plugin made by the tests: mem:// locations and a `mem` command."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import click

from sexpgpu.errors import StorageError
from sexpgpu.extension import ObjectIdentity, StorageBackendInfo
from sexpgpu.hookspecs import hookimpl


class MemStorage:
    """The Storage protocol over a folder named by $MEM_PLUGIN_ROOT."""

    def __init__(self, uri: str) -> None:
        self.uri = uri.rstrip("/")
        root = os.environ.get("MEM_PLUGIN_ROOT")
        if not root:
            raise StorageError(f"{self.uri}: MEM_PLUGIN_ROOT is not set")
        self._root = Path(root) / self.uri.removeprefix("mem://")

    def describe(self) -> str:
        return f"{self.uri} (mem test plugin, no credentials)"

    def check_writable(self) -> None:
        self.write(".probe", b"")
        self.delete(".probe")

    def list_children(self, prefix: str = "") -> list[str]:
        folder = self._root / prefix
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def exists(self, key: str) -> bool:
        return (self._root / key).is_file()

    def read(self, key: str) -> bytes:
        try:
            return (self._root / key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"{self.uri}/{key}: no such object") from None

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self.read(key)[start : start + length]

    def write(self, key: str, data) -> None:
        path = self._root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)

    def write_many(self, items) -> None:
        for key, data in items.items():
            self.write(key, data)

    def delete(self, key: str) -> None:
        (self._root / key).unlink(missing_ok=True)

    def identity(self, key: str) -> ObjectIdentity:
        data = self.read(key)
        return ObjectIdentity(len(data), "sha256:" + hashlib.sha256(data).hexdigest())


@hookimpl
def sexpgpu_storage_backends():
    return [StorageBackendInfo(schemes=("mem",), factory=MemStorage, doc="objects in a folder")]


def open_location(uri):
    """A location opened with the catalog the CLI hands its commands."""
    from sexpgpu.catalog import Catalog

    return click.get_current_context().find_object(Catalog).open_location(uri)


@hookimpl
def sexpgpu_cli_commands(cli):
    @click.group("mem")
    def mem():
        """Put and get objects in mem:// locations (a test plugin)."""

    @mem.command("put")
    @click.argument("uri")
    @click.argument("key")
    @click.argument("value")
    def put(uri, key, value):
        """Store VALUE at KEY under URI."""
        from sexpgpu.log import get_logger
        open_location(uri).write(key, value.encode())
        get_logger("mem").info(
            "stored", uri=uri, key=key, aws_secret_access_key="AKIA-VERY-SECRET-42"
        )

    @mem.command("get")
    @click.argument("uri")
    @click.argument("key")
    def get(uri, key):
        """Print the object at KEY under URI."""
        click.echo(open_location(uri).read(key).decode())

    @mem.command("describe")
    @click.argument("uri")
    def describe(uri):
        """Open any location and describe it."""
        click.echo(open_location(uri).describe())

    cli.add_command(mem)
'''


def make_plugin(
    root: Path,
    dist: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, str],
    version: str = "0.1",
) -> Path:
    """Install a plugin distribution into ``root`` (a folder meant for PYTHONPATH).

    ``modules`` maps module names to their source; ``entry_points`` maps entry-point
    names to module names in the ``sexpgpu`` group. Returns ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[sexpgpu]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def make_mem_plugin(root: Path) -> Path:
    """The mem:// plugin (distribution ``sexpgpu-mem-plugin``, entry point ``mem``)."""
    return make_plugin(
        root,
        "sexpgpu-mem-plugin",
        {"sexpgpu_mem_plugin": MEM_PLUGIN},
        {"mem": "sexpgpu_mem_plugin"},
    )


def user_env(pythonpath: Iterable[Path] = (), **extra: str) -> dict[str, str]:
    """The environment of a user's shell: no inherited SEXPGPU_* settings, our PYTHONPATH.

    The suite's isolation from installed third-party plugins (set by tests/conftest.py)
    is kept: a user's shell has none of them.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SEXPGPU_") or k == "SEXPGPU_DISABLE_DISTRIBUTIONS"
    }
    env.pop("PYTHONPATH", None)
    paths = [str(p) for p in pythonpath]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env = suite_env(env)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def sexpgpu_command() -> list[str]:
    """The ``sexpgpu`` console script of the interpreter running the tests."""
    script = Path(sys.executable).with_name("sexpgpu")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from sexpgpu_cli.main import main; main()"]


def run_sexpgpu(
    args: list[str], *, cwd: Path, pythonpath: Iterable[Path] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``sexpgpu ARGS`` as a user would; never raises on a non-zero exit."""
    return subprocess.run(
        [*sexpgpu_command(), *args],
        cwd=cwd,
        env=user_env(pythonpath, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_python(
    code: str, *, cwd: Path, pythonpath: Iterable[Path] = (), args: Iterable[str] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python [ARGS] -c CODE`` with the tests' interpreter in a user's environment."""
    return subprocess.run(
        [sys.executable, *args, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=user_env(pythonpath, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def plugin_line(listing: str, name: str) -> str:
    """The first line of ``sexpgpu plugins`` output that describes plugin ``name``."""
    for line in listing.splitlines():
        if line.split(" ", 1)[0] == name:
            return line
    raise AssertionError(f"plugin {name!r} is not listed:\n{listing}")


def hooks_line(listing: str, name: str) -> str:
    """The ``hooks:`` line that follows plugin ``name`` in ``sexpgpu plugins`` output."""
    lines = listing.splitlines()
    index = lines.index(plugin_line(listing, name))
    return lines[index + 1].strip()
