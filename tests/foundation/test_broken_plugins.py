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
from sexpgpu.extension import StorageBackendInfo, module_missing
from sexpgpu.hookspecs import hookimpl


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
    # the whole message, every line of it, on the plugin's one line
    assert plugin_line(out, "broken-import").endswith(
        "unavailable: failed to load: RuntimeError: boom at import | second line never shown"
    )
    assert "traceback:" not in out, "the traceback is kept for SEXPGPU_TRACE_PLUGINS only"
    assert plugin_line(out, "broken-commands").endswith(
        "unavailable: adding its commands failed: KeyError: 'no room for commands'"
    )
    assert plugin_line(out, "broken-check").endswith(
        "unavailable: availability check failed: OSError: cannot tell"
    )
    assert plugin_line(out, "nodep").endswith(
        "unavailable: no_such_module_xyz is not installed: pip install 'sexpgpu-nodep[fast]'"
    )
    # pluggy's cause is kept, not just its first line
    assert plugin_line(out, "wrong-arguments").endswith(
        "unavailable: failed to load: PluginValidationError: "
        "Plugin 'wrong-arguments' for hook 'sexpgpu_cli_commands' | "
        "hookimpl definition: sexpgpu_cli_commands(group) | "
        "Argument(s) {'group'} are declared in the hookimpl but can not be found in the hookspec"
    )
    assert plugin_line(out, "mem").endswith("  available")
    records = {r["name"]: r for r in json.loads(_sexpgpu(site, "plugins", "--json").stdout)}
    assert records["broken-import"]["hooks"] == [] and not records["broken-import"]["available"]
    assert records["nodep"]["hooks"] == ["sexpgpu_storage_backends", "sexpgpu_unavailable"]


CAUSED = """
from sexpgpu.hookspecs import hookimpl


def _settings():
    raise KeyError("region")


try:
    _settings()
except KeyError as exc:
    raise RuntimeError("cannot configure\\nthe store") from exc
"""


def test_a_broken_plugins_reason_keeps_its_cause(site: dict) -> None:
    make_plugin(site["pythonpath"][0], "caused", {"t_caused": CAUSED}, {"caused": "t_caused"})
    result = _sexpgpu(site, "plugins")
    assert result.returncode == 0, result.stderr
    assert plugin_line(result.stdout, "caused").endswith(
        "unavailable: failed to load: RuntimeError: cannot configure | the store; "
        "caused by KeyError: 'region'"
    )


def test_trace_plugins_shows_the_traceback_under_the_plugin(site: dict) -> None:
    result = _sexpgpu(site, "plugins", SEXPGPU_TRACE_PLUGINS="1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index(plugin_line(result.stdout, "broken-import"))
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        block.append(line.strip())
    assert block[0] == "hooks: -" and block[1] == "traceback:", block
    assert block[2] == "Traceback (most recent call last):"
    assert 'raise RuntimeError("boom at import\\nsecond line never shown")' in block
    assert block[-2:] == ["RuntimeError: boom at import", "second line never shown"]
    # the traceback goes with the plugin that failed, and with --json too
    mem_at = lines.index(plugin_line(result.stdout, "mem"))
    assert "traceback:" not in lines[mem_at + 1 : mem_at + 4]
    records = {
        r["name"]: r
        for r in json.loads(_sexpgpu(site, "plugins", "--json", SEXPGPU_TRACE_PLUGINS="1").stdout)
    }
    assert "RuntimeError: boom at import" in records["broken-import"]["traceback"]
    assert records["mem"]["traceback"] is None


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
        from sexpgpu.catalog import Catalog
        from sexpgpu.errors import SexpError
        try:
            Catalog.load().open_location("mem://x")
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
    assert plugin_line(others.stdout, plugin).endswith("  available")


def test_tensorboard_is_available_with_the_dev_extra(tmp_path: Path) -> None:
    """The dev extra installs tensorboard, so the plain CLI lists its sink available."""
    result = run_sexpgpu(["plugins"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = plugin_line(result.stdout, "tensorboard")
    assert line.endswith("  available"), line


OPEN_WITHOUT = """
import sys
sys.modules[{blocked!r}] = None
from sexpgpu.catalog import Catalog
from sexpgpu.errors import SexpError
try:
    Catalog.load().open_location({uri!r})
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
