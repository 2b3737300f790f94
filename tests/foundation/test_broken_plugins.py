"""A broken or incomplete plugin never locks a user out: `sexpgpu --help` and
`sexpgpu plugins` keep working and say why; SEXPGPU_DISABLE_PLUGINS skips one; a
missing optional dependency shows its install hint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .pluginkit import make_mem_plugin, make_plugin, plugin_line, run_python, run_sexpgpu

BROKEN_AT_IMPORT = """
import os
from pathlib import Path

# leave a mark, so a test can tell whether this module was imported at all
Path(os.environ["BROKEN_MARK"]).write_text("imported")
raise RuntimeError("boom at import\\nsecond line never shown")
"""

BROKEN_COMMANDS = """
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_cli_commands(cli):
    raise KeyError("no room for commands")
"""

BROKEN_CHECK = """
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_unavailable():
    raise OSError("cannot tell")
"""

NO_DEPENDENCY = """
from sexpgpu.extension import StorageBackendInfo
from sexpgpu.hookspecs import hookimpl
from sexpgpu.plugins import module_missing


@hookimpl
def sexpgpu_unavailable():
    return module_missing("no_such_module_xyz", "pip install 'sexpgpu-nodep[fast]'")


@hookimpl
def sexpgpu_storage_backends():
    def open_(uri):
        import no_such_module_xyz  # noqa: F401 - only ever reached if it were installed

    return [StorageBackendInfo(("nodep",), open_)]
"""

WRONG_ARGUMENTS = """
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_cli_commands(group):
    pass
"""

BROKEN_DESCRIPTORS = """
from sexpgpu.hookspecs import hookimpl


@hookimpl
def sexpgpu_storage_backends():
    raise ValueError("descriptor bug")
"""


@pytest.fixture
def site(tmp_path: Path) -> dict:
    """The mem plugin and five ill-behaved plugins, installed on PYTHONPATH."""
    root = make_mem_plugin(tmp_path / "site")
    for dist, module, source in [
        ("broken-import", "t_broken_import", BROKEN_AT_IMPORT),
        ("broken-commands", "t_broken_commands", BROKEN_COMMANDS),
        ("broken-check", "t_broken_check", BROKEN_CHECK),
        ("nodep", "t_nodep", NO_DEPENDENCY),
        ("wrong-arguments", "t_wrong_arguments", WRONG_ARGUMENTS),
    ]:
        make_plugin(root, dist, {module: source}, {dist: module})
    return {
        "cwd": tmp_path,
        "pythonpath": [root],
        "BROKEN_MARK": str(tmp_path / "broken-import.mark"),
        "MEM_PLUGIN_ROOT": str(tmp_path),
    }


def _sexpgpu(site: dict, *args: str, **env: str):
    return run_sexpgpu(
        list(args),
        cwd=site["cwd"],
        pythonpath=site["pythonpath"],
        BROKEN_MARK=site["BROKEN_MARK"],
        MEM_PLUGIN_ROOT=site["MEM_PLUGIN_ROOT"],
        **env,
    )


def test_help_survives_broken_plugins(site: dict) -> None:
    result = _sexpgpu(site, "--help")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and result.stderr == ""
    commands = result.stdout.split("Commands:", 1)[1].split()
    assert "mem" in commands and "plugins" in commands


def test_plugins_lists_broken_plugins_with_their_reasons(site: dict) -> None:
    result = _sexpgpu(site, "plugins")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert plugin_line(out, "broken-import").endswith(
        "unavailable: failed to load: RuntimeError: boom at import"
    )
    assert "second line" not in out
    assert plugin_line(out, "broken-commands").endswith(
        "unavailable: adding its commands failed: KeyError: 'no room for commands'"
    )
    assert plugin_line(out, "broken-check").endswith(
        "unavailable: availability check failed: OSError: cannot tell"
    )
    assert plugin_line(out, "nodep").endswith(
        "unavailable: no_such_module_xyz is not installed: pip install 'sexpgpu-nodep[fast]'"
    )
    assert plugin_line(out, "wrong-arguments").endswith(
        "unavailable: failed to load: PluginValidationError: "
        "Plugin 'wrong-arguments' for hook 'sexpgpu_cli_commands'"
    )
    assert plugin_line(out, "mem").endswith("  available")
    records = {r["name"]: r for r in json.loads(_sexpgpu(site, "plugins", "--json").stdout)}
    assert records["broken-import"]["hooks"] == [] and not records["broken-import"]["available"]
    assert records["nodep"]["hooks"] == ["sexpgpu_storage_backends", "sexpgpu_unavailable"]


def test_disable_plugins_skips_them(site: dict) -> None:
    result = _sexpgpu(site, "plugins", SEXPGPU_DISABLE_PLUGINS=" broken-import , mem,unknown-name")
    assert result.returncode == 0, result.stderr
    assert not Path(site["BROKEN_MARK"]).exists(), "a disabled plugin must not even be imported"
    for name in ("broken-import", "mem"):
        assert plugin_line(result.stdout, name).endswith(
            "unavailable: disabled by SEXPGPU_DISABLE_PLUGINS"
        )
    records = {
        r["name"]: r
        for r in json.loads(
            _sexpgpu(site, "plugins", "--json", SEXPGPU_DISABLE_PLUGINS="mem").stdout
        )
    }
    assert records["mem"]["disabled"] and not records["mem"]["available"]
    assert not records["nodep"]["disabled"]
    # without the variable the broken plugin is imported (and the mark proves the test can fail)
    _sexpgpu(site, "plugins")
    assert Path(site["BROKEN_MARK"]).exists()


def test_disabled_plugin_supplies_nothing(site: dict) -> None:
    help_ = _sexpgpu(site, "--help", SEXPGPU_DISABLE_PLUGINS="mem")
    assert "mem" not in help_.stdout.split("Commands:", 1)[1].split()
    code = """
        from sexpgpu.errors import SexpError
        from sexpgpu.storage import open_location
        try:
            open_location("mem://x")
        except SexpError as exc:
            print(exc)
    """
    result = run_python(
        code,
        cwd=site["cwd"],
        pythonpath=site["pythonpath"],
        SEXPGPU_DISABLE_PLUGINS="mem",
        BROKEN_MARK=site["BROKEN_MARK"],
    )
    # a disabled plugin is never imported, so nothing is known of what it would supply
    assert result.stdout == (
        "no installed plugin supplies the location mem://x (mem://) (see `sexpgpu plugins`)\n"
    )


def test_unavailable_scheme_is_a_one_line_error_with_the_hint(site: dict) -> None:
    result = _sexpgpu(site, "mem", "describe", "nodep://bucket/run")
    assert result.returncode == 1
    assert result.stderr == (
        "sexpgpu mem: the location nodep://bucket/run (nodep://) needs the plugin 'nodep', "
        "which is unavailable: no_such_module_xyz is not installed: "
        "pip install 'sexpgpu-nodep[fast]'\n"
    )


def test_unknown_scheme_is_a_one_line_error(site: dict) -> None:
    result = _sexpgpu(site, "mem", "describe", "zzz://bucket")
    assert result.returncode == 1
    assert result.stderr == (
        "sexpgpu mem: no installed plugin supplies the location zzz://bucket (zzz://) "
        "(see `sexpgpu plugins`)\n"
    )


def test_a_raising_descriptor_hook_does_not_break_other_lookups(site: dict) -> None:
    make_plugin(
        site["pythonpath"][0],
        "a-broken-descriptors",
        {"t_broken_desc": BROKEN_DESCRIPTORS},
        {"a-broken-descriptors": "t_broken_desc"},
    )
    result = _sexpgpu(site, "mem", "describe", "mem://bucket")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "mem://bucket (mem test plugin, no credentials)\n"


# A user's python with an optional dependency absent: sys.modules[name] = None is how
# Python itself marks a module unimportable, so it works whether or not it is installed.
WITHOUT = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from sexpgpu_cli.main import main
main(["plugins"])
"""


@pytest.mark.parametrize(
    ("plugin", "blocked", "hint"),
    [
        (
            "tensorboard",
            ["tensorboard"],
            "tensorboard is not installed: pip install 'sexpgpu[tensorboard]'",
        ),
        ("s3", ["boto3"], "boto3 is not installed: pip install 'sexpgpu[s3]'"),
        (
            "gcs",
            ["google.cloud.storage"],
            "google.cloud.storage is not installed: pip install 'sexpgpu[gcs]'",
        ),
    ],
)
def test_builtin_plugin_without_its_dependency_shows_the_hint(
    tmp_path: Path, plugin: str, blocked: list[str], hint: str
) -> None:
    result = run_python(WITHOUT.format(blocked=blocked), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert plugin_line(result.stdout, plugin).endswith(f"unavailable: {hint}")
    # and nothing else is reported unavailable for it
    others = run_python(WITHOUT.format(blocked=[]), cwd=tmp_path)
    if plugin != "tensorboard":  # tensorboard is not in the dev extra, so usually missing
        assert plugin_line(others.stdout, plugin).endswith("  available")


def test_tensorboard_missing_in_this_environment(tmp_path: Path) -> None:
    """The dev environment does not install tensorboard: the plain CLI shows the hint."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    result = run_sexpgpu(["plugins"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "pip install 'sexpgpu[tensorboard]'" in plugin_line(result.stdout, "tensorboard")


OPEN_WITHOUT = """
import sys
sys.modules[{blocked!r}] = None
from sexpgpu.errors import SexpError
from sexpgpu.storage import open_location
try:
    open_location({uri!r})
except SexpError as exc:
    print(type(exc).__name__ + ": " + str(exc))
"""


@pytest.mark.parametrize(
    ("uri", "blocked", "plugin", "hint"),
    [
        ("s3://bucket/run", "boto3", "s3", "boto3 is not installed: pip install 'sexpgpu[s3]'"),
        (
            "gs://bucket/run",
            "google.cloud.storage",
            "gcs",
            "google.cloud.storage is not installed: pip install 'sexpgpu[gcs]'",
        ),
    ],
)
def test_cloud_location_without_its_client_names_the_extra(
    tmp_path: Path, uri: str, blocked: str, plugin: str, hint: str
) -> None:
    result = run_python(OPEN_WITHOUT.format(blocked=blocked, uri=uri), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    scheme = uri.split("://")[0]
    assert result.stdout == (
        f"PluginError: the location {uri} ({scheme}://) needs the plugin '{plugin}', "
        f"which is unavailable: {hint}\n"
    )
